"""`pack_shards` (``dali-fast pack --format webdataset``): any data set `open_dataset` opens, written as
WebDataset shards by `write_shards`, verified as `pack` verifies, byte-identical for any number of workers.

This process reads the records (a chunk at a time, through the reader's own batch read); worker
processes decode (and re-encode) them; the results come back in order and one writer writes them. So
the output depends only on the data and the options, and a fixed number of images is in flight.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...files import atomic_dir
from ...text import progress_bar
from ..base import Reader, StreamingReader, provides, read_batch_checked
from ..folder import ImageFolderReader, scan_image_folder
from ..open import open_dataset
from ..remote.store import is_remote, url_to_fs
from ..targets import check_target, reader_targets
from .pool import PACK_CHUNK, check_destination, check_pack_options, pool_size, prepared_in_order
from .sources import prepare
from .tar_writer import DEFAULT_SHARD_SIZE, ShardReport, check_shard_arguments, stale_shards, write_shards

log = logging.getLogger(__name__)

Prepared = tuple[bytes | None, str | None, bool]  # (bytes to write, why it is left out, re-encoded)


# pragma: no mutate start (runs in worker processes; the byte-identical test of 1 and 2 workers covers it)
def _prepare_chunk(
    raws: list[bytes | None], names: list[str], verify: bool, max_side: int | None, max_image_pixels: int | None
) -> list[Prepared]:
    """`sources.prepare` of each record (named by ``names`` in its reasons), under the parent's pixel limit (a
    spawned worker would start from Pillow's default)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_image_pixels
    return [
        (None, None, False) if raw is None else prepare(raw, verify, max_side, name)
        for raw, name in zip(raws, names, strict=True)
    ]


# pragma: no mutate end


def _read(reader: Reader, chunk: np.ndarray) -> tuple[list[bytes | None], list[Any], dict[int, str]]:
    """A chunk's records as bytes (None where bad), their targets, and why each bad one is bad. A target
    is the class index, or (multi-hot and float targets, `targets.reader_targets`) the list a ``.json``
    holds: the row's class indices, or its numbers."""
    datas, labels, bad = read_batch_checked(reader, chunk)
    raws = [None if pos in bad or d is None else bytes(memoryview(d)) for pos, d in enumerate(datas)]
    targets: list[Any] = list(labels)
    lists = reader_targets(reader)
    good = [pos for pos in range(len(chunk)) if pos not in bad]
    if lists is not None and good:
        rows = lists.rows(chunk[good])
        for pos, row in zip(good, rows, strict=True):
            targets[pos] = np.flatnonzero(row).tolist() if lists.kind == "multihot" else row.tolist()
    return raws, targets, bad


def _records(
    reader: Reader, order: np.ndarray, verify: bool, max_side: int | None, workers: int, report: ShardReport, bar: Any
) -> Iterator[tuple[bytes, Any]]:
    """(bytes, target) of each good record in ``order``: read here a chunk at a time, prepared by
    `pool.prepared_in_order`. What is left out goes to ``report.skipped``."""
    from PIL import Image  # its MAX_IMAGE_PIXELS goes with each task

    streaming = provides(reader, StreamingReader)
    if streaming:
        reader.schedule(order)  # type: ignore[attr-defined]  # remote shards download ahead, in this order

    def tasks() -> Iterator[tuple[tuple, tuple]]:
        for k in range(0, len(order), PACK_CHUNK):
            chunk = order[k : k + PACK_CHUNK]
            raws, targets, bad = _read(reader, chunk)
            names = [reader.source(i) for i in chunk.tolist()]
            if streaming:
                reader.advance(len(chunk))  # type: ignore[attr-defined]
            yield (chunk, targets, bad), (raws, names, verify, max_side, Image.MAX_IMAGE_PIXELS)

    for (chunk, targets, bad), prepared in prepared_in_order(tasks(), _prepare_chunk, workers):
        for pos, (i, (payload, reason, reencoded)) in enumerate(zip(chunk.tolist(), prepared, strict=True)):
            bar.update(1)
            if payload is None:
                report.skipped.append((reader.source(i), bad.get(pos) or reason or "rejected"))
                continue
            report.reencoded += reencoded
            yield payload, targets[pos]


def pack_shards(
    src: str | os.PathLike | Reader,
    dst: str | os.PathLike,
    *,
    prefix: str = "shard",
    shard_size: int = DEFAULT_SHARD_SIZE,
    verify: bool = True,
    max_side: int | None = None,
    shuffle: bool = True,
    workers: int | None = None,
    progress: bool = True,  # pragma: no mutate (display only)
    storage_options: dict[str, Any] | None = None,
    target: str | None = None,
    num_classes: int | None = None,
) -> ShardReport:
    """Write the data set at ``src`` (anything `open_dataset` opens, or a reader) as WebDataset shards in a new folder
    ``dst`` (whole or not at all), or at a URL where no shard of ``prefix`` is yet (each shard whole).

    ``verify`` decodes each image once and leaves out what does not decode; ``max_side`` re-encodes
    larger images as JPEG (quality 90); both as `pack` does, and what is left out is listed in the
    report. ``shuffle`` writes the records in a fixed shuffled order (seed 0), so that every shard holds
    a mix of classes (a loader streaming shards shuffles within a few shards at a time); without it the
    source's order is kept. ``workers`` processes decode; the output is byte-identical for any number.
    ``target`` and ``num_classes`` open ``src`` as `open_dataset` does (a reader writes its own): multi-hot
    and float targets are written as each sample's ``.json`` list (its class indices, or its numbers), which
    ``open_dataset(dst, target=...)`` reads back; class targets as ``.cls``.
    """
    t0 = time.perf_counter()
    check_shard_arguments(prefix, shard_size, "raise")
    check_target(target, num_classes)
    if isinstance(src, Reader) and (target is not None or num_classes is not None):
        raise ValueError("target= and num_classes= are for a path; a reader packs its own targets (open it with them)")
    check_pack_options(max_side, workers)
    remote = is_remote(dst)
    if remote:
        _refuse_existing_shards(str(dst), prefix, storage_options)
    else:
        check_destination(Path(dst), None if isinstance(src, Reader) else Path(src))
    reader = src if isinstance(src, Reader) else open_dataset(src, target=target, num_classes=num_classes)
    name = Path(str(getattr(reader, "path", src) if isinstance(src, Reader) else src)).name
    order = np.random.default_rng(0).permutation(len(reader)) if shuffle else np.arange(len(reader))
    workers = pool_size(workers, len(reader))
    if not verify and max_side is None:
        workers = 1  # nothing to decode: the structural checks run here, as the records are read
    report = ShardReport(dst=str(dst), prefix=prefix)
    report.skipped += _left_out_before(reader)
    bar = progress_bar(len(order), f"pack {name}", "img", enabled=progress)
    try:
        records = _records(reader, order, verify, max_side, workers, report, bar)
        if remote:
            written = write_shards(records, dst, prefix=prefix, shard_size=shard_size, storage_options=storage_options)
        else:
            with atomic_dir(dst, doing="packing", what="pack") as tmp:
                written = write_shards(records, tmp, prefix=prefix, shard_size=shard_size)
    finally:
        bar.close()
        getattr(reader, "close", lambda: None)()
    report.shards, report.samples, report.bytes = written.shards, written.samples, written.bytes
    report.seconds = time.perf_counter() - t0
    for where, why in report.skipped:
        log.warning("left out %s: %s", where, why)
    return report


def _left_out_before(reader: Reader) -> list[tuple[str, str]]:
    """What the source left out before any record was read: files of other kinds in an ImageFolder (as
    `pack` lists them), folders that could not be listed, shards' samples without an image or a label."""
    skipped = [tuple(x) for x in getattr(reader, "skipped", [])]
    if isinstance(reader, ImageFolderReader):
        _, _, other, _ = scan_image_folder(reader.path)
        skipped += other  # (path, what it is): other files, links that lead nowhere...
    return skipped  # type: ignore[return-value]


def _refuse_existing_shards(url: str, prefix: str, storage_options: dict[str, Any] | None) -> None:
    fs, root = url_to_fs(url.rstrip("/"), storage_options)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root.rstrip("/"), detail=False, refresh=True)]
    except FileNotFoundError:
        return
    found = stale_shards(names, prefix, 0)
    if found:
        raise FileExistsError(
            f"{url}: already holds shards of prefix {prefix!r} ({found[0]}, ...); remove them, or choose another "
            "URL or --prefix"
        )
