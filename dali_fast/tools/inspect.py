"""`dali-fast inspect`: what a data set holds (kind, records, classes, bytes, the classes' sizes), and with
``verify`` whether every record decodes by the one rule (JPEGs strictly), and a packed set's index and
records still match their checksums."""

from __future__ import annotations

import os
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..data.base import Reader, read_record
from ..data.checks import check_label
from ..data.open import open_dataset
from ..data.packed import MemmapReader
from ..machine import available_cpus, die_with_parent
from ..text import plural, progress_bar
from ..transforms.decode import verdict

VERIFY_CHUNK = 64  # records per task handed to a verify worker
VERIFY_SMALL = 256  # below this many records, verify in this process (starting workers costs more)


def inspect_dataset(
    path: str,
    *,
    verify: bool = False,
    emit: Callable[[str], None],
    workers: int | None = None,
    open_options: dict[str, Any] | None = None,
) -> int:
    """Describe the data set at ``path`` (opened with ``open_options``) in lines given to ``emit``; returns
    0, or 1 when ``verify`` found a bad record. ``verify`` reads and decodes every record by the one rule (`verdict`: the structural
    checks, the pixel limit, a JPEG's strict decode, Pillow for the rest; on a packed set also the index's
    and each record's crc32), in ``workers`` processes (default: every CPU), and names each bad record."""
    reader = open_dataset(path, **(open_options or {}))
    n = len(reader)
    emit(f"data set: {path} ({type(reader).__name__})")
    emit(f"records:  {n}")
    names = ", ".join(reader.classes[:5]) + (", ..." if len(reader.classes) > 5 else "")
    emit(f"classes:  {len(reader.classes)} ({names})")
    if isinstance(reader, MemmapReader):
        total = int(np.asarray(reader.records["length"], dtype=np.int64).sum())
        if verify and not reader.index_intact():
            emit(f"verify:   the index does not match its checksum (labels or offsets changed): {reader.path}")
            return 1
    else:
        if hasattr(reader, "total_bytes"):
            total = int(reader.total_bytes)
        else:
            total = int(sum(Path(reader.source(i)).stat().st_size for i in range(n)))
        for shard, what in getattr(reader, "damaged", []):  # each: the samples it cost cannot be counted
            emit(f"damaged:  {shard}: {what}")
        if getattr(reader, "skipped", None):
            emit(f"skipped:  {len(reader.skipped)} (first: {reader.skipped[0][0]}: {reader.skipped[0][1]})")
        if hasattr(reader, "label_problems"):  # Parquet: its files and columns, and the rows with a bad label
            _parquet_lines(reader, emit)
    labels = np.asarray(reader.labels, dtype=np.int64)
    counts = np.bincount(labels[(labels >= 0) & (labels < len(reader.classes))], minlength=len(reader.classes))
    emit(f"bytes:    {total} ({total / 2**20:.1f} MiB), mean {total / max(n, 1) / 1024:.1f} KiB per record")
    emit(f"per class: min {int(counts.min()) if n else 0}, max {int(counts.max()) if n else 0}")
    if not verify:
        return 0
    bad: list[tuple[int, str]] = []
    with progress_bar(n, "verify", "record") as bar:  # pragma: no mutate (display)
        for found in _verified(reader, workers):
            bad += found[1]
            bar.update(found[0])
    for i, reason in bad:
        emit(f"bad:      record {i} ({reader.source(i)}): {reason}")
    crc = " match their crc32 and" if isinstance(reader, MemmapReader) else ""
    if bad:
        emit(f"verify:   {plural(len(bad), 'bad record')} of {n}; remove or replace them (pack leaves them out)")
        return 1
    emit(f"verify:   all {n} records{crc} decode (JPEGs strictly: libjpeg-turbo reports no damage)")
    return 0


def _parquet_lines(reader: Any, emit: Callable[[str], None]) -> None:
    names = ", ".join(Path(f).name for f in reader.files[:3]) + (", ..." if len(reader.files) > 3 else "")
    c = reader.columns
    emit(
        f"parquet:  {plural(len(reader.files), 'file')} ({names}), {plural(len(reader.group_rows), 'row group')}, "
        f"columns {c.image} ({c.image_leaf}) and {c.label}"
    )
    problems = reader.label_problems
    if problems:
        first = min(problems)
        emit(f"bad labels: {len(problems)} (first: {reader.source(first)}: {problems[first]})")


def check_record(reader: Reader, i: int) -> str | None:
    """Why record ``i`` is bad by the one rule, reading and decoding all of it, or None."""
    data, label, reason = read_record(reader, i)
    if reason is None:
        reason = check_label(label, len(reader.classes))
    if reason is None and isinstance(reader, MemmapReader) and zlib.crc32(data) != int(reader.records[i]["crc32"]):
        reason = "its bytes do not match their crc32 (changed after packing)"
    return reason if reason is not None else verdict(data)


_reader: Reader | None = None  # the data set a verify worker checks (set when it starts)


def _start_worker(parent: int, reader: Reader, max_image_pixels: int | None) -> None:
    """A verify worker: dies with its parent, checks ``reader`` under the parent's pixel limit."""
    global _reader
    from PIL import Image

    die_with_parent(parent)
    Image.MAX_IMAGE_PIXELS = max_image_pixels
    _reader = reader


def _check_chunk(start: int, stop: int) -> list[tuple[int, str]]:
    """The bad records among ``start:stop`` of the worker's data set, with their reasons."""
    assert _reader is not None  # set by _start_worker
    return [(i, why) for i in range(start, stop) if (why := check_record(_reader, i)) is not None]


def _verified(reader: Reader, workers: int | None) -> Iterator[tuple[int, list[tuple[int, str]]]]:
    """(records checked, the bad ones among them) per chunk, in order: in this process for a small data
    set or one worker, else by ``workers`` processes (forked on Linux: the reader is not copied), with
    at most four chunks per worker in flight."""
    n = len(reader)
    workers = min(workers or available_cpus(), available_cpus())
    if workers <= 1 or n < VERIFY_SMALL:
        for start in range(0, n, VERIFY_CHUNK):
            stop = min(n, start + VERIFY_CHUNK)
            yield stop - start, [(i, why) for i in range(start, stop) if (why := check_record(reader, i)) is not None]
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from PIL import Image

    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    chunks = iter(range(0, n, VERIFY_CHUNK))
    start_args = (os.getpid(), reader, Image.MAX_IMAGE_PIXELS)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker, initargs=start_args) as pool:
        pending: deque = deque()

        def submit() -> None:
            start = next(chunks, None)
            if start is not None:
                stop = min(n, start + VERIFY_CHUNK)
                pending.append((stop - start, pool.submit(_check_chunk, start, stop)))

        for _ in range(4 * workers):
            submit()
        try:
            while pending:
                count, future = pending.popleft()
                submit()
                yield count, future.result()
        finally:
            for _, future in pending:
                future.cancel()
