"""`RemoteShardsReader`: WebDataset shards in object storage (``s3://``, ``gs://``, ``https://``, any fsspec
URL), read through a node-local shard cache. numpy only: no torch here.

``open_dataset("s3://bucket/train-{000000..000146}.tar")`` returns one. What it does:

- **Open.** One listing (or one HEAD per shard) gives each shard's size and what identifies its content
  (ETag, version or generation; `store.list_shards`). Each shard's member index (offsets, sizes,
  labels) is built once, from the whole shard fetched into the cache, by the same rules as local shards
  (`shards.index_shard`), and saved under ``index_dir`` keyed on (URL, size, identity): a shard changed on
  the server gets a new index, and the old one is never used for it. Indexing leaves the shard in the
  cache when the budget has room.
- **The shard cache** (`cache.ShardCache`, ``cache_dir``, ``cache_limit`` bytes) is shared by every
  process of the node: one download per shard per node, a size and crc32 check against the index
  (`store.ShardDownloader`), then a rename, so a crash never leaves a partial shard under a
  shard's name.
- **Streaming.** The loaders give the reader their upcoming order (`schedule`) and what they have
  delivered (`advance`); its `stream.ShardStream` downloads ahead in that order, up to this rank's
  share of the budget, and unpins a shard once every sample of it in the order was delivered.
- **Faults.** Range requests are retried with backoff; a shard that is gone, changed or truncated on the
  server, or that still fails, is a bad shard: reading its samples raises `ShardError` (an ``OSError``),
  which the loaders report as bad records (``on_error``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...files import atomic_write
from ..base import check_on_error, reset_after_fork
from ..checks import check_index
from ..member_index import MemberIndexReader
from ..shards import index_shard
from ..targets import attach_targets, check_target
from .cache import close_lock, open_lock
from .index_file import crc_file, load_index, pack_index
from .store import CHUNK_BYTES, PERMANENT, ShardDownloader, ShardError, list_shards
from .streamed import Streamed

log = logging.getLogger(__name__)



class RemoteShardsReader(Streamed, MemberIndexReader):
    """The reader interface over remote WebDataset shards, streamed through a `ShardCache`.

    ``cache_dir`` (default ``$DALI_FAST_CACHE/remote``) holds the shards (``shards/``) and, unless
    ``index_dir`` says otherwise, their indexes (``index/``). ``cache_limit``: bytes of shards on this
    node (None: what the disk can spare at open, its free space less a margin: `cache.DISK_MARGIN`); each
    of the node's ``LOCAL_WORLD_SIZE`` ranks may pin an equal share, which must hold two shuffle windows of
    ``shuffle_window`` shards. ``storage_options`` go to fsspec (e.g. ``{"endpoint_url": ...}`` for an
    S3-compatible server; ``AWS_ENDPOINT_URL`` works too). ``on_error`` as for local shards: ``"skip"``
    counts and names what indexing left out (``skipped`` samples, ``damaged`` shards), ``"raise"`` refuses
    it; a shard that fails later is reported through the loaders' own ``on_error``. What cannot be had for
    a reason of the store (credentials, access, endpoint, TLS, bucket, a full disk) raises a
    `errors.RemoteDataError` naming it.
    ``prefetch_next_epoch``: once this epoch's shards are local or under way, download the next epoch's
    first shards too, as the budget allows (no stall when an epoch starts). ``target`` and ``num_classes``
    as for local shards (`webdataset.WebDatasetReader`): target lists from each sample's ``.json``;
    ``classes`` the class names in label order (`classes.class_map`).
    """

    streaming = True  # the loaders use the streaming order (`loaders.order.StreamingOrder`) over it

    def __init__(
        self,
        spec: str,
        *,
        label_key: str = "label",
        on_error: str = "skip",
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | None = None,
        index_dir: str | os.PathLike | None = None,
        storage_options: dict[str, Any] | None = None,
        shuffle_window: int = 4,
        download_threads: int = 4,
        retry_seconds: float = 60.0,
        timeout: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
        prefetch_next_epoch: bool = True,
        target: str | None = None,
        num_classes: int | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        check_target(target, num_classes)
        self.lists = target not in (None, "class")
        if not isinstance(shuffle_window, int) or shuffle_window < 1:
            raise ValueError(f"shuffle_window={shuffle_window!r}: must be a positive integer")
        root = self._setup(cache_dir, cache_limit, download_threads, retry_seconds, timeout, chunk_bytes, prefetch_next_epoch)
        self.spec = str(spec)
        self.label_key = label_key
        self.on_error = check_on_error(on_error)
        self.shuffle_window = shuffle_window
        self.index_dir = Path(index_dir) if index_dir is not None else root / "index"
        fs, self.infos = list_shards(self.spec, dict(storage_options or {}))
        self.store = ShardDownloader(
            self.infos,
            dict(storage_options or {}),
            retry_seconds=float(retry_seconds),
            timeout=float(timeout),
            chunk_bytes=int(chunk_bytes),
            fs=fs,
        )
        self.shards = [s.url for s in self.infos]
        self.shard_bytes = np.array([s.size for s in self.infos], dtype=np.int64)
        self.path = self.spec
        self._check_budget(self.shard_bytes, "shard")  # before any download
        self._bad: dict[int, ShardError] = {}  # shards that failed, with the error: reading them raises it
        self.reset_process_state()
        self._build(classes)
        attach_targets(self, target, num_classes)
        reset_after_fork(self)

    # ------------------------------------------------------------------ open: the index
    def _build(self, classes: Sequence[str] | None) -> None:
        n = len(self.infos)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        first = n * local_rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        order = list(range(first, n)) + list(range(first))  # ranks of a node index different shards first
        parts: list[dict[str, Any] | None] = [None] * n
        with ThreadPoolExecutor(self.download_threads) as pool:
            for s, part in zip(order, pool.map(self._shard_index, order), strict=True):
                parts[s] = part
        counts = [len(p["labels"]) for p in parts]  # type: ignore[index]
        self.shard_bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._shard_of = np.repeat(np.arange(n, dtype=np.int64), counts)
        self._offset = np.concatenate([p["offset"] for p in parts]).astype(np.int64)  # type: ignore[index]
        self._size = np.concatenate([p["size"] for p in parts]).astype(np.int64)  # type: ignore[index]
        self._labels = np.concatenate([p["labels"] for p in parts]).astype(np.int64)  # type: ignore[index]
        blobs = [p["names"] for p in parts]  # type: ignore[index]
        starts = np.cumsum([0] + [len(b) for b in blobs[:-1]])
        self._names = np.concatenate(blobs).astype(np.uint8)
        self._name_ends = np.concatenate([p["name_ends"] + o for p, o in zip(parts, starts, strict=True)])  # type: ignore[index]
        at = np.cumsum([0] + [len(p["target_values"]) for p in parts[:-1]])  # type: ignore[index]
        self._target_values = np.concatenate([p["target_values"] for p in parts]).astype(np.float64)  # type: ignore[index]
        self._target_ends = np.concatenate([p["target_ends"] + o for p, o in zip(parts, at, strict=True)]).astype(
            np.int64
        )  # type: ignore[index]
        self.shard_crc = np.array([int(p["crc"]) for p in parts], dtype=np.int64)  # type: ignore[index]
        self.skipped: list[tuple[str, str]] = [tuple(x) for p in parts for x in p["skipped"]]  # type: ignore[index,misc]
        self.damaged: list[tuple[str, str]] = [tuple(x) for p in parts for x in p["damaged"]]  # type: ignore[index,misc]
        self.ignored: Counter[str] = sum((Counter(p["ignored"]) for p in parts), Counter())  # type: ignore[index]
        if (self.damaged or self.skipped) and self.on_error == "raise":
            where, reason = (self.damaged or self.skipped)[0]
            raise ValueError(f"{where}: {reason}; fix the shard, or open it with on_error='skip'")
        self._index_done("remote shard", classes)

    @property
    def _salt(self) -> str:
        """What else an index depends on than the shard: the label key, and whether it holds target lists."""
        return f"{self.label_key}|lists" if self.lists else self.label_key

    def _index_path(self, s: int) -> Path:
        return self.index_dir / f"{self.infos[s].key(self._salt)}.npz"

    def _shard_index(self, s: int) -> dict[str, Any]:
        """Shard ``s``'s member index, from ``index_dir`` or built from the shard (fetched into the cache)."""
        path = self._index_path(s)
        part = load_index(path)
        if part is not None:
            return part
        try:
            return self._build_shard_index(s, path)
        except ShardError as e:
            if isinstance(e.__cause__, PERMANENT):  # credentials, access, TLS: the store's, not the shard's
                raise e.__cause__  # noqa: B904 - it carries its own cause
            if self.on_error == "raise":
                raise ShardError(f"{e}; the shard cannot be indexed (or open with on_error='skip')") from e
            log.warning("left out shard %s: %s", self.infos[s].url, e)
            empty = np.empty(0, np.int64)
            return {
                "offset": empty,
                "size": empty,
                "labels": empty,
                "names": np.empty(0, np.uint8),
                "name_ends": empty,
                "target_values": np.empty(0, np.float64),
                "target_ends": empty,
                "skipped": [],
                "ignored": {},
                "damaged": [(self.infos[s].url, f"cannot be indexed: {e}")],
                "crc": 0,
            }  # not saved: the next open tries again

    def _build_shard_index(self, s: int, path: Path) -> dict[str, Any]:
        self.index_dir.mkdir(parents=True, exist_ok=True)
        fd = open_lock(path.with_suffix(".lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process of the node builds it; the others wait and load it
            part = load_index(path)
            if part is None:
                part = self._make_index(s)
                try:
                    atomic_write(path, lambda f: np.savez(f, **pack_index(part)))
                except OSError as e:
                    log.warning("cannot save the shard index %s (%s); the next open indexes it again", path, e)
            return part
        finally:
            close_lock(fd)

    def _make_index(self, s: int) -> dict[str, Any]:
        info = self.infos[s]
        crc: list[int] = []
        pin = self.cache.acquire(
            info.key(), info.size, lambda tmp: crc.append(self.store.download(s, tmp, None)), pin=True
        )
        assert isinstance(pin, int)
        try:
            return self._index_local(s, crc)
        finally:
            self.cache.release(info.key(), pin, used=False)  # left in the cache for the first epoch

    def _index_local(self, s: int, crc: list[int]) -> dict[str, Any]:
        """Shard ``s``'s index from its file in the cache, by the local shards' rules (`shards.index_shard`)."""
        info = self.infos[s]
        local = self.cache.path(info.key())
        if not crc:  # already in the cache (from another process or an earlier index): the crc from the file
            crc.append(crc_file(local))
        found = index_shard(local, label_key=self.label_key, on_error="skip", lists=self.lists)
        names = [n.encode("utf-8", "surrogateescape") for n in found.names]
        return {
            "offset": found.offsets.astype(np.int64),
            "size": found.sizes.astype(np.int64),
            "labels": found.labels.astype(np.int64),
            "names": np.frombuffer(b"".join(names), dtype=np.uint8).copy(),
            "name_ends": np.cumsum([len(x) for x in names], dtype=np.int64),
            "target_values": found.target_values,
            "target_ends": found.target_ends,
            "skipped": [(w.replace(str(local), info.url, 1), r) for w, r in found.skipped],
            "ignored": dict(found.ignored),
            "damaged": [(info.url, r) for _, r in found.damaged],
            "crc": crc[0],
        }

    def _fetch(
        self, s: int, pin: bool, block_for_room: bool = True, cancel: Callable[[], bool] | None = None
    ) -> int | None | bool:
        """Shard ``s`` made local (see `ShardCache.acquire`); a failure is remembered as a bad shard (the
        stream asks for no shard that failed)."""
        info = self.infos[s]
        try:
            return self.cache.acquire(
                info.key(),
                info.size,
                lambda tmp: self.store.download(s, tmp, int(self.shard_crc[s]), cancel),
                pin=pin,
                block_for_room=block_for_room,
            )
        except ShardError as e:
            self._bad[s] = e
            log.warning("bad shard: %s", e)
            raise

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha1("|".join(s.key(self._salt) for s in self.infos).encode()).hexdigest()[:16]
        return f"remote-webdataset:{len(self)}:{h}"

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = check_index(i, len(self))
        s = int(self._shard_of[j])
        m = self._stream.map(s)
        off = int(self._offset[j])
        return m[off : off + int(self._size[j])], int(self._labels[j])

    def _units_of(self, records: np.ndarray) -> np.ndarray:
        return self._shard_of[records]

    # ------------------------------------------------------------------ processes
    def reset_process_state(self) -> None:
        """Per-process state, fresh: in a new reader, after unpickling, and in a forked child (whose
        pins were its parent's and whose threads did not survive the fork)."""
        self._start_stream([info.key() for info in self.infos], self.shards, self.shard_bytes)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k in _PICKLED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pid = None
        self.reset_process_state()
        reset_after_fork(self)

    def __repr__(self) -> str:
        return f"RemoteShardsReader({len(self.shards)} shards, records={len(self)}, classes={len(self.classes)})"


_PICKLED = (
    "_shard_of",
    "_offset",
    "_size",
    "_labels",
    "_names",
    "_name_ends",
    "_target_values",
    "_target_ends",
    "_bad",
)
