"""`ParquetReader`: image sets stored as Parquet (Hugging Face ``datasets``, Spark, Ray) read in place.

Opening reads the files' footers and label column only (`parquet_index`), and saves that index under
``$DALI_FAST_CACHE/parquet-index``, keyed on each file's size, mtime, inode, device and ctime, so a
second open costs milliseconds and a changed file is indexed again.

A Parquet file is read by row group (its compressed pages have no per-row offsets): a row group's image
column is read whole, once, into a small per-process LRU of row groups bounded in bytes
(``row_group_cache``), and every record is a zero-copy view into its Arrow buffer. Each row is checked
(`check_encoded`) once, when its group is read, in the reader threads. So the order matters:

- a random-access shuffle reads a row group for nearly every sample unless the whole set fits in the
  row-group cache: it is the default only for such sets (then every group is read once per process);
- larger sets use the streaming order (`loaders.order.StreamingOrder`): row groups shuffled, then
  samples shuffled within windows of ``shuffle_window`` row groups, each group read once per pass.

``streaming=True``/``False`` chooses; docs/data.md has the measured cost of each. A null image, a null
label, a label outside the class names and bytes that are not an image are bad records named
``file.parquet:row``, which the loaders raise or skip and count (``on_error``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..files import default_cache_dir
from ..text import plural
from .base import CheckedBatch, read_parallel, reset_after_fork
from .cache import LRUCache
from .checks import check_index, check_label
from .classes import class_map, remap_labels
from .parquet_group import NULL_IMAGE, RowGroup
from .parquet_index import ParquetIndex, expand_parquet, load_or_build, local_identity, pyarrow_parquet
from .path_refs import PathRefs
from .shards import shard_classes
from .targets import NULL_LIST, attach_targets, check_target

log = logging.getLogger(__name__)

ROW_GROUP_CACHE = 256 << 20  # bytes of row groups kept per process (a set this small is read at random)
MAX_WINDOW = 64  # row groups shuffled together at most (more costs memory, not mixing that matters)
NULL_LABEL = "null label"


def check_reading(shuffle_window: int | None, row_group_cache: int) -> None:
    """Refuse a ``shuffle_window`` that is not a positive number of row groups, or a negative
    ``row_group_cache``, in one line before any file is opened (local and remote readers alike)."""
    if shuffle_window is not None and (not isinstance(shuffle_window, int) or shuffle_window < 1):
        raise ValueError(f"shuffle_window={shuffle_window!r}: must be a positive number of row groups")
    if row_group_cache < 0:
        raise ValueError(f"row_group_cache={row_group_cache}: must be >= 0 bytes")


class ParquetReader:
    """The reader interface over Parquet files (see the module docstring).

    Args:
        spec: a ``.parquet`` file, a folder of them or a Hugging Face snapshot (``data/*.parquet``), a
            brace pattern or a glob (``snapshot/data/train-*.parquet``: how a split is chosen).
        image_column: the column of encoded images (binary, or ``struct<bytes, path>``); found by type
            when None.
        label_column: the column of class labels (integers, or class names); found when None. With
            ``target="multihot"`` or ``"float"``, the list column of each row's target list (`parquet_index`).
        streaming: the streaming order over row groups (True), random access (False), or None: streaming
            when the images do not fit in ``row_group_cache``.
        shuffle_window: row groups whose samples are shuffled together in the streaming order (None:
            as many as half of ``row_group_cache`` holds, at most `MAX_WINDOW`).
        row_group_cache: bytes of row groups each process keeps (raised to two of the largest group).
        cache_dir: where the index is saved (default ``$DALI_FAST_CACHE/parquet-index``).
        target: as for `open_dataset`: "multihot" (with ``num_classes``) or "float" read a list column.
        num_classes: K, the width of multi-hot rows (a list of ``ClassLabel`` gives it).
        classes: the class names in label order (the training set's, for a validation set):
            `classes.class_map` puts the file's own labels on them.
    """

    def __init__(
        self,
        spec: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        image_column: str | None = None,
        label_column: str | None = None,
        streaming: bool | None = None,
        shuffle_window: int | None = None,
        row_group_cache: int = ROW_GROUP_CACHE,
        cache_dir: str | os.PathLike | None = None,
        target: str | None = None,
        num_classes: int | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        self._pq = pyarrow_parquet()  # one line saying how to install pyarrow, before any work
        check_target(target, num_classes)
        lists = target in ("multihot", "float")
        check_reading(shuffle_window, row_group_cache)
        paths = expand_parquet(spec) if isinstance(spec, str | os.PathLike) else [Path(p) for p in spec]
        if not paths:
            raise ValueError("no Parquet files given")
        self.files = [str(p.resolve()) for p in paths]
        self.path = Path(self.files[0]).parent
        self._meta: dict[int, Any] = {}
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "parquet-index"
        named = [(f, local_identity(f)) for f in self.files]
        index, self.index_file = load_or_build(
            named, self._open, image_column=image_column, label_column=label_column, cache=cache, lists=lists
        )
        self._use_index(index, streaming, shuffle_window, row_group_cache, classes)
        attach_targets(self, target, self._width(target, num_classes))

    def _use_index(
        self,
        index: ParquetIndex,
        streaming: bool | None,
        shuffle_window: int | None,
        row_group_cache: int,
        classes: Sequence[str] | None = None,
    ) -> None:
        """The reader's arrays from ``index`` (``self.files`` set), its classes (on the ``classes`` declared),
        path references, order and row-group LRU."""
        self.columns = index.columns
        self.target_lists = (index.target_values, index.target_ends)  # a list column's (`targets.attach_targets`)
        self.target_nulls = index.null_label  # a null list: a bad record, not a list of no numbers
        self._labels, self._null_label = index.labels, index.null_label
        self.group_rows, self.group_file, self.group_bytes = index.group_rows, index.group_file, index.group_bytes
        self.shard_bounds = np.concatenate([[0], np.cumsum(self.group_rows)]).astype(np.int64)  # per row group
        file_rows = np.bincount(self.group_file, weights=self.group_rows, minlength=len(self.files)).astype(np.int64)
        self._file_start = np.concatenate([[0], np.cumsum(file_rows)]).astype(np.int64)
        self._group_base = np.searchsorted(self.group_file, np.arange(len(self.files)))  # each file's first group
        if not len(self._labels):
            raise ValueError(f"{self.files[0]}: no rows in {plural(len(self.files), 'Parquet file')}")
        self._use_classes(index.names, classes)
        self.refs = self._path_refs(index)
        self._warn_bad_labels()
        biggest = int(self.group_bytes.max()) if len(self.group_bytes) else 0
        self.row_group_cache = max(int(row_group_cache), 2 * biggest)
        self.streaming = self.total_bytes > self.row_group_cache if streaming is None else bool(streaming)
        if shuffle_window is None:
            shuffle_window = max(1, min(MAX_WINDOW, self.row_group_cache // max(1, 2 * biggest)))
        self.shuffle_window = int(min(shuffle_window, len(self.group_rows)))
        self.reset_process_state()
        reset_after_fork(self)

    # ------------------------------------------------------------------ open
    def _use_classes(self, names: list[str] | None, declared: Sequence[str] | None) -> None:
        """The classes (the ClassLabel names, a dictionary's or a string column's names, or the labels
        seen: "0" .. the largest), or the ``declared`` ones with the labels put on them; which rows have a
        bad label (null, or outside the classes: for a remapped one, its own label is kept for messages)."""
        own = list(self.columns.names) if self.columns.names else names
        labels = self._labels
        good = np.flatnonzero(~self._null_label & (labels >= 0))
        if own is None and declared is None:  # bare labels: a warning for a sparse range, as for shards
            self.classes, remap = shard_classes(labels[good], lambda k: self.source(int(good[k]))), None
        else:
            self.classes, remap = class_map(own, labels, declared, where=self.files[0], source=self.source)
        self._own_count = len(own) if own is not None else len(self.classes)
        outside = ~self._null_label & ((labels < 0) | (labels >= self._own_count))
        self._own_bad = {int(i): int(labels[i]) for i in np.flatnonzero(outside)} if remap is not None else {}
        self._labels = remap_labels(labels, remap, self._own_count)
        self._bad_label = self._null_label | (self._labels < 0) | (self._labels >= len(self.classes))

    def _path_refs(self, index: ParquetIndex) -> PathRefs | None:
        """The path references (`path_refs.PathRefs`), resolved and checked; None when there are none."""
        if not len(index.ref_rows):
            return None
        return PathRefs(
            index.ref_rows, (index.ref_names, index.ref_ends), self.files, self._file_start, self.columns.image
        )

    def _width(self, target: str | None, num_classes: int | None) -> int | None:
        """The multi-hot width: ``num_classes``, or the names of a list of ``ClassLabel`` (which it must match)."""
        names = self.columns.names if self.columns.label_kind == "list" else None
        if target != "multihot" or not names:
            return num_classes
        if num_classes is not None and num_classes != len(names):
            raise ValueError(
                f"{self.files[0]}: num_classes={num_classes}, but the column {self.columns.label!r} is a list of "
                f"ClassLabel with {plural(len(names), 'name')}; leave num_classes out, or give {len(names)}"
            )
        return len(names)

    # pragma: no mutate start (the words of a log line; the loaders and `label_problems` name each record)
    def _warn_bad_labels(self) -> None:
        bad = np.flatnonzero(self._bad_label)
        if len(bad):
            log.warning(
                "%s of %s: a null label or one outside the %s (first: %s: %s); the loaders raise, or skip "
                "and count them (on_error)",
                plural(len(bad), "row"),
                plural(len(self), "row"),
                plural(len(self.classes), "class", "classes"),
                self.source(int(bad[0])),
                self._label_reason(int(bad[0])),
            )

    # pragma: no mutate end

    # pragma: no mutate start (the parsed footers are kept for speed only: without them each read parses its own)
    def _open(self, k: int) -> Any:
        """File ``k`` as a ``pyarrow.parquet.ParquetFile`` (its footer parsed once per process, then
        shared): every read of a file goes through here."""
        meta = self._meta.get(k)
        pf = self._pq.ParquetFile(self.files[k], metadata=meta, pre_buffer=False)
        if meta is None:
            self._meta[k] = pf.metadata
        return pf

    # pragma: no mutate end

    # ------------------------------------------------------------------ the row groups
    def _load(self, gid: int) -> RowGroup | str:
        """Row group ``gid`` read whole, or why it cannot be (a damaged or shortened file)."""
        import pyarrow as pa

        k = int(self.group_file[gid])
        try:
            table = self._open(k).read_row_group(
                int(gid - self._group_base[k]),
                columns=[self.columns.image_leaf],
                use_threads=False,  # pragma: no mutate
            )
            lo, hi = int(self.shard_bounds[gid]), int(self.shard_bounds[gid + 1])
            refs = self.refs.within(lo, hi) if self.refs is not None else None
            return RowGroup(table.column(0), self.columns.image_field, refs)
        except (OSError, pa.ArrowException) as e:
            return f"unreadable: row group {int(gid - self._group_base[k])} of {self.files[k]}: {e}"

    def _groups(self, gids: np.ndarray) -> dict[int, RowGroup | str]:
        """The row groups ``gids``, from this process's LRU or read in parallel (and kept)."""
        keys = gids.tolist()
        found = dict(zip(keys, self._cache.get_many(keys), strict=True))
        missing = [g for g, v in found.items() if v is None]
        for g, group in zip(missing, read_parallel(self._load, missing), strict=True):
            found[g] = group
            if isinstance(group, RowGroup):
                self._cache.put(g, group, group.nbytes)
        return found  # type: ignore[return-value]

    def _rows(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        out = np.where(idx < 0, idx + n, idx)
        if len(out) and (out.min() < 0 or out.max() >= n):
            bad = int(idx[(out < 0) | (out >= n)][0])
            check_index(bad, n)  # the IndexError naming the record
        return out

    # ------------------------------------------------------------------ reader interface
    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> np.ndarray:
        """Every row's label (int64; -1 where the label is null)."""
        return self._labels

    @property
    def total_bytes(self) -> int:
        """Bytes of the image column, uncompressed (the footers' sizes, which count 4 bytes a row more)."""
        return int(self.group_bytes.sum())

    @property
    def fingerprint(self) -> str:
        """What identifies the contents (a resume on other data is refused by it): each file's name, size
        and mtime, the row groups and the labels; the same on every node that mounts the files, and for
        a copy that keeps names and mtimes (the index's key also has inodes and devices)."""
        h = hashlib.sha1()
        for f in self.files:
            st = os.stat(f)
            h.update(f"{Path(f).name}|{st.st_size}|{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        h.update(self.group_rows.tobytes())
        h.update(self._labels.tobytes())
        return f"parquet:{len(self)}:{h.hexdigest()[:16]}"

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """The images of ``indices`` (views into their row groups, each group read once), their labels,
        and why each bad one is bad: a null or out-of-range label, a null image, bytes that are not an
        image, or a row group that cannot be read."""
        idx = self._rows(indices)
        gids = np.searchsorted(self.shard_bounds, idx, side="right") - 1
        groups = self._groups(np.unique(gids))
        datas: list[np.ndarray | None] = []
        bad: dict[int, str] = {}
        rows = (idx - self.shard_bounds[gids]).tolist()
        for pos, (i, gid, row) in enumerate(zip(idx.tolist(), gids.tolist(), rows, strict=True)):
            group = groups[gid]
            if isinstance(group, str):
                datas.append(None)
                bad[pos] = group
                continue
            why = group.reasons[row]
            datas.append(None if why == NULL_IMAGE or why and why.startswith("unreadable") else group.view(row))
            if self._bad_label[i]:
                why = self._label_reason(i)
            if why is not None:
                bad[pos] = why
        return datas, self._labels[idx], bad

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """`read_batch_checked` without the verdicts (a null image is an empty array); a row group that
        cannot be read raises OSError."""
        datas, labels, bad = self.read_batch_checked(indices)
        unreadable = next((why for why in bad.values() if why.startswith("unreadable")), None)
        if unreadable is not None:
            raise OSError(unreadable)
        return [d if d is not None else np.zeros(0, np.uint8) for d in datas], labels

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        datas, labels = self.read_batch([i])
        return datas[0], int(labels[0])

    def source(self, i: int) -> str:
        """``file.parquet:row`` of record ``i`` (the row counted from 0 in its file)."""
        j = check_index(i, len(self))
        k = int(np.searchsorted(self._file_start, j, side="right") - 1)
        return f"{self.files[k]}:{j - int(self._file_start[k])}"

    def _label_reason(self, i: int) -> str | None:
        if self._null_label[i]:
            return NULL_LIST if self.columns.label_kind == "list" else NULL_LABEL
        if i in self._own_bad:  # outside the file's own classes, before they were put on the declared ones
            return check_label(self._own_bad[i], self._own_count)
        return check_label(int(self._labels[i]), len(self.classes))

    @property
    def label_problems(self) -> dict[int, str]:
        """``{record: why its label is bad}`` (null, or outside the classes): what `pack` leaves out."""
        return {int(i): self._label_reason(int(i)) or "" for i in np.flatnonzero(self._bad_label)}

    # The streaming order's hooks: local files need nothing downloaded ahead.
    def schedule(self, order: np.ndarray, then: np.ndarray | None = None) -> None:
        """The loaders' upcoming order (nothing to fetch ahead for local files)."""

    def advance(self, count: int) -> None:
        """``count`` more records delivered (nothing to release for local files)."""

    # ------------------------------------------------------------------ processes
    def reset_process_state(self) -> None:
        """This process's own row groups (an unpickled reader, a forked child, a new reader)."""
        self._cache = LRUCache(self.row_group_cache)
        self._meta = dict(self._meta)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_pq")}
        state["_meta"] = {}  # each process parses the footers it reads
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pq = pyarrow_parquet()
        self.reset_process_state()
        reset_after_fork(self)

    def cache_stats(self) -> dict[str, float]:
        """This process's row-group LRU: hits, misses, hit_rate, evictions, bytes."""
        return self._cache.stats()

    # pragma: no mutate start (display)
    def __repr__(self) -> str:
        return (
            f"ParquetReader({plural(len(self.files), 'file')}, {plural(len(self.group_rows), 'row group')}, "
            f"records={len(self)}, classes={len(self.classes)}, {'streaming' if self.streaming else 'random access'})"
        )

    # pragma: no mutate end
