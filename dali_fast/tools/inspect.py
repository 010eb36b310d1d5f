"""`dali-fast inspect`: what a data set holds (kind, records, classes, bytes, the classes' sizes), and with
``verify`` whether a packed set's index and records still match their checksums."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..data.open import open_dataset
from ..data.packed import MemmapReader
from ..text import plural


def inspect_dataset(
    path: str, *, verify: bool = False, emit: Callable[[str], None], open_options: dict[str, Any] | None = None
) -> int:
    """Describe the data set at ``path`` (opened with ``open_options``) in lines given to ``emit``; returns
    0, or 1 when ``verify`` found damage. ``verify`` on anything but a packed set is a one-line ValueError
    (it checks a packed set's crc32)."""
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
