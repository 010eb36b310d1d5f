"""What every data set looks like to the loaders (`Reader`, and the optional members a reader may
have), the reads with their checks, the shared reader threads, subsets (of records, or of whole shards
that still stream) and fingerprints."""

from __future__ import annotations

import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..text import plural
from .checks import check_encoded, check_label
from .targets import SubsetTargets, reader_targets

T, R = TypeVar("T"), TypeVar("R")

ON_ERROR = ("raise", "skip")  # what a reader or a loader does with a bad record: name it and stop, or skip it


def check_on_error(on_error: str) -> str:
    """``on_error`` when it is one of `ON_ERROR`, else a one-line ValueError naming the choices."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
    return on_error


CheckedBatch = tuple[list[np.ndarray | None], np.ndarray, dict[int, str]]
"""A batch read with its checks: the records' bytes (None where unreadable), their int64 labels, and
``{position in the batch: why that record is bad}`` (empty when every record is good)."""


@runtime_checkable
class Reader(Protocol):
    """What every data set looks like to the loaders: ``len(reader)``, ``reader[i] -> (encoded bytes as a
    uint8 array, label)``, ``reader.classes`` and ``reader.source(i)`` (where record ``i`` came from, for
    messages). A reader may also have the optional members declared by the protocols below; the loaders
    use each where `provides` finds it, and do without it otherwise."""

    classes: list[str]

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> tuple[np.ndarray, int]: ...
    def source(self, i: int) -> str: ...


class BatchReader(Protocol):
    """Optional: reads a batch at once (in the reader threads, or as views of a map) with the read-time
    checks of `read_checked`. The package's readers also have ``read_batch(indices) -> (bytes, labels)``,
    the same without the checks."""

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch: ...


class LabelledReader(Protocol):
    """Optional: every record's label as one int64 array (read without the records), for label checks."""

    labels: np.ndarray


class TargetReader(Protocol):
    """Optional: targets beyond one class index. ``target_kind`` is "class", "multihot" or "float"; for the
    last two, ``targets`` has ``kind``, ``width``, ``rows(indices)`` (float32 ``(len(indices), width)``) and
    ``check(indices)`` (``{position: why that record's target is bad}``, checked once at open). The loaders
    then yield those rows instead of the labels, and treat a record with a bad target as a bad record."""

    target_kind: str
    targets: Any


class TargetListsReader(Protocol):
    """Optional: the per-record number lists targets are made from (a WebDataset ``.json`` list, a CSV row,
    a Parquet list column), as ``(values, ends)``: every list end to end (float64) and where each record's
    ends (int64; Arrow's offsets without the leading 0). Such a reader takes ``target=`` and ``num_classes=``
    and calls `targets.attach_targets` at the end of its ``__init__``, which makes it a `TargetReader`."""

    target_lists: tuple[np.ndarray, np.ndarray]


class FingerprintedReader(Protocol):
    """Optional: what identifies the contents (a resume on other data is refused by it)."""

    fingerprint: str


class StreamingReader(Protocol):
    """Optional: a reader of shards streamed in order (remote shards). ``shard_bounds`` are the first
    record of each shard and the total; the loaders then use the streaming order over windows of
    ``shuffle_window`` shards, tell the reader each pass's order (`schedule`) and what was delivered
    (`advance`), so it downloads ahead."""

    streaming: bool
    shard_bounds: np.ndarray
    shuffle_window: int

    def schedule(self, order: np.ndarray, then: np.ndarray | None = None) -> None: ...
    def advance(self, count: int) -> None: ...


_MISSING = object()


def provides(reader: object, protocol: type) -> bool:
    """Whether ``reader`` has every member ``protocol`` declares: looked up statically, so no property
    is computed (a folder's fingerprint reads every file's metadata)."""
    names = [*getattr(protocol, "__annotations__", {}), *(k for k, v in vars(protocol).items() if callable(v))]
    return all(
        inspect.getattr_static(reader, name, _MISSING) is not _MISSING for name in names if not name.startswith("_")
    )


def read_record(reader: Reader, i: int) -> tuple[np.ndarray | None, int, str | None]:
    """``reader[i]`` as (bytes, label, None), or (None, -1, reason) when the record's file cannot be read
    (permissions, a broken symlink, a file that vanished): a bad record, handled like any other."""
    try:
        data, label = reader[i]
    except OSError as e:
        return None, -1, f"unreadable: {e.strerror or e}"
    return data, label, None


def read_checked(reader: Reader, i: int) -> tuple[np.ndarray | None, int, str | None]:
    """``reader[i]`` with the cheap checks: (bytes, label, None), or (bytes or None, label, why it is bad).
    A record whose target (`TargetReader`) was found bad at open is bad too."""
    data, label, reason = read_record(reader, i)
    if reason is None:
        reason = check_label(label, len(reader.classes)) or check_encoded(data)
    targets = reader_targets(reader)
    if reason is None and targets is not None:
        reason = targets.check([i]).get(0)
    return data, label, reason


def read_batch_checked(reader: Reader, indices: Sequence[int]) -> CheckedBatch:
    """`read_checked` for a batch: through the reader's own ``read_batch_checked`` where it has one
    (a packed set checks in O(1) per record, folders and shards read in parallel), else record by record.
    Records whose targets were found bad at open (`TargetReader`) are bad too: a lookup per batch."""
    return batch_reader(reader)(indices)


def batch_reader(reader: Reader) -> Callable[[Sequence[int]], CheckedBatch]:
    """`read_batch_checked` for ``reader``, with what it provides looked up once (a feed reads many batches)."""
    if provides(reader, BatchReader):
        targets = reader_targets(reader)
        if targets is None:
            return reader.read_batch_checked  # type: ignore[attr-defined]
        return functools.partial(_with_target_checks, reader.read_batch_checked, targets)  # type: ignore[attr-defined]
    return functools.partial(_read_records_checked, reader)  # read_checked checks the targets


def _with_target_checks(
    read: Callable[[Sequence[int]], CheckedBatch], targets: Any, indices: Sequence[int]
) -> CheckedBatch:
    datas, labels, bad = read(indices)
    for pos, why in targets.check(indices).items():
        bad.setdefault(pos, why)
    return datas, labels, bad


def _read_records_checked(reader: Reader, indices: Sequence[int]) -> CheckedBatch:
    datas: list[np.ndarray | None] = []
    found: list[int] = []
    bad: dict[int, str] = {}
    for pos, i in enumerate(np.asarray(indices, dtype=np.int64).tolist()):
        data, label, reason = read_checked(reader, i)
        datas.append(data)
        found.append(label)
        if reason is not None:
            bad[pos] = reason
    return datas, np.asarray(found, dtype=np.int64), bad


READ_THREADS = 8  # files read at once per process: what hides a network file system's latency
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def read_pool() -> ThreadPoolExecutor:
    """This process's pool of ``READ_THREADS`` reader threads, shared by every reader; made on first use
    (and again in a forked child, which inherits the object but not its threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dali_fast-read")
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


class ProcessStateReader(Protocol):
    """A reader with state of its own process (a row-group LRU, download threads, pins) that a forked child
    (a DataLoader worker) must not inherit: `reset_after_fork` has it start afresh there."""

    def reset_process_state(self) -> None: ...


_FORK_RESETS: weakref.WeakSet = weakref.WeakSet()


def reset_after_fork(reader: ProcessStateReader) -> None:
    """Call ``reader.reset_process_state()`` in every forked child of this process, for as long as the
    reader lives: a lock a reader thread held at the fork, a cache or a download stream are the parent's."""
    _FORK_RESETS.add(reader)


# pragma: no mutate start (runs in forked children, where mutmut does not follow; the fork tests cover it)
def _after_fork_in_child() -> None:
    _forget_pool()
    for reader in list(_FORK_RESETS):
        reader.reset_process_state()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# pragma: no mutate end


def read_parallel(read: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[read(x) for x in items]`` in order, by the read pool: the items split into one run per thread, so
    that slow reads (a network file system) overlap and the pool's bookkeeping is per run, not per item.
    An exception ``read`` raises reaches the caller once every run has finished: no read outlives the call."""
    if len(items) < 2:
        return [read(x) for x in items]
    step = -(-len(items) // READ_THREADS)
    runs = [read_pool().submit(_read_run, read, items[k : k + step]) for k in range(0, len(items), step)]
    wait(runs)  # every run done, so a failure is raised with no read still holding a file open
    return [r for run in runs for r in run.result()]


def _read_run(read: Callable[[T], R], items: Sequence[T]) -> list[R]:
    return [read(x) for x in items]


class SubsetReader:
    """The reader interface over some of another reader's records (e.g. a held-out split)."""

    def __init__(self, reader: Reader, indices: Sequence[int]) -> None:
        self.reader, self.indices = reader, np.asarray(indices, dtype=np.int64)
        self.classes = reader.classes

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.reader[int(self.indices[i])]

    def source(self, i: int) -> str:
        return self.reader.source(int(self.indices[i]))

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.reader.labels)[self.indices]  # type: ignore[attr-defined]

    @property
    def target_kind(self) -> str:
        return getattr(self.reader, "target_kind", "class")

    @property
    def targets(self) -> SubsetTargets | None:
        """The subset's targets (the records' rows of the whole set's), or None for class targets."""
        targets = reader_targets(self.reader)
        return None if targets is None else SubsetTargets(targets, self.indices)


class StreamingSubset(SubsetReader):
    """Whole shards of a streaming reader (`StreamingReader`), still streamed: the loaders use the
    streaming order over the subset's own shard bounds, and the reader downloads ahead in that order.

    Args:
        reader: a streaming reader.
        shards: the shards (by number) the subset holds, in the reader's order.
    """

    def __init__(self, reader: Reader, shards: Sequence[int]) -> None:
        bounds = np.asarray(reader.shard_bounds, dtype=np.int64)  # type: ignore[attr-defined]
        self.shards = np.sort(np.asarray(shards, dtype=np.int64))
        counts = np.diff(bounds)[self.shards]
        firsts = np.repeat(bounds[self.shards] - (np.cumsum(counts) - counts), counts)
        super().__init__(reader, firsts + np.arange(int(counts.sum()), dtype=np.int64))
        self.shard_bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.shuffle_window = int(reader.shuffle_window)  # type: ignore[attr-defined]

    @property
    def streaming(self) -> bool:
        return bool(self.reader.streaming)  # type: ignore[attr-defined]

    def schedule(self, order: np.ndarray, then: np.ndarray | None = None) -> None:
        """The reader's `schedule`, in its own record numbers."""
        self.reader.schedule(self.indices[order], None if then is None else self.indices[then])  # type: ignore[attr-defined]

    def advance(self, count: int) -> None:
        self.reader.advance(count)  # type: ignore[attr-defined]


def split(reader: Reader, holdout: float, seed: int = 0) -> tuple[SubsetReader, SubsetReader]:
    """(train, held-out) subsets, about ``holdout`` of the records held out, drawn from ``seed``.

    A reader read by random access gives records drawn at random. A streaming reader gives whole shards
    (`StreamingSubset`s: WebDataset shards, Parquet row groups), drawn at random until they hold the
    share, so both sides still stream: records drawn across every shard would make training read each
    shard many times an epoch. Refused in one line when it has fewer than two shards with records."""
    k = max(1, int(round(len(reader) * holdout)))
    if provides(reader, StreamingReader) and reader.streaming:  # type: ignore[attr-defined]
        counts = np.diff(np.asarray(reader.shard_bounds, dtype=np.int64))  # type: ignore[attr-defined]
        full = np.flatnonzero(counts)
        if len(full) < 2:
            raise ValueError(
                f"{len(reader)} records in {len(full)} shard(s): a held-out share of whole shards needs two or "
                "more; name a validation set (--val PATH, TrainConfig.val)"
            )
        drawn = full[np.random.default_rng([seed, 99]).permutation(len(full))]
        took = min(int(np.searchsorted(np.cumsum(counts[drawn]), k)) + 1, len(full) - 1)  # a shard left to train
        held = drawn[:took]
        return StreamingSubset(reader, np.setdiff1d(np.arange(len(counts)), held)), StreamingSubset(reader, held)
    order = np.random.default_rng([seed, 99]).permutation(len(reader))
    return SubsetReader(reader, np.sort(order[k:])), SubsetReader(reader, np.sort(order[:k]))


def check_labels(reader: Reader, num_classes: int) -> None:
    """Refuse, in one line, a data set whose labels fall outside 0..num_classes-1 (read once, on the CPU,
    from the reader's label column where it has one), instead of checking each batch on the device."""
    try:
        labels = np.asarray(reader.labels, dtype=np.int64) if provides(reader, LabelledReader) else None  # type: ignore[attr-defined]
    except AttributeError:  # a subset or a cache over a reader without a label column
        labels = None
    if labels is None:
        return
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"record {i} ({reader.source(i)}) has label {int(labels[i])}, outside 0..{num_classes - 1} "
            f"({plural(num_classes, 'class', 'classes')}); {plural(len(bad), 'record')} in all: fix the labels or the "
            "class list and pack again"
        )


def fingerprint(reader: Reader) -> str:
    """What identifies the data set's contents, so a resume on other data of the same size is refused."""
    if provides(reader, FingerprintedReader):
        return str(reader.fingerprint)  # type: ignore[attr-defined]
    return f"{type(reader).__name__}:{len(reader)}"
