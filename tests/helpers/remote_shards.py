"""WebDataset shards on a local S3 server for the object-storage tests: each sample's label is its number,
so a loader's labels name exactly which samples came; the server counts the bytes it served per object."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from builders import jpeg_bytes

if TYPE_CHECKING:
    from object_store import S3Server

SHARDS, PER_SHARD = 6, 8
N = SHARDS * PER_SHARD
SPEC = "s3://data/train-{000000..000005}.tar"


def shard_bytes(first: int, count: int, *, cut: int | None = None) -> tuple[bytes, dict[int, bytes]]:
    """A WebDataset tar of samples ``first..first+count-1`` (label = sample number), and their images."""
    wds = pytest.importorskip("webdataset")
    buf, images = io.BytesIO(), {}
    with wds.TarWriter(buf) as sink:
        for i in range(first, first + count):
            image = jpeg_bytes(24 + i % 13, 20 + i % 7, (i * 5 % 256, 90, 200 - i))
            sink.write({"__key__": f"sample{i:05d}", "jpg": image, "cls": str(i).encode()})
            images[i] = image
    data = buf.getvalue()
    return (data[:cut] if cut else data), images


def make_shards() -> tuple[dict[str, bytes], dict[int, bytes]]:
    objects, images = {}, {}
    for s in range(SHARDS):
        objects[f"train-{s:06d}.tar"], imgs = shard_bytes(s * PER_SHARD, PER_SHARD)
        images.update(imgs)
    return objects, images


def opts(server: S3Server, tmp_path: Path, cache: str = "cache", **kw) -> dict:
    kw.setdefault("index_dir", tmp_path / "index")
    return {"storage_options": {"endpoint_url": server.endpoint}, "cache_dir": tmp_path / cache, **kw}


def epoch_labels(loader, epoch: int = 0) -> list[int]:
    loader.set_epoch(epoch)
    return [int(x) for _, labels in loader for x in labels.tolist()]


def served_per_shard(server) -> dict[str, int]:
    return {k.split("/", 1)[1]: v for k, v in server.bytes_served.items()}


def sizes(server) -> dict[str, int]:
    return {k: len(v) for k, v in server.objects.items()}
