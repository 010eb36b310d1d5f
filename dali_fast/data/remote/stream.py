"""`ShardStream`: one process's use of the shard cache for one remote reader: the shards it maps, the
ones it pins, and the downloads ahead of the loader's order.

The reader tells it the shard of each record of the pass about to start (`schedule`), and how many
records were delivered since (`advance`): background threads download ahead in that order, up to this
process's share of the cache's budget, and a shard is unpinned once every record of it in the order was
delivered. A shard read out of order (random access, a DataLoader worker) is fetched when it is read.
The state is per process: a forked child or an unpickled reader starts a new stream.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .cache import ShardCache
from .errors import CacheDiskFullError
from .store import DownloadCancelled, ShardError

log = logging.getLogger(__name__)


class ShardStream:
    """Maps, pins and downloads ahead shards of ``cache`` (``keys``, ``urls`` and ``shard_bytes`` per shard)
    through ``fetch(s, pin, block_for_room=True, cancel=None)`` (`ShardCache.acquire` of the reader's
    download). ``bad`` (the reader's) holds the shards that failed; ``window`` shards are read at a time;
    ``threads`` download ahead."""

    def __init__(
        self,
        cache: ShardCache,
        keys: list[str],
        urls: list[str],
        shard_bytes: np.ndarray,
        fetch: Callable[..., int | None | bool],
        bad: dict[int, ShardError | CacheDiskFullError],
        *,
        window: int,
        threads: int,
    ) -> None:
        self.cache, self.keys, self.urls, self.shard_bytes = cache, keys, urls, shard_bytes
        self.fetch, self.bad, self.window, self.threads = fetch, bad, window, threads
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._maps: dict[int, np.ndarray] = {}
        self._pins: dict[int, int] = {}
        self._pinned_bytes = 0
        self._fetching: set[int] = set()
        self._fetching_bytes = 0
        self._plan: list[int] = []
        self._last_use: dict[int, float] = {}
        self._delivered = 0
        self._threads: list[threading.Thread] = []
        self._generation = 0
        self._closed = False

    @property
    def pinned(self) -> int:
        """Shards this process pins now."""
        return len(self._pins)

    def map(self, s: int) -> np.ndarray:
        """Shard ``s`` memory-mapped: waits for its download ahead when one is under way, else fetches it now."""
        m = self._maps.get(s)  # the common case, without the lock
        if m is not None:
            return m
        path = self.cache.path(self.keys[s])
        with self._cond:
            m = self._maps.get(s)
            if m is not None:
                return m
            while s in self._fetching:
                self._cond.wait(0.1)
            pinned = s in self._pins
        bad = self.bad.get(s)
        if bad is not None:
            raise bad
        if pinned:
            m = np.memmap(path, dtype=np.uint8, mode="r")
        else:
            # Not scheduled (random access, a DataLoader worker) or not reached by the downloads ahead:
            # fetch it now, pinned at least until it is mapped (a mapped file stays readable if evicted).
            size = int(self.shard_bytes[s])
            with self._cond:
                scheduled = self._last_use.get(s, -1) >= self._delivered
                if scheduled:  # counted as under way, and before any shard pinned for later
                    self._give_way(s)
                    self._fetching.add(s)
                    self._fetching_bytes += size
            try:
                fd = self.fetch(s, pin=True)
            finally:
                if scheduled:
                    with self._cond:
                        self._fetching.discard(s)
                        self._fetching_bytes -= size
                        self._cond.notify_all()
            assert isinstance(fd, int)
            keep = False
            try:
                m = np.memmap(path, dtype=np.uint8, mode="r")
                with self._cond:
                    if s not in self._pins and self._last_use.get(s, -1) >= self._delivered:
                        self._pins[s] = fd  # part of the schedule: released by `advance`, as the others
                        self._pinned_bytes += int(self.shard_bytes[s])
                        keep = True
            finally:
                if not keep:
                    self.cache.release(self.keys[s], fd, used=False)
        with self._cond:
            if s not in self._pins and len(self._maps) > 2 * self.window:
                # Unpinned maps: keep a few; an evicted file's space returns when its map goes.
                for old in [k for k in self._maps if k not in self._pins][: len(self._maps) // 2]:
                    del self._maps[old]
            self._maps[s] = m
        return m

    def schedule(self, shards: np.ndarray, following: np.ndarray | None = None) -> None:
        """The shard of each record the reader will read next, in order (and of the next epoch's first
        ones, ``following``): downloaded ahead in that order, each unpinned once its last record in the
        order was delivered (`advance`)."""
        seq, last = _first_needs(shards) if len(shards) else (np.empty(0, np.int64), {})
        if following is not None and len(following):
            nxt, _ = _first_needs(following)
            seen = set(seq.tolist())
            extra = [s for s in nxt.tolist() if s not in seen]
            seq = np.concatenate([seq, np.asarray(extra, dtype=np.int64)])
            last.update({s: np.inf for s in extra})
        with self._cond:
            self._plan = seq.tolist()
            self._last_use = last
            self._delivered = 0
            for s in [s for s in self._pins if s not in last]:
                self._unpin(s)
            self._closed = False
            self._start_threads()
            self._cond.notify_all()

    def advance(self, count: int) -> None:
        """``count`` more records of the schedule were delivered: unpin the shards whose use is over."""
        with self._cond:
            self._delivered += int(count)
            done = [s for s in self._pins if self._last_use.get(s, -1) < self._delivered]
            for s in done:
                self._unpin(s)
            if done:
                self._cond.notify_all()

    def _give_way(self, s: int) -> None:
        """Under ``_cond``: unpin shards pinned for later than ``s`` until ``s`` fits this process's share,
        so a shard needed now never waits on room held for shards needed after it."""
        position = {x: k for k, x in enumerate(self._plan)}
        later = sorted((x for x in self._pins if position.get(x, -1) > position.get(s, -1)), key=position.get)
        while later and self._pinned_bytes + self._fetching_bytes + self.shard_bytes[s] > self._share():
            x = later.pop()
            fd = self._pins.pop(x)
            self._pinned_bytes -= int(self.shard_bytes[x])
            self._maps.pop(x, None)
            self.cache.release(self.keys[x], fd, used=False)  # not used yet: evicted last

    def _unpin(self, s: int) -> None:
        fd = self._pins.pop(s)
        self._pinned_bytes -= int(self.shard_bytes[s])
        self._maps.pop(s, None)
        self.cache.release(self.keys[s], fd)

    def _share(self) -> float:
        """Bytes this process may pin ahead: its share of the budget; without a budget given (the disk's),
        no more than two windows of shards and one per download thread."""
        share = self.cache.limit / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if self.cache.limit_given:
            return share
        return min(share, (2 * self.window + self.threads) * float(self.shard_bytes.max()))

    def _next_to_fetch(self) -> int | None:
        """Under ``_cond``: the first shard of the plan not local, fetching or failed, if it fits the share."""
        for s in self._plan:
            if s in self._pins or s in self._fetching or s in self.bad or self._last_use[s] < self._delivered:
                continue  # local, under way, failed, or used up
            if self._pinned_bytes + self._fetching_bytes + self.shard_bytes[s] > self._share() and (
                self._pins or self._fetching
            ):
                return None
            return s
        return None

    def _start_threads(self) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < self.threads:
            t = threading.Thread(target=self._prefetch_loop, name="dali_fast-shards", daemon=True)
            t.start()
            self._threads.append(t)

    def _prefetch_loop(self) -> None:
        generation = self._generation
        while True:
            with self._cond:
                while True:
                    if self._closed or generation != self._generation:
                        return
                    s = self._next_to_fetch()
                    if s is not None:
                        break
                    self._cond.wait(0.5)
                self._fetching.add(s)
                self._fetching_bytes += int(self.shard_bytes[s])
            fd: Any = None
            try:
                # Ahead of need: only into room the budget has (never over it); tried again later if none.
                fd = self.fetch(
                    s, pin=True, block_for_room=False, cancel=lambda: self._closed or generation != self._generation
                )
            except (ShardError, DownloadCancelled):
                pass
            except CacheDiskFullError as e:  # raised to the read of this shard: the run stops there
                self.bad[s] = e
            except Exception as e:  # noqa: BLE001 - never leave a reader waiting on a dead thread
                self.bad[s] = ShardError(f"{self.urls[s]}: {type(e).__name__}: {e}")
                log.exception("downloading %s failed", self.urls[s])
            with self._cond:
                self._fetching.discard(s)
                self._fetching_bytes -= int(self.shard_bytes[s])
                if fd is False:  # no room now (other processes' pins): wait for a release
                    self._cond.wait(0.2)
                elif isinstance(fd, int):
                    if (
                        generation != self._generation
                        or self._last_use.get(s, -1) < self._delivered
                        or s in self._pins  # a read that could not wait pinned it meanwhile
                    ):
                        self.cache.release(self.keys[s], fd, used=False)  # not wanted twice
                    else:
                        self._pins[s] = fd
                        self._pinned_bytes += int(self.shard_bytes[s])
                self._cond.notify_all()

    def close(self) -> None:
        """Stop downloading ahead (a download under way stops at its next range request) and unpin every
        shard; the files stay in the cache."""
        with self._cond:
            self._closed = True
            self._generation += 1
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=30)
        with self._cond:
            for s in list(self._pins):
                self._unpin(s)
            self._maps.clear()


def _first_needs(shards: np.ndarray) -> tuple[np.ndarray, dict[int, float]]:
    """(shards in order of first need, the position of each shard's last need) of a per-record shard sequence."""
    uniq, first = np.unique(shards, return_index=True)
    seq = uniq[np.argsort(first, kind="stable")]
    _, last_rev = np.unique(shards[::-1], return_index=True)
    last = len(shards) - 1 - last_rev
    return seq.astype(np.int64), dict(zip(uniq.tolist(), last.astype(float).tolist(), strict=True))
