"""`dali-fast inspect`: what a data set holds (kind, records, classes, bytes, the classes' sizes; for
multi-hot targets the label count of each class, for float targets their range), and with ``verify``
whether a packed set's index and records still match their checksums."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..data.open import open_dataset
from ..data.packed import MemmapReader
from ..data.targets import reader_targets
from ..text import plural

SHOWN_CLASSES = 32  # multi-hot classes whose label counts are listed one by one (the rest: min and max)


def inspect_dataset(
    path: str,
    *,
    verify: bool = False,
    emit: Callable[[str], None],
    open_options: dict[str, Any] | None = None,
    target: str | None = None,
    num_classes: int | None = None,
) -> int:
    """Describe the data set at ``path`` (opened with ``open_options``) in lines given to ``emit``; returns
    0, or 1 when ``verify`` found damage. ``verify`` on anything but a packed set is a one-line ValueError
    (it checks a packed set's crc32). ``target`` and ``num_classes`` open it as `open_dataset` does (a pack
    with targets shows them anyway)."""
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
            emit(f"skipped:  {len(reader.skipped)} (first: {reader.skipped[0][0]}: {reader.skipped[0][1]})")
        if hasattr(reader, "label_problems"):  # Parquet: its files and columns, and the rows with a bad label
            _parquet_lines(reader, emit)
    labels = np.asarray(reader.labels, dtype=np.int64)
    counts = np.bincount(labels[(labels >= 0) & (labels < len(reader.classes))], minlength=len(reader.classes))
    emit(f"bytes:    {total} ({total / 2**20:.1f} MiB), mean {total / max(n, 1) / 1024:.1f} KiB per record")
    emit(f"per class: min {int(counts.min()) if n else 0}, max {int(counts.max()) if n else 0}")
    _targets(reader, emit)
    if not verify:
        return 0
    if not isinstance(reader, MemmapReader):
        raise ValueError(f"{path}: --verify checks crc32 of a packed data set; pack it first")
    bad = reader.verify(progress=True)
    if bad:
        emit(f"verify:   {len(bad)} corrupt records: " + ", ".join(f"{i} ({reader.source(i)})" for i in bad[:10]))
        return 1
    emit(f"verify:   all {n} records match their crc32")
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
