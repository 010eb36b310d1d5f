"""`dali-fast inspect`: what a data set holds (kind, records, classes, bytes, the classes' sizes; for
multi-hot targets the label count of each class, for float targets their range), and with ``verify``
whether every record decodes by the one rule (JPEGs strictly), and a packed set's index and records still
match their checksums."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..data.base import Reader, read_record
from ..data.checks import check_label
from ..data.open import open_dataset
from ..data.pack.pool import prepared_in_order
from ..data.packed import MemmapReader
from ..data.shards import describe_ignored
from ..data.targets import reader_targets
from ..data.verify import verdict
from ..machine import available_cpus
from ..text import by_reason, plural, progress_bar

VERIFY_CHUNK = 64  # records per task handed to a verify worker
VERIFY_SMALL = 256  # below this many records, verify in this process (starting workers costs more)

SHOWN_CLASSES = 32  # multi-hot classes whose label counts are listed one by one (the rest: min and max)


def inspect_dataset(
    path: str,
    *,
    verify: bool = False,
    emit: Callable[[str], None],
    workers: int | None = None,
    open_options: dict[str, Any] | None = None,
    target: str | None = None,
    num_classes: int | None = None,
) -> int:
    """Describe the data set at ``path`` (opened with ``open_options``) in lines given to ``emit``; returns
    0, or 1 when ``verify`` found a bad record. ``verify`` reads and decodes every record by the one rule (`verdict`: the structural
    checks, the pixel limit, a JPEG's strict decode, Pillow for the rest; on a packed set also the index's
    and each record's crc32, which covers its target block), in ``workers`` processes (default: every CPU),
    and names each bad record. ``target`` and ``num_classes`` open it as `open_dataset` does (a pack with
    targets shows them anyway)."""
    reader = open_dataset(path, target=target, num_classes=num_classes, **(open_options or {}))
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
            emit(f"skipped:  {len(reader.skipped)}: {by_reason(reader.skipped)}")
        if getattr(reader, "ignored", None):  # shards: members that belong to a sample but are not read
            emit(f"not read: {describe_ignored(reader.ignored)}")
        if hasattr(reader, "label_problems"):  # Parquet: its files and columns, and the rows with a bad label
            _parquet_lines(reader, emit)
    labels = np.asarray(reader.labels, dtype=np.int64)
    counts = np.bincount(labels[(labels >= 0) & (labels < len(reader.classes))], minlength=len(reader.classes))
    emit(f"bytes:    {total} ({total / 2**20:.1f} MiB), mean {total / max(n, 1) / 1024:.1f} KiB per record")
    emit(f"per class: min {int(counts.min()) if n else 0}, max {int(counts.max()) if n else 0}")
    _targets(reader, emit)
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
    emit(f"verify:   {'all ' if n > 1 else ''}{plural(n, 'record')}{crc} decode (JPEGs strictly: libjpeg-turbo reports no damage)")
    return 0


def _parquet_lines(reader: Any, emit: Callable[[str], None]) -> None:
    names = ", ".join(Path(f).name for f in reader.files[:3]) + (", ..." if len(reader.files) > 3 else "")
    c = reader.columns
    emit(
        f"parquet:  {plural(len(reader.files), 'file')} ({names}), {plural(len(reader.group_rows), 'row group')}, "
        f"columns {c.image} ({c.image_leaf}) and {c.label}"
    )
    if getattr(reader, "refs", None) is not None:
        emit(f"paths:    {len(reader.refs)} of {plural(len(reader), 'image')} are paths to files (read from there)")
    problems = reader.label_problems
    if problems:
        first = min(problems)
        emit(f"bad labels: {len(problems)} (first: {reader.source(first)}: {problems[first]})")


def _targets(reader: object, emit: Callable[[str], None], chunk: int = 65536) -> None:
    """What the targets hold, read in chunks of rows: for multi-hot, the labels per record and per class;
    for float, the range of the numbers. Records whose target is bad are counted, not read."""
    targets = reader_targets(reader)
    if targets is None:
        return
    n, width = len(reader), int(targets.width)  # type: ignore[arg-type]
    sums, per_record = np.zeros(width), np.zeros(0)
    low, high, bad = np.inf, -np.inf, 0
    for start in range(0, n, chunk):
        idx = np.arange(start, min(start + chunk, n))
        wrong = targets.check(idx)
        bad += len(wrong)
        rows = targets.rows(np.delete(idx, list(wrong))).astype(np.float64)
        sums += rows.sum(axis=0)
        per_record = np.concatenate([per_record, rows.sum(axis=1)])
        if rows.size:
            low, high = min(low, float(rows.min())), max(high, float(rows.max()))
    bad_s = f", {bad} with a bad target (skipped or refused by the loaders)" if bad else ""
    if targets.kind == "float":
        emit(f"targets:  float, {width} numbers per record, from {low:g} to {high:g}{bad_s}")
        return
    counts = sums.astype(np.int64)
    mean = float(per_record.mean()) if len(per_record) else 0.0
    empty = int((per_record == 0).sum())
    emit(f"targets:  multihot, {width} classes, {mean:.2f} labels per record, {empty} records with none{bad_s}")
    shown = ", ".join(f"{k}: {int(c)}" for k, c in enumerate(counts[:SHOWN_CLASSES]))
    emit(f"labels per class: {shown}" + (", ..." if width > SHOWN_CLASSES else ""))
    lo, hi = int(np.argmin(counts)), int(np.argmax(counts))
    emit(f"labels per class: min {int(counts[lo])} (class {lo}), max {int(counts[hi])} (class {hi})")


def check_record(reader: Reader, i: int) -> str | None:
    """Why record ``i`` is bad by the one rule, reading and decoding all of it, or None."""
    data, label, reason = read_record(reader, i)
    if reason is None:
        reason = check_label(label, len(reader.classes))
    if (
        reason is None
        and isinstance(reader, MemmapReader)
        and reader.crc_of(i, data) != int(reader.records[i]["crc32"])
    ):
        reason = "its bytes do not match their crc32 (changed after packing)"
    return reason if reason is not None else verdict(data)


_reader: Reader | None = None  # the data set a verify worker checks (set when it starts)


def _start_worker(reader: Reader, max_image_pixels: int | None) -> None:
    """A verify worker checks ``reader`` under the parent's pixel limit."""
    global _reader
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_image_pixels
    _reader = reader


def _check_chunk(start: int, stop: int) -> list[tuple[int, str]]:
    """The bad records among ``start:stop`` of the worker's data set, with their reasons."""
    assert _reader is not None  # set by _start_worker
    return [(i, why) for i in range(start, stop) if (why := check_record(_reader, i)) is not None]


def _verified(reader: Reader, workers: int | None) -> Iterator[tuple[int, list[tuple[int, str]]]]:
    """(records checked, the bad ones among them) per chunk, in order: in this process for a small data
    set or one worker, else by ``workers`` processes (forked on Linux: the reader is not copied) through
    the packs' ordered pool (`pack.pool.prepared_in_order`)."""
    n = len(reader)
    workers = min(workers or available_cpus(), available_cpus())
    if workers <= 1 or n < VERIFY_SMALL:
        for start in range(0, n, VERIFY_CHUNK):
            stop = min(n, start + VERIFY_CHUNK)
            yield stop - start, [(i, why) for i in range(start, stop) if (why := check_record(reader, i)) is not None]
        return
    from PIL import Image

    tasks = ((min(n, k + VERIFY_CHUNK) - k, (k, min(n, k + VERIFY_CHUNK))) for k in range(0, n, VERIFY_CHUNK))
    yield from prepared_in_order(tasks, _check_chunk, workers, _start_worker, (reader, Image.MAX_IMAGE_PIXELS))
