"""Data sets of multi-hot and float targets for the tests: N samples imgNN of K classes whose target lists
follow a rule (`written`), written as an ImageFolder with labels.csv, as WebDataset shards (a .json list, or
an object's "labels") or packs of either, and the check that a batch's rows are what was written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import jpeg_bytes

from dali_fast import pack
from dali_fast.data.pack.webdataset import pack_shards


def loader_class(backend: str):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return DALIIterator
    from dali_fast import TorchIterator

    return TorchIterator


K = 5  # classes of the multi-hot sets
N = 13  # samples: images img00 .. img12


def written(i: int, kind: str) -> list:
    """What is written as sample i's target list."""
    if kind == "multihot":
        return sorted({i % K, (2 * i + 1) % K}) if i % 4 else []  # every fourth sample has no class
    return [float(i), i / 2, -3.25 * i]


def row(i: int, kind: str) -> np.ndarray:
    if kind == "float":
        return np.array(written(i, kind), dtype=np.float32)
    out = np.zeros(K, np.float32)
    out[written(i, kind)] = 1
    return out


def sample_of(source: str) -> int:
    """The sample number in a record's source (a path, a stored path or shard:member): img07 -> 7; a row of
    `write_parquet` (x.parquet:7 -> 7) or a key of shards written in the samples' order (shard-000000007.jpg)."""
    named = re.findall(r"img(\d+)", source)
    return int(named[-1] if named else re.findall(r"(?:-|\.parquet:)(\d+)", source)[-1])


def write_folder(root: Path, kind: str, lists: dict[int, list] | None = None) -> Path:
    """root/{a,b}/imgNN.jpg with labels.csv: a header, quoted cells, several numbers in a cell."""
    for i in range(N):
        folder = root / ("a" if i < 7 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i:02d}.jpg").write_bytes(jpeg_bytes(20 + i, 16 + i % 3))
    lines = ["path,labels"]
    for i in range(N):
        values = (lists or {}).get(i, written(i, kind))
        rel = f"{'a' if i < 7 else 'b'}/img{i:02d}.jpg"
        if i % 2:  # one number per cell
            lines.append(",".join([f"./{rel}" if i == 3 else rel, *map(repr, values)]))
        else:  # all in one quoted cell, separated by spaces
            lines.append(f'"{rel}","{" ".join(map(repr, values))}"')
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def write_shards(root: Path, kind: str, shape: str, lists: dict[int, list] | None = None) -> Path:
    """Two shards of the N samples, each with a .json target list (the list, or an object's "labels")
    and, for objects, a .cls label."""
    wds = pytest.importorskip("webdataset")
    root.mkdir(parents=True)
    for s, samples in enumerate((range(7), range(7, N))):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar")) as sink:
            for i in samples:
                values = (lists or {}).get(i, written(i, kind))
                doc = values if shape == "list" else {"labels": values, "caption": f"image {i}"}
                sample = {
                    "__key__": f"img{i:02d}",
                    "jpg": jpeg_bytes(20 + i, 16 + i % 3),
                    "json": json.dumps(doc).encode(),
                }
                if shape == "object":
                    sample["cls"] = str(i % 3).encode()
                sink.write(sample)
    return root


def write_parquet(path: Path, kind: str) -> Path:
    """The N samples as one Parquet file of two row groups: a binary image column and a list column of
    their target lists (list<int64> for multihot, list<double> for float), row i sample i."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    value = pa.int64() if kind == "multihot" else pa.float64()
    images = pa.array([jpeg_bytes(20 + i, 16 + i % 3) for i in range(N)], pa.binary())
    table = pa.table({"image": images, "labels": pa.array([written(i, kind) for i in range(N)], pa.list_(value))})
    pq.write_table(table, path, row_group_size=7)
    return path


SOURCES = [
    "folder",
    "wds-list",
    "wds-object",
    "packed-folder",
    "packed-wds",
    "parquet",
    "packed-parquet",
    "written-shards",
]


def make_source(tmp_path: Path, source: str, kind: str) -> tuple[str, dict]:
    """(path, open_dataset keywords) of ``source`` holding the N samples' ``kind`` targets."""
    opened = {"target": kind, "num_classes": K if kind == "multihot" else None}
    if source == "folder":
        return str(write_folder(tmp_path / "src", kind)), opened
    if source.startswith("wds"):
        return str(write_shards(tmp_path / "shards", kind, source.split("-")[1])), opened
    if source == "parquet":
        return str(write_parquet(tmp_path / "train.parquet", kind)), opened
    if source == "written-shards":  # pack --format webdataset, in the samples' order: each .json its list
        src = write_folder(tmp_path / "src", kind)
        report = pack_shards(src, tmp_path / "written", shuffle=False, progress=False, **opened)
        assert report.samples == N and report.skipped == []
        return str(tmp_path / "written"), opened
    if source == "packed-folder":
        src = write_folder(tmp_path / "src", kind)
    elif source == "packed-parquet":
        src = write_parquet(tmp_path / "train.parquet", kind)
    else:
        src = write_shards(tmp_path / "shards", kind, "list")
    report = pack(src, tmp_path / "packed", progress=False, **opened)
    assert (
        report.records == N
        and report.skipped == []
        and (report.target, report.target_width) == (kind, len(row(0, kind)))
    )
    return str(tmp_path / "packed"), {}  # a pack knows its targets


def check_rows(reader, loader, targets: torch.Tensor, kind: str, skipped: dict | None = None) -> list[int]:
    """The batch's rows are exactly what was written for the samples ``last_indices`` names (less the
    ``skipped`` records it accounts for); the indices of its rows."""
    idx = [i for i in loader.last_indices.tolist() if i not in (skipped or {})]
    width = K if kind == "multihot" else 3
    assert targets.dtype == torch.float32 and tuple(targets.shape) == (len(idx), width)
    expected = np.stack([row(sample_of(reader.source(i)), kind) for i in idx])
    np.testing.assert_array_equal(targets.cpu().numpy(), expected)
    return idx
