"""Targets beyond one class index: the kinds (`TARGET_KINDS`), the per-record lists a reader offers turned
into fixed-width rows once at open (`ListTargets`, checked there), and how the loaders find a reader's.

A reader that offers targets sets two members (`base.TargetReader`): ``target_kind`` ("class",
"multihot" or "float") and ``targets``, an object with ``kind``, ``width``, ``rows(indices)`` (float32
``(len(indices), width)``) and ``check(indices)`` (``{position: why that record's target is bad}``). A
reader whose targets are per-record number lists (a WebDataset ``.json`` list, a CSV row, a Parquet list
column) sets ``target_lists`` (`base.TargetListsReader`) and calls `attach_targets` at the end of its
``__init__``: the lists are checked and made into rows here, the same way for every source.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..text import plural

log = logging.getLogger(__name__)

TARGET_KINDS = ("class", "multihot", "float")
NULL_LIST = "null target list"


def check_target(target: str | None, num_classes: int | None) -> None:
    """A one-line ValueError for a target kind that is not one of `TARGET_KINDS`, or a ``num_classes`` that
    is not a positive integer or comes without ``target="multihot"``."""
    if target is not None and target not in TARGET_KINDS:
        raise ValueError(f"target={target!r}: use 'class', 'multihot' or 'float'")
    if num_classes is None:
        return
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r}: must be a positive integer")
    if target != "multihot":
        raise ValueError(
            f"num_classes={num_classes} is for target='multihot' (the width of its rows); class targets take "
            "the data set's classes and float targets the length of their lists"
        )


class ListTargets:
    """Each record's target row, from per-record number lists: ``values`` (all the lists, end to end) and
    ``ends`` (where each record's list ends in ``values``: Arrow's list layout without the leading 0).

    ``kind="multihot"``: each list holds class indices; a row is ``num_classes`` wide, 1.0 at each index.
    An index that is not a whole number in ``0..num_classes-1`` makes the record bad (listed in ``bad``,
    with the reason): the loaders raise naming it or skip and count it, as for an undecodable image; no
    index is ever clipped. ``kind="float"``: each list holds the same count D of numbers (a list of
    another length is a one-line ValueError naming the record), a row is those D numbers; a record with a
    NaN or an infinity is bad. Everything is checked here, once (O(numbers)); `check` then costs a lookup.
    """

    def __init__(
        self,
        kind: str,
        values: np.ndarray,
        ends: np.ndarray,
        num_classes: int | None = None,
        source: Callable[[int], str] = str,
        null: np.ndarray | None = None,
    ) -> None:
        values = np.asarray(values)  # any numeric dtype: the readers give float64
        ends = np.asarray(ends, dtype=np.int64)  # signed: Arrow's offsets may come as uint64
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        counts = ends - starts
        null = np.zeros(len(ends), bool) if null is None else np.asarray(null, dtype=bool)
        self.kind = kind
        self.bad: dict[int, str] = {int(i): NULL_LIST for i in np.flatnonzero(null)}
        if kind == "multihot":
            if num_classes is None:
                raise ValueError("target='multihot' needs num_classes=K, the number of classes (the rows' width)")
            self.width = int(num_classes)
            wrong = ~np.isfinite(values) | (values != np.floor(values)) | (values < 0) | (values >= self.width)
            self._starts, self._ends = starts, ends
            self._cols = np.where(wrong, 0, values).astype(np.int64)
            self._dense = None
            rec = np.repeat(np.arange(len(ends)), counts)
            for at in _firsts(rec, wrong):
                self.bad[int(rec[at])] = _index_reason(values[at], self.width)
        elif kind == "float":
            width = int(np.bincount(counts[~null]).argmax()) if (~null).any() else 0
            other = np.flatnonzero((counts != width) & ~null)
            if len(other):
                i = int(other[0])
                raise ValueError(
                    f"record {i} ({source(i)}) has {plural(int(counts[i]), 'target number')}, most records have "
                    f"{width} ({plural(len(other), 'record')} differ): float targets need the same count for every "
                    "sample; fix its list"
                )
            if width == 0:
                raise ValueError(f"{source(0)}: no numbers in the target lists; target='float' needs D >= 1 per sample")
            self.width = width
            self._dense = np.full((len(ends), width), np.nan, np.float32)
            self._dense[~null] = values.reshape(-1, width)  # a null list has no numbers: its row stays NaN
            wrong = ~np.isfinite(self._dense).all(axis=1) & ~null
            for i in np.flatnonzero(wrong).tolist():
                self.bad[i] = _not_finite(values[starts[i] : ends[i]])
        else:
            raise ValueError(f"target={kind!r}: per-record lists make 'multihot' or 'float' targets")
        self._bad_mask = np.zeros(len(ends), dtype=bool)
        self._bad_mask[list(self.bad)] = True
        self.count = len(ends)

    def __len__(self) -> int:
        return self.count

    def rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The targets of ``indices`` as float32 ``(len(indices), width)``; a bad record's is refused."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and self._bad_mask[idx].any():
            i = int(idx[np.argmax(self._bad_mask[idx])])
            raise ValueError(f"record {i}: {self.bad[i]}; it has no target row")
        if self._dense is not None:
            return self._dense[idx]
        starts, counts = self._starts[idx], self._ends[idx] - self._starts[idx]
        out = np.zeros((len(idx), self.width), dtype=np.float32)
        total = int(counts.sum())
        if total:
            row = np.repeat(np.arange(len(idx)), counts)
            before = np.cumsum(counts) - counts  # each row's first position among the gathered indices
            out[row, self._cols[np.repeat(starts - before, counts) + np.arange(total)]] = 1.0
        return out

    def check(self, indices: Sequence[int] | np.ndarray) -> dict[int, str]:
        """``{position in indices: why that record's target is bad}``, empty when all are good."""
        if not self.bad:
            return {}
        idx = np.asarray(indices, dtype=np.int64)
        return {int(pos): self.bad[int(idx[pos])] for pos in np.flatnonzero(self._bad_mask[idx])}


def _not_finite(numbers: np.ndarray) -> str:
    """Why a float target row is bad: a NaN or an infinity, or a number beyond float32's range (which the
    rows are) named as such."""
    big = np.isfinite(numbers) & (np.abs(numbers) > np.finfo(np.float32).max)
    if big.any():
        return (
            f"target {numbers.tolist()} holds {float(numbers[big][0])!r}, beyond float32's range "
            f"(+-{float(np.finfo(np.float32).max):.4g}): scale the targets"
        )
    return f"target {numbers.astype(np.float32).tolist()} holds a number that is not finite"


def _firsts(rec: np.ndarray, wrong: np.ndarray) -> list[int]:
    """The position of each record's first wrong value (``rec``: the record of each value, in order)."""
    at = np.flatnonzero(wrong)
    _, first = np.unique(rec[at], return_index=True)
    return at[first].tolist()


def _index_reason(value: float, width: int) -> str:
    if np.isfinite(value) and value == np.floor(value):
        return f"class index {int(value)} is outside 0..{width - 1} (num_classes={width})"
    return f"class index {float(value)!r} is not a whole number"


class SubsetTargets:
    """The targets of some of another reader's records (`base.SubsetReader`'s)."""

    def __init__(self, targets: Any, indices: np.ndarray) -> None:
        self.base, self.indices = targets, indices
        self.kind, self.width = targets.kind, targets.width

    def __len__(self) -> int:
        return len(self.indices)

    def rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.base.rows(self.indices[np.asarray(indices, dtype=np.int64)])

    def check(self, indices: Sequence[int] | np.ndarray) -> dict[int, str]:
        return self.base.check(self.indices[np.asarray(indices, dtype=np.int64)])


def attach_targets(reader: Any, target: str | None, num_classes: int | None) -> None:
    """Set ``reader.target_kind`` and ``reader.targets`` from its ``target_lists`` (see the module
    docstring): what a reader of per-record lists calls at the end of its ``__init__``. ``target`` None or
    "class" keeps the class index; the others need the lists, and "multihot" needs ``num_classes``.
    Records with bad targets are said once here, in a warning naming the first."""
    check_target(target, num_classes)
    kind = target or "class"
    reader.target_kind = kind
    if kind == "class":
        reader.targets = None
        return
    values, ends = reader.target_lists
    targets = ListTargets(kind, values, ends, num_classes, reader.source, getattr(reader, "target_nulls", None))
    reader.targets = targets
    if targets.bad:
        first = min(targets.bad)
        log.warning(
            "%s with a bad target (first: record %d (%s): %s); the loaders raise naming it (on_error='raise') "
            "or skip and count it (on_error='skip')",
            plural(len(targets.bad), "record"),
            first,
            reader.source(first),
            targets.bad[first],
        )


def reader_targets(reader: Any) -> Any:
    """The reader's ``targets`` when its target kind is not "class", else None (the class index is the target)."""
    return None if getattr(reader, "target_kind", "class") == "class" else reader.targets


def target_spec(reader: Any) -> tuple[str, int]:
    """(target kind, width of a model's output for it): the classes for "class", K for "multihot", D for "float"."""
    targets = reader_targets(reader)
    if targets is None:
        return "class", len(reader.classes)
    return str(targets.kind), int(targets.width)
