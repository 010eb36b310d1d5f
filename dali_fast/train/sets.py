"""The two sets of a training run: what it trains on and what it evaluates on (a validation set of its own,
``--val``, or a share held out of the training data: whole shards of a streamed set), checked against
each other, and how the first line of ``dali-fast train`` names them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.base import Reader, StreamingSubset, SubsetReader, check_labels, split
from ..data.targets import target_spec


@dataclass
class RunSets:
    """The training set, the evaluation set, and where the evaluation set came from: ``"val"`` (its own
    set), ``"shards"`` (whole shards held out of a streamed set) or ``"records"`` (records at random)."""

    train: Reader
    val: Reader
    held_out: str

    def record_ids(self, local: np.ndarray) -> np.ndarray:
        """The data set's record numbers of the training set's records ``local``."""
        return self.train.indices[local] if isinstance(self.train, SubsetReader) else np.asarray(local)


def run_sets(reader: Reader, val: Any, holdout: float, seed: int) -> RunSets:
    """The sets of a run on ``reader``: all of it and ``val`` (a reader, or a path or URL, opened with the
    training set's classes and targets: one class map for both), or `split` (about ``holdout`` held out,
    drawn from ``seed``)."""
    if val is None:
        train, held = split(reader, holdout, seed)
        return RunSets(train, held, "shards" if isinstance(held, StreamingSubset) else "records")
    if isinstance(val, str | os.PathLike):  # opened with the training set's targets and class map
        from ..data.open import open_dataset

        kind, width = target_spec(reader)
        targets = {} if kind == "class" else {"target": kind, "num_classes": width if kind == "multihot" else None}
        val = open_dataset(val, classes=reader.classes, **targets)
    check_same_classes(reader, val)
    return RunSets(reader, val, "val")


def check_same_classes(train: Reader, val: Reader) -> None:
    """Refuse, in one line, a validation set whose labels mean other classes than the training set's: the
    class lists must agree wherever both have a name (one may have more: a set without its last classes)."""
    a, b = list(train.classes), list(val.classes)
    shared = min(len(a), len(b))
    if a[:shared] != b[:shared]:
        k = next(i for i in range(shared) if a[i] != b[i])
        raise ValueError(
            f"the validation set {where(val) or ''} calls label {k} {b[k]!r}, the training set calls it {a[k]!r}: "
            "their class lists differ; give both sets the same classes (the same class folders or names)"
        )
    kind = target_spec(train)[0]
    if target_spec(val)[0] != kind:
        raise ValueError(
            f"the validation set has {target_spec(val)[0]} targets and the training set {kind} targets; open both "
            "with the same --target"
        )


def check_val_labels(sets: RunSets, on_error: str) -> None:
    """A validation set of its own has its labels checked against the training set's classes, as the
    training data's are (`check_labels`): once, before any step."""
    kind, width = target_spec(sets.train)
    if sets.held_out == "val" and kind == "class" and on_error == "raise":  # "skip" skips them as bad records
        check_labels(sets.val, width)


def held_out_note(sets: RunSets, holdout: float) -> str:
    """What a message adds to the training set's size where the evaluation set was held out of it."""
    return "" if sets.held_out == "val" else f" after holding out {holdout:.0%}"


def where(reader: Reader) -> str:
    """The path or URL a reader (or the set a subset is of) was opened from; "" when it has none."""
    base = reader.reader if isinstance(reader, SubsetReader) else reader
    path = getattr(base, "path", None)
    return "" if path is None else str(path)


def describe(sets: RunSets) -> str:
    """What the first line says of the sets: the training set's images and path, then the evaluation set's."""
    train, val = sets.train, sets.val
    source = where(train)
    text = f"{len(train)} images" + (f" of {source}" if source else "")
    if sets.held_out == "val":
        other = where(val)
        return f"{text}, evaluating on {len(val)} images" + (f" of {other}" if other else "")
    if sets.held_out == "shards":
        shards = len(val.shards)  # type: ignore[attr-defined]
        noun = "row group" if hasattr(val.reader, "group_rows") else "shard"  # type: ignore[attr-defined]
        return f"{text}, evaluating on {len(val)} held out of it ({shards} whole {noun}{'s' * (shards != 1)})"
    return f"{text}, evaluating on {len(val)} held out of it"
