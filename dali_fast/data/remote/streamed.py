"""`Streamed`: what both remote readers (WebDataset shards, Parquet row groups) do with their units through a
`stream.ShardStream`: download them ahead in the order the loader will read them (`schedule`, `advance`),
stop (`close`), count (`stats`), and set the stream up afresh in each process."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from .cache import ShardCache
from .store import ShardDownloader
from .stream import ShardStream


class Streamed:
    """The streaming half of a remote reader. The reader sets ``cache``, ``store``, ``_bad`` (units that
    failed), ``shuffle_window``, ``download_threads`` and ``prefetch_next_epoch``, maps records to units
    (``_units_of(records)``: the unit of each record, records given as int64), fetches one (``_fetch``: `ShardStream`'s), names its units in `stats` (``unit``), and calls `_start_stream` in its
    ``_reset_process_state``."""

    unit = "shards"  # what `stats` calls a unit that failed: bad_<unit>
    cache: ShardCache
    store: ShardDownloader
    _bad: dict[int, Any]
    shuffle_window: int
    download_threads: int
    prefetch_next_epoch: bool
    _stream: ShardStream

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
