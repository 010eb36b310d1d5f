"""`Streamed`: what both remote readers (WebDataset shards, Parquet row groups) share: the arguments and node
cache they set up alike (`_setup`), the budget every rank of a node needs (`_check_budget`), and what they
do with their units through a `stream.ShardStream`: download them ahead in the order the loader will read
them (`schedule`, `advance`), stop (`close`), count (`stats`), and set the stream up afresh in each process."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...files import cache_folder
from .cache import ShardCache
from .store import ShardDownloader
from .stream import ShardStream


class Streamed:
    """The streaming half of a remote reader. The reader calls `_setup`, sets ``store``, ``_bad`` (units that
    failed) and ``shuffle_window``, checks `_check_budget`, maps records to units
    (``_units_of(records)``: the unit of each record, records given as int64), fetches one (``_fetch``: `ShardStream`'s), names its units in `stats` (``unit``), and calls `_start_stream` in its
    ``reset_process_state`` (`base.reset_after_fork`)."""

    unit = "shards"  # what `stats` calls a unit that failed: bad_<unit>
    cache: ShardCache
    store: ShardDownloader
    _bad: dict[int, Any]
    shuffle_window: int
    download_threads: int
    prefetch_next_epoch: bool
    _stream: ShardStream

    def _setup(
        self,
        cache_dir: str | os.PathLike | None,
        cache_limit: int | None,
        download_threads: int,
        retry_seconds: float,
        timeout: float,
        chunk_bytes: int,
        prefetch_next_epoch: bool,
    ) -> Path:
        """The arguments both remote readers take, checked in one line each; the node's shard cache
        (``cache_dir/shards``, default ``$DALI_FAST_CACHE/remote``). Returns the cache's root."""
        if not isinstance(download_threads, int) or isinstance(download_threads, bool) or download_threads < 1:
            raise ValueError(f"download_threads={download_threads!r}: must be a positive integer")
        if retry_seconds < 0 or timeout <= 0 or chunk_bytes < 1:
            raise ValueError("retry_seconds must be >= 0, timeout and chunk_bytes > 0")
        self.download_threads = download_threads
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        root = Path(cache_dir) if cache_dir is not None else cache_folder("remote")
        self.cache = ShardCache(root / "shards", cache_limit)
        return root

    def _check_budget(self, unit_bytes: np.ndarray, unit: str) -> None:
        """Refuse, before any download, a cache in which this node's ``LOCAL_WORLD_SIZE`` ranks cannot each
        pin two shuffle windows of the largest ``unit`` (of ``unit_bytes``), naming what to change."""
        limit = self.cache.limit
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        largest = int(unit_bytes.max()) if len(unit_bytes) else 0
        need = ranks * 2 * self.shuffle_window * largest
        if limit >= need:
            return
        windows = f"{ranks} rank(s) on this node each reading shuffle windows of {self.shuffle_window} {unit}(s)"
        if not self.cache.limit_given:
            raise ValueError(
                f"cache_dir {self.cache.folder}: its disk can spare {limit} bytes (its free space less a margin), "
                f"too little for {windows} of up to {largest} bytes ({need} bytes); free space there, choose a "
                "cache folder on a larger disk (--cache-dir, cache_dir), or use a smaller shuffle_window"
            )
        raise ValueError(
            f"cache_limit={limit}: too small for {windows} of up to {largest} bytes; use cache_limit >= {need} "
            "(two windows per rank) or a smaller shuffle_window"
        )

    def _start_stream(self, keys: list[str], urls: list[str], unit_bytes: np.ndarray) -> None:
        """This process's stream of units (the cache keys, URLs and sizes of each), fresh: a forked child's
        downloads, pins and connections are not its parent's."""
        self._stream = ShardStream(
            self.cache,
            keys,
            urls,
            unit_bytes,
            self._fetch,
            self._bad,
            window=self.shuffle_window,
            threads=self.download_threads,
        )
        if getattr(self, "_pid", None) not in (None, os.getpid()):
            self.store.forget_connections()  # fsspec's clients do not survive a fork
        self._pid = os.getpid()

    def schedule(self, order: np.ndarray, then: np.ndarray | None = None) -> None:
        """The records this process reads next, in order (the rest of the loader's pass), and the next
        epoch's: their units are downloaded ahead in that order, and unpinned once used (`advance`)."""
        if then is not None and len(then) and self.prefetch_next_epoch:
            self._stream.schedule(self._units_of(order), self._units_of(then))
        else:
            self._stream.schedule(self._units_of(order))

    def advance(self, count: int) -> None:
        """``count`` more records of the schedule were delivered: unpin the units whose use is over."""
        self._stream.advance(count)

    def close(self) -> None:
        """Stop downloading ahead (a download under way stops at its next range request) and unpin every
        unit; the files stay in the cache."""
        self._stream.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a reader whose __init__ raised has no stream to close
            self.close()

    def stats(self) -> dict[str, int]:
        """This process's downloads (units, bytes), evictions, units pinned now, and units that failed."""
        return {
            "downloads": self.cache.downloads,
            "downloaded_bytes": self.store.downloaded_bytes,
            "evictions": self.cache.evictions,
            "pinned": self._stream.pinned,
            f"bad_{self.unit}": len(self._bad),
        }
