"""What readers whose records are members of larger files share (WebDataset tar shards, local or remote):
the per-record index of (file, offset, size, label, name), and the reader members that follow from it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..text import by_reason, plural
from .checks import check_index
from .classes import class_map
from .shards import describe_ignored, shard_classes

log = logging.getLogger(__name__)


def names_blob(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Member names as one uint8 blob and each name's end in it: a million names cost two arrays, not a
    million Python strings, and pickle to DataLoader workers at once."""
    encoded = [n.encode("utf-8", "surrogateescape") for n in names]
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), np.cumsum([len(x) for x in encoded], dtype=np.int64)


class MemberIndexReader:
    """The reader members of a member index: ``len``, ``labels``, ``total_bytes``, ``member(i)`` and
    ``source(i)``. A subclass sets ``shards`` (each file, as messages name it) and the per-record arrays
    ``_shard_of``, ``_offset``, ``_size``, ``_labels`` (int64) and ``_names``/``_name_ends`` (`names_blob`),
    ``_target_values``/``_target_ends`` (the samples' target lists, `base.TargetListsReader`; empty unless
    indexed for them), ``skipped`` ((shard:key, why) of the samples indexing left out) and ``damaged``
    ((shard, what) of the shards that could be read only in part or not at all: how many samples that cost
    is not known); then calls `_index_done`."""

    shards: Sequence[object]
    skipped: list[tuple[str, str]]
    damaged: list[tuple[str, str]]
    classes: list[str]
    _shard_of: np.ndarray
    _offset: np.ndarray
    _size: np.ndarray
    _labels: np.ndarray
    _names: np.ndarray
    _name_ends: np.ndarray
    _target_values: np.ndarray
    _target_ends: np.ndarray

    def _index_done(self, kind: str = "shard", classes: Sequence[str] | None = None) -> None:
        """Say once what indexing left out (samples, and damaged shards apart: the samples a damaged shard
        cost are not counted, so no count understates them), refuse an index without a sample, and name
        the classes: the declared ``classes`` (which name the labels), else "0" .. the largest label."""
        if self.damaged:
            log.warning(
                "%d of %s damaged; the samples lost with %s cannot be counted (first: %s: %s)",
                len(self.damaged),
                plural(len(self.shards), kind),
                "it" if len(self.damaged) == 1 else "them",
                *self.damaged[0],
            )
        if self.skipped:
            log.warning(
                "%s left out of %s: %s",
                plural(len(self.skipped), "sample"),
                plural(len(self.shards), kind),
                by_reason(self.skipped),
            )
        if not len(self._labels):
            found = f"; left out: {by_reason(self.skipped)}" if self.skipped else ""
            other = getattr(self, "ignored", None)
            found += f"; not read: {describe_ignored(other)}" if other else ""
            raise ValueError(
                f"{self.shards[0]}: no samples with an image and a label in {plural(len(self.shards), kind)}"
                + (found or "; the shards hold no member")
            )
        if classes is None:
            self.classes = shard_classes(self._labels, self.source)
        else:
            self.classes, _ = class_map(None, self._labels, classes, where=str(self.shards[0]), source=self.source)

    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> np.ndarray:
        """Every record's label (int64), from the index: no member is read."""
        return self._labels

    @property
    def target_lists(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample's target list end to end, and where each ends (`base.TargetListsReader`)."""
        return self._target_values, self._target_ends

    @property
    def total_bytes(self) -> int:
        """Bytes of all images (the index's sizes)."""
        return int(self._size.sum())

    def member(self, i: int) -> tuple[str, int, int]:
        """(file, offset, size) of record ``i``'s image in its file."""
        j = check_index(i, len(self))
        return str(self.shards[int(self._shard_of[j])]), int(self._offset[j]), int(self._size[j])

    def source(self, i: int) -> str:
        """``file:member`` of record ``i``."""
        j = check_index(i, len(self))
        start = int(self._name_ends[j - 1]) if j else 0
        name = bytes(self._names[start : int(self._name_ends[j])]).decode("utf-8", "surrogateescape")
        return f"{self.shards[int(self._shard_of[j])]}:{name}"
