"""A byte-budgeted LRU cache of encoded records, and a reader that goes through it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .base import CheckedBatch, Reader, read_batch_checked


class LRUCache:
    """Thread-safe least-recently-used cache bounded by total bytes.

    The cached bytes never exceed ``max_bytes``; an item larger than the whole budget is
    not cached (it passes through and counts as a miss).

    Args:
        max_bytes: the most bytes the cached values may hold together.

    >>> c = LRUCache(10)
    >>> c.put("a", b"12345", 5); c.put("b", b"12345", 5); c.get("a"); c.put("c", b"1", 1)
    >>> sorted(c.keys())   # "b" was least recently used
    ['a', 'c']
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: the cache budget must be >= 0 bytes")
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable) -> object | None:
        """The value for ``key`` (now most recently used), or None; counts a hit or a miss."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def get_many(self, keys: Sequence[Hashable]) -> list[object | None]:
        """``[get(key) for key in keys]`` under one lock: what a batch costs is one lock, not one per record."""
        out: list[object | None] = []
        hits = 0
        with self._lock:
            for key in keys:
                item = self._items.get(key)
                if item is None:
                    out.append(None)
                    continue
                self._items.move_to_end(key)
                out.append(item[0])
                hits += 1
            self.hits += hits
            self.misses += len(out) - hits
        return out

    def put(self, key: Hashable, value: object, nbytes: int) -> bool:
        """Store ``value`` costing ``nbytes``; evicts least recently used items to fit. False if too large."""
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._bytes + nbytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._bytes -= size
                self.evictions += 1
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            return True

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._items.keys())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    @property
    def bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def reset_stats(self) -> None:
        with self._lock:
            self.hits = self.misses = self.evictions = 0

    def stats(self) -> dict[str, float]:
        """hits, misses, hit_rate (0 when nothing was asked), evictions, bytes."""
        with self._lock:
            total = self.hits + self.misses
            return {
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": self.hits / total if total else 0.0,
                "evictions": self.evictions,
                "bytes": self._bytes,
            }


class _Checked(tuple):
    """A cached (bytes, label) that passed the read-time checks (`CachedReader.read_batch_checked`); a
    plain tuple, cached by ``reader[i]``, was not checked."""

    __slots__ = ()


class CachedReader:
    """The reader interface over ``reader`` with its records kept in ``cache``.

    Cached values are private copies, so a hit costs no disk or page-cache access.

    Args:
        reader: the reader whose records are cached.
        cache: the `LRUCache` that keeps them (one may serve several readers).
    """

    def __init__(self, reader: Reader, cache: LRUCache) -> None:
        self.reader = reader
        self.cache = cache
        self.classes = reader.classes

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def labels(self) -> np.ndarray:
        return self.reader.labels  # type: ignore[attr-defined]

    @property
    def target_kind(self) -> str:
        return getattr(self.reader, "target_kind", "class")

    @property
    def targets(self) -> Any:
        """The reader's targets (`base.TargetReader`): rows are made from indices, never cached."""
        return getattr(self.reader, "targets", None)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        i = int(i)
        hit = self.cache.get(i)
        if hit is not None:
            return hit  # type: ignore[return-value]
        data, label = self.reader[i]
        value = (np.array(data, dtype=np.uint8, copy=True), int(label))
        self.cache.put(i, value, value[0].nbytes)
        return value

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        items = [self[i] for i in indices]
        return [d for d, _ in items], np.array([lab for _, lab in items], dtype=np.int64)

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """A batch with the read-time checks (see `base.read_batch_checked`): a hit was checked when it
        was cached, so it costs a lookup; the misses are read and checked by the reader as one batch (in
        parallel for a folder), and the good ones cached. A bad record is never cached: it is read, and
        reported, again each time."""
        keys = [int(i) for i in indices]
        values = self.cache.get_many(keys)
        missing = [pos for pos, value in enumerate(values) if type(value) is not _Checked]  # or cached unchecked
        bad: dict[int, str] = {}
        if missing:
            datas, labels, why = read_batch_checked(self.reader, [keys[pos] for pos in missing])
            for k, pos in enumerate(missing):
                if k in why:
                    bad[pos] = why[k]
                    values[pos] = (datas[k], int(labels[k]))
                    continue
                value = _Checked((np.frombuffer(datas[k], dtype=np.uint8).copy(), int(labels[k])))  # a private copy
                self.cache.put(keys[pos], value, value[0].nbytes)
                values[pos] = value
        return [v[0] for v in values], np.array([v[1] for v in values], dtype=np.int64), bad  # type: ignore[index]

    def source(self, i: int) -> str:
        return self.reader.source(i)

    def __repr__(self) -> str:
        return f"CachedReader({self.reader!r}, max_bytes={self.cache.max_bytes})"
