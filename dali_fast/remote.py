"""WebDataset shards in object storage (``s3://``, ``gs://``, ``https://``, any fsspec URL), read
through a node-local shard cache. numpy only: no torch here.

``open_dataset("s3://bucket/train-{000000..000146}.tar")`` returns a `RemoteShardsReader`. What it does:

- **Open.** One listing (or one HEAD per shard) gives each shard's size and what identifies its content
  (ETag, version or generation). Each shard's member index (offsets, sizes, labels) is built once, from
  the whole shard fetched into the cache, by the same rules as local shards, and saved under
  ``index_dir`` keyed on (URL, size, identity): a shard changed on the server gets a new index, and the
  old one is never used for it. Indexing leaves the shard in the cache when the budget has room.
- **The shard cache** (``cache_dir``, ``cache_limit`` bytes) is shared by every process of the node:
  one download per shard per node (a file lock per shard), downloads to a temporary name of the full
  size (so the budget counts it), a size and crc32 check against the index, then a rename, so a
  crash never leaves a partial shard under a shard's name. Shards a rank still needs are pinned with
  a shared lock (released by the kernel if the process dies); when room is needed, unpinned shards go,
  the most recently used up first (a used shard is not needed again this epoch).
- **Streaming.** The loaders give the reader their upcoming order (`schedule`) and what they have
  delivered (`advance`); background threads download ahead in that order, up to this rank's share of
  the budget, and a shard is unpinned once every sample of it in the order was delivered.
- **Faults.** Each range request is retried with exponential backoff for up to ``retry_seconds`` without
  progress, and one that hangs is abandoned after ``timeout`` seconds; a shard that is gone, changed
  or truncated on the server, or that still fails, is a bad shard: reading its samples raises
  `ShardError` (an ``OSError``), which the loaders report as bad records (``on_error``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .synthetic import default_cache_dir
from .system import atomic_write, pid_alive
from .webdataset import WebDatasetReader, _expand_braces

log = logging.getLogger(__name__)

INDEX_VERSION = 1
CHUNK_BYTES = 8 << 20  # one range request
POLL_SECONDS = 0.02  # waiting on another process's download or for room
_IDENTITY_FIELDS = ("ETag", "etag", "md5Hash", "Content-MD5", "generation", "VersionId", "crc32c")
_TIME_FIELDS = ("LastModified", "mtime", "updated", "last_modified", "Last-Modified")
CLOUD_INSTALL = "pip install 'dali_fast[cloud]'"


class ShardError(OSError):
    """A shard that cannot be had: gone, changed or truncated on the server, or still failing after retries."""


class ShardChanged(ShardError):
    """A shard whose bytes on the server are no longer the ones its index describes."""


class _Cancelled(Exception):
    """A download ahead that is no longer wanted (the reader was closed)."""


def is_remote(path: object) -> bool:
    """True for a URL with a scheme other than ``file://`` (``s3://``, ``gs://``, ``https://``, ...)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", path) if isinstance(path, str) else None
    return m is not None and m.group(1).lower() not in ("file", "local")


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path) for ``url``; endpoints and credentials come from ``storage_options`` and
    the backend's usual sources (environment, profiles, instance roles), never from this project."""
    try:
        import fsspec.core
    except ImportError as e:
        raise ImportError(f"{url}: remote data needs fsspec and a backend: {CLOUD_INSTALL} (gs:// also gcsfs)") from e
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        raise ImportError(f"{url}: {e}; {CLOUD_INSTALL} (gs:// also needs `pip install gcsfs`)") from e


@dataclass(frozen=True)
class ShardInfo:
    """A remote shard as listed: its URL, the filesystem path, its size and content identity."""

    url: str
    path: str
    size: int
    identity: str

    def key(self, salt: str = "") -> str:
        """A file-name-safe key naming this content of this URL."""
        h = hashlib.sha1(f"v{INDEX_VERSION}|{self.url}|{self.size}|{self.identity}|{salt}".encode()).hexdigest()[:24]
        base = re.sub(r"[^A-Za-z0-9._-]", "_", self.url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".tar"))[-60:]
        return f"{h}-{base}"


def identity(info: dict[str, Any]) -> str:
    """What identifies an object's content in an fsspec ``info()`` or listing entry (ETag first, else a
    version or a modification time; '' when the backend gives none: the crc32 check still applies)."""
    for k in _IDENTITY_FIELDS + _TIME_FIELDS:
        v = info.get(k)
        if v not in (None, ""):
            return f"{k}={str(v).strip(chr(34))}"
    return ""


def list_shards(spec: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, list[ShardInfo]]:
    """The shards ``spec`` names (a brace pattern, one ``.tar`` URL, or a prefix holding ``.tar`` files),
    with sizes and identities fetched fresh from the server."""
    urls = _expand_braces(spec)
    fs, _ = url_to_fs(urls[0], storage_options)
    fs.invalidate_cache()
    if len(urls) == 1 and not urls[0].endswith(".tar"):
        root = fs._strip_protocol(urls[0])  # noqa: SLF001 - fsspec's own URL-to-path rule
        try:
            found = sorted(p for p in fs.find(root) if p.endswith(".tar"))
        except FileNotFoundError:
            found = []
        if not found:
            raise FileNotFoundError(
                f"{spec}: no .tar shards there; name them, e.g. {spec.rstrip('/')}/train-{{000000..000099}}.tar"
            )
        urls = [fs.unstrip_protocol(p) for p in found]
    paths = [fs._strip_protocol(u) for u in urls]  # noqa: SLF001
    entries: dict[str, dict[str, Any]] = {}
    if set(np.atleast_1d(fs.protocol)) & {"s3", "s3a", "gs", "gcs", "abfs", "az"}:
        # One listing per folder instead of one request per shard.
        for parent in sorted({p.rsplit("/", 1)[0] for p in paths}):
            with contextlib.suppress(FileNotFoundError):
                for e in fs.ls(parent, detail=True, refresh=True):
                    entries[e["name"].rstrip("/")] = e

    def info(p: str) -> dict[str, Any] | None:
        if p in entries:
            return entries[p]
        try:
            return fs.info(p)
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(16) as pool:
        infos = list(pool.map(info, paths))
    missing = [u for u, i in zip(urls, infos, strict=True) if i is None or i.get("type") == "directory"]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{missing[0]}{more}: no such shard on the server; check the URL and pattern")
    shards = [ShardInfo(u, p, int(i["size"]), identity(i)) for u, p, i in zip(urls, paths, infos, strict=True)]
    return fs, shards


# ----------------------------------------------------------------------------------------------- locks

_LOCK_FDS: set[int] = set()  # lock files this process holds open; a forked child closes its copies
# Held while a lock file is opened and recorded, or forgotten and closed, and across a fork: a fork can
# then never fall between the two, which would leave the child an fd it does not know it holds.
_LOCK_FDS_GUARD = threading.Lock()


def _open_lock(path: Path) -> int:
    with _LOCK_FDS_GUARD:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _LOCK_FDS.add(fd)
    return fd


def _close_lock(fd: int) -> None:
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


_READERS: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep its parent's locks: flock locks belong to the
    open file, which fork shares, so a lock the child kept open would outlive the parent's release."""
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _LOCK_FDS_GUARD.release()  # taken by the forking thread before the fork
    for reader in list(_READERS):
        reader._reset_process_state()  # noqa: SLF001


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_LOCK_FDS_GUARD.acquire,
        after_in_parent=_LOCK_FDS_GUARD.release,
        after_in_child=_after_fork_in_child,
    )


# ----------------------------------------------------------------------------------------------- cache


class ShardCache:
    """The node-local shard files under ``folder``, within ``limit`` bytes (None: no limit).

    Files: ``KEY.tar`` (complete shards), ``KEY.part-PID-TID`` (downloads in progress, created at their
    full size so the budget counts them), ``KEY.lock`` (a shard's lock: exclusive while downloading or
    evicting, shared while a process pins it) and ``.cache.lock`` (held while the budget is checked).
    """

    def __init__(self, folder: str | os.PathLike, limit: int | None = None, *, overflow_after: float = 30.0) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"cache_limit={limit}: must be >= 0 bytes, or None for no limit")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cache_dir {self.folder}: cannot be created ({e.strerror}); choose another path") from e
        self.limit = limit
        with self.locked():
            self._clean_stale()
        self.overflow_after = overflow_after  # a read that needs a shard now waits this long for room at most
        self.downloads = 0  # shards this process downloaded
        self.evictions = 0
        self._warned_overflow = False

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.tar"

    @contextlib.contextmanager
    def locked(self):
        """The cache-wide lock: budget checks, evictions and renames happen under it."""
        fd = _open_lock(self.folder / ".cache.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close_lock(fd)

    def used(self) -> int:
        """Bytes of complete shards and of downloads in progress (counted at their full size)."""
        total = 0
        for e in os.scandir(self.folder):
            if e.name.endswith(".tar") or ".part-" in e.name:
                with contextlib.suppress(FileNotFoundError):
                    total += e.stat().st_size
        return total

    def _clean_stale(self) -> None:
        """Remove downloads left by processes that died mid-way (their PID is in the name)."""
        for e in os.scandir(self.folder):
            if ".part-" in e.name:
                pid = e.name.rsplit(".part-", 1)[1].split("-")[0]
                if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                        log.info("removed %s, a download its process left unfinished", e.name)

    def _make_room(self, need: int) -> bool:
        """Under the cache lock: evict unpinned shards until ``need`` more bytes fit. Shards whose use
        ended most recently go first; shards never used yet (mtime 0) last."""
        if self.limit is None:
            return True
        used = self.used()
        if used + need <= self.limit:
            return True
        candidates = []
        for e in os.scandir(self.folder):
            if e.name.endswith(".tar"):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    candidates.append((-st.st_mtime_ns, e.name, st.st_size))
        for _, name, size in sorted(candidates):
            fd = _open_lock(self.folder / (name[: -len(".tar")] + ".lock"))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _close_lock(fd)
                continue  # pinned by a process that still needs it
            try:
                os.unlink(self.folder / name)
                used -= size
                self.evictions += 1
                log.debug("evicted %s (%d bytes)", name, size)
            except FileNotFoundError:
                pass
            finally:
                _close_lock(fd)
            if used + need <= self.limit:
                return True
        return False

    def _reserve(self, key: str, size: int, block: bool) -> Path | None:
        """A temporary file of ``size`` bytes for ``key``'s download, once the budget has room; None if
        ``block`` is False and there is no room now."""
        waited_since = time.monotonic()
        tmp = self.folder / f"{key}.part-{os.getpid()}-{threading.get_ident()}"
        while True:
            with self.locked():
                self._clean_stale()
                over = block and time.monotonic() - waited_since > self.overflow_after
                if self._make_room(size) or over:
                    if over and not self._warned_overflow:
                        self._warned_overflow = True
                        log.warning(
                            "shard cache %s: no room for a shard needed now after %.0fs (every cached shard is "
                            "pinned); going over cache_limit=%d by up to one shard; raise cache_limit",
                            self.folder,
                            self.overflow_after,
                            self.limit,
                        )
                    with open(tmp, "wb") as f:
                        f.truncate(size)
                    return tmp
            if not block:
                return None
            time.sleep(POLL_SECONDS * 5)

    def acquire(
        self, key: str, size: int, download: Callable[[Path], None], *, pin: bool, block_for_room: bool = True
    ) -> int | None | bool:
        """Make shard ``key`` a complete local file, downloading it with ``download(tmp_path)`` when it is not
        there and no other process is fetching it (one download per shard per node).

        Returns an open lock descriptor holding a shared lock (the pin; `release` it) when ``pin``, else
        None; False when ``block_for_room`` is False and the budget has no room now.
        """
        final, lock_path = self.path(key), self.folder / f"{key}.lock"
        while True:
            fd = _open_lock(lock_path)
            keep = False
            try:
                if final.exists():
                    fcntl.flock(fd, fcntl.LOCK_SH)  # waits out an eviction or a rename in progress
                    if final.exists():
                        keep = pin
                        return fd if pin else None
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another process or thread is downloading it
                    time.sleep(POLL_SECONDS)
                    continue
                if not final.exists():
                    tmp = self._reserve(key, size, block_for_room)
                    if tmp is None:
                        return False
                    try:
                        download(tmp)
                    except BaseException:
                        tmp.unlink(missing_ok=True)
                        raise
                    os.utime(tmp, ns=(0, 0))  # never used yet: evicted last
                    with self.locked():
                        os.replace(tmp, final)
                        self.downloads += 1
                        if pin:
                            fcntl.flock(fd, fcntl.LOCK_SH)  # under the cache lock: no eviction between
                elif pin:
                    with self.locked():
                        fcntl.flock(fd, fcntl.LOCK_SH)
                keep = pin
                return fd if pin else None
            finally:
                if not keep:
                    _close_lock(fd)

    def release(self, key: str, fd: int, used: bool = True) -> None:
        """Unpin a shard; ``used``: its use is over (it becomes the first to evict)."""
        if used:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path(key))
        _close_lock(fd)


# ----------------------------------------------------------------------------------------------- reader


class RemoteShardsReader:
    """The reader interface over remote WebDataset shards, streamed through a `ShardCache`.

    ``cache_dir`` (default ``$DALI_FAST_CACHE/remote``) holds the shards (``shards/``) and, unless
    ``index_dir`` says otherwise, their indexes (``index/``). ``cache_limit``: bytes of shards on this
    node (None: no limit); each of the node's ``LOCAL_WORLD_SIZE`` ranks may pin an equal share, which
    must hold two shuffle windows of ``shuffle_window`` shards. ``storage_options`` go to fsspec (e.g.
    ``{"endpoint_url": ...}`` for an S3-compatible server; ``AWS_ENDPOINT_URL`` works too).
    ``on_error`` as for local shards: ``"skip"`` counts and names what indexing left out, ``"raise"``
    refuses it; a shard that fails later is reported through the loaders' own ``on_error``.
    ``prefetch_next_epoch``: once this epoch's shards are local or under way, download the next epoch's
    first shards too, as the budget allows (no stall when an epoch starts).
    """

    streaming = True  # the loaders use the streaming order (`shard_order.StreamingOrder`) over it

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
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        for name, value in (("shuffle_window", shuffle_window), ("download_threads", download_threads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if retry_seconds < 0 or timeout <= 0 or chunk_bytes < 1:
            raise ValueError("retry_seconds must be >= 0, timeout and chunk_bytes > 0")
        self.spec = str(spec)
        self.label_key = label_key
        self.on_error = on_error
        self.storage_options = dict(storage_options or {})
        self.shuffle_window = shuffle_window
        self.download_threads = download_threads
        self.retry_seconds = float(retry_seconds)
        self.timeout = float(timeout)
        self.chunk_bytes = int(chunk_bytes)
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "remote"
        self.cache = ShardCache(root / "shards", cache_limit)
        self.index_dir = Path(index_dir) if index_dir is not None else root / "index"
        self._fs, self.infos = list_shards(self.spec, self.storage_options)
        self.shards = [s.url for s in self.infos]
        self.shard_bytes = np.array([s.size for s in self.infos], dtype=np.int64)
        self.path = self.spec
        self._check_budget()  # before any download
        self._reset_process_state()
        self._build()
        _READERS.add(self)

    # ------------------------------------------------------------------ open: the index
    def _build(self) -> None:
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
        self.shard_crc = np.array([int(p["crc"]) for p in parts], dtype=np.int64)  # type: ignore[index]
        self.skipped: list[tuple[str, str]] = [tuple(x) for p in parts for x in p["skipped"]]  # type: ignore[index,misc]
        self.ignored: Counter[str] = sum((Counter(p["ignored"]) for p in parts), Counter())  # type: ignore[index]
        if self.skipped:
            if self.on_error == "raise":
                where, reason = self.skipped[0]
                raise ValueError(f"{where}: {reason}; fix the shard, or open it with on_error='skip'")
            log.warning(
                "%d samples left out of %d remote shards (first: %s: %s)", len(self.skipped), n, *self.skipped[0]
            )
        if not len(self._labels):
            raise ValueError(f"{self.shards[0]}: no samples with an image and a label in {n} shard(s)")
        self.classes = [str(i) for i in range(int(self._labels.max()) + 1)]

    def _check_budget(self) -> None:
        limit = self.cache.limit
        if limit is None:
            return
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        need = ranks * 2 * self.shuffle_window * int(self.shard_bytes.max())
        if limit < need:
            raise ValueError(
                f"cache_limit={limit}: too small for {ranks} rank(s) on this node each reading shuffle windows of "
                f"{self.shuffle_window} shard(s) of up to {int(self.shard_bytes.max())} bytes; use cache_limit >= "
                f"{need} (two windows per rank) or a smaller shuffle_window"
            )

    def _index_path(self, s: int) -> Path:
        return self.index_dir / f"{self.infos[s].key(self.label_key)}.npz"

    def _shard_index(self, s: int) -> dict[str, Any]:
        """Shard ``s``'s member index, from ``index_dir`` or built from the shard (fetched into the cache)."""
        path = self._index_path(s)
        part = _load_index(path)
        if part is not None:
            return part
        try:
            return self._build_shard_index(s, path)
        except ShardError as e:
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
                "skipped": [(self.infos[s].url, f"cannot be indexed: {e}")],
                "ignored": {},
                "crc": 0,
            }  # not saved: the next open tries again

    def _build_shard_index(self, s: int, path: Path) -> dict[str, Any]:
        self.index_dir.mkdir(parents=True, exist_ok=True)
        fd = _open_lock(path.with_suffix(".lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process of the node builds it; the others wait and load it
            part = _load_index(path)
            if part is None:
                part = self._make_index(s)
                try:
                    atomic_write(path, lambda f: np.savez(f, **_pack_index(part)))
                except OSError as e:
                    log.warning("cannot save the shard index %s (%s); the next open indexes it again", path, e)
            return part
        finally:
            _close_lock(fd)

    def _make_index(self, s: int) -> dict[str, Any]:
        info = self.infos[s]
        crc: list[int] = []
        pin = self.cache.acquire(info.key(), info.size, lambda tmp: crc.append(self._download(s, tmp, None)), pin=True)
        assert isinstance(pin, int)
        try:
            return self._index_local(s, crc)
        finally:
            self.cache.release(info.key(), pin, used=False)  # left in the cache for the first epoch

    def _index_local(self, s: int, crc: list[int]) -> dict[str, Any]:
        info = self.infos[s]
        local = self.cache.path(info.key())
        if not crc:  # already in the cache (from another process or an earlier index): the crc from the file
            crc.append(_crc_file(local))
        found = WebDatasetReader.__new__(WebDatasetReader)  # the local shards' indexing rules, on the cached file
        found.shards, found.label_key, found.on_error, found.skipped, found.ignored = (
            [local],
            self.label_key,
            "skip",
            [],
            Counter(),
        )
        found._build_index()  # noqa: SLF001
        names = [
            bytes(found._names[(found._name_ends[j - 1] if j else 0) : found._name_ends[j] - 1])  # noqa: SLF001
            for j in range(len(found._labels))  # noqa: SLF001
        ]
        skipped = [(w.replace(str(local), info.url, 1), r) for w, r in found.skipped]
        return {
            "offset": found._offset.astype(np.int64),  # noqa: SLF001
            "size": found._size.astype(np.int64),  # noqa: SLF001
            "labels": found._labels.astype(np.int64),  # noqa: SLF001
            "names": np.frombuffer(b"".join(names), dtype=np.uint8).copy(),
            "name_ends": np.cumsum([len(x) for x in names], dtype=np.int64),
            "skipped": skipped,
            "ignored": dict(found.ignored),
            "crc": crc[0],
        }

    # ------------------------------------------------------------------ downloads
    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = url_to_fs(self.shards[0], self.storage_options)[0]
        return self._fs

    def _get_range(self, path: str, start: int, end: int) -> bytes:
        fs = self.fs
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            from fsspec.asyn import sync

            return sync(fs.loop, fs._cat_file, path, start=start, end=end, timeout=self.timeout)  # noqa: SLF001
        return fs.cat_file(path, start=start, end=end)

    def _changed(self, s: int) -> str | None:
        """Why shard ``s`` on the server is no longer the indexed one, or None (same, or unknown now)."""
        info = self.infos[s]
        try:
            self.fs.invalidate_cache(info.path)
            now = self.fs.info(info.path)
        except FileNotFoundError:
            return "no longer on the server (deleted?)"
        except Exception:  # noqa: BLE001 - the server is unreachable: nothing known, the caller retries
            return None
        size, ident = int(now.get("size", -1)), identity(now)
        if size != info.size:
            what = "truncated" if 0 <= size < info.size else "changed"
            return f"{what} on the server: {size} bytes now, {info.size} when indexed"
        if ident != info.identity:
            return f"changed on the server since it was indexed ({info.identity or 'no identity'} then, {ident} now)"
        return None

    def _download(self, s: int, tmp: Path, expect_crc: int | None, cancel: Callable[[], bool] | None = None) -> int:
        """Fetch shard ``s`` into ``tmp`` by range requests; retry what fails with backoff; check the size
        and (when known) the crc32 of the index. Returns the crc32."""
        info = self.infos[s]
        crc, offset, backoff, since = 0, 0, 0.1, time.monotonic()
        with open(tmp, "r+b") as f:
            while offset < info.size:
                if cancel is not None and cancel():
                    raise _Cancelled
                end = min(offset + self.chunk_bytes, info.size)
                try:
                    data = self._get_range(info.path, offset, end)
                    if len(data) != end - offset:
                        raise OSError(f"got {len(data)} bytes of {end - offset} asked for at offset {offset}")
                except FileNotFoundError as e:
                    raise ShardError(f"{info.url}: no longer on the server (deleted?)") from e
                except PermissionError as e:
                    raise ShardError(f"{info.url}: access denied ({e}); check the credentials") from e
                except Exception as e:  # noqa: BLE001 - network and server errors of every backend: retried
                    # Is it the object that changed? Asked once per stretch of failures (an unreachable
                    # server would only make each retry slower).
                    why = self._changed(s) if backoff == 0.1 else None
                    if why is not None:
                        raise ShardChanged(f"{info.url}: {why}; open the data set again to re-index it") from e
                    waited = time.monotonic() - since
                    if waited >= self.retry_seconds:
                        raise ShardError(
                            f"{info.url}: download failed after retrying for {waited:.0f}s: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        ) from e
                    log.info("retrying %s at byte %d in %.1fs: %s: %s", info.url, offset, backoff, type(e).__name__, e)
                    time.sleep(min(backoff, max(0.0, self.retry_seconds - waited)))
                    backoff = min(backoff * 2, 10.0)
                    continue
                f.seek(offset)
                f.write(data)
                crc = zlib.crc32(data, crc)
                offset = end
                backoff, since = 0.1, time.monotonic()
            f.flush()
            os.fsync(f.fileno())  # a renamed shard is whole, even after a power cut
        if expect_crc is not None and crc != expect_crc:
            why = self._changed(s) or "its bytes differ from the indexed ones (crc32)"
            raise ShardChanged(f"{info.url}: {why}; open the data set again to re-index it")
        self.downloaded_bytes += info.size
        return crc

    def _fetch(
        self, s: int, pin: bool, block_for_room: bool = True, cancel: Callable[[], bool] | None = None
    ) -> int | None | bool:
        """Shard ``s`` made local (see `ShardCache.acquire`); a failure is remembered as a bad shard."""
        bad = self._bad.get(s)
        if bad is not None:
            raise bad
        info = self.infos[s]
        try:
            return self.cache.acquire(
                info.key(),
                info.size,
                lambda tmp: self._download(s, tmp, int(self.shard_crc[s]), cancel),
                pin=pin,
                block_for_room=block_for_room,
            )
        except ShardError as e:
            self._bad[s] = e
            log.warning("bad shard: %s", e)
            raise

    # ------------------------------------------------------------------ reader interface
    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def total_bytes(self) -> int:
        return int(self._size.sum())

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha1("|".join(s.key(self.label_key) for s in self.infos).encode()).hexdigest()[:16]
        return f"remote-webdataset:{len(self)}:{h}"

    def _check(self, i: int) -> int:
        n, j = len(self), int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"record {i} out of range for a data set of {n} records")
        return j

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = self._check(i)
        s = int(self._shard_of[j])
        m = self._maps.get(s)
        if m is None:
            m = self._map(s)
        off = int(self._offset[j])
        return m[off : off + int(self._size[j])], int(self._labels[j])

    def _map(self, s: int) -> np.ndarray:
        """Shard ``s`` memory-mapped: waits for its download ahead when one is under way, else fetches it now."""
        path = self.cache.path(self.infos[s].key())
        with self._cond:
            m = self._maps.get(s)
            if m is not None:
                return m
            while s in self._fetching:
                self._cond.wait(0.1)
            pinned = s in self._pins
        bad = self._bad.get(s)
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
                fd = self._fetch(s, pin=True)
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
                    self.cache.release(self.infos[s].key(), fd, used=False)
        with self._cond:
            if s not in self._pins and len(self._maps) > 2 * self.shuffle_window:
                # Unpinned maps: keep a few; an evicted file's space returns when its map goes.
                for old in [k for k in self._maps if k not in self._pins][: len(self._maps) // 2]:
                    del self._maps[old]
            self._maps[s] = m
        return m

    def source(self, i: int) -> str:
        """``url:member`` of record ``i``."""
        j = self._check(i)
        start = int(self._name_ends[j - 1]) if j else 0
        name = bytes(self._names[start : int(self._name_ends[j])]).decode("utf-8", "surrogateescape")
        return f"{self.shards[int(self._shard_of[j])]}:{name}"

    # ------------------------------------------------------------------ streaming: download ahead
    def schedule(self, order: np.ndarray, then: np.ndarray | None = None) -> None:
        """The records this process will read next, in order (the rest of the loader's pass), and optionally
        the next epoch's: shards are downloaded ahead in that order and unpinned once used (`advance`)."""
        order = np.asarray(order, dtype=np.int64)
        seq, last = _first_needs(self._shard_of[order]) if len(order) else (np.empty(0, np.int64), {})
        if then is not None and len(then) and self.prefetch_next_epoch:
            nxt, _ = _first_needs(self._shard_of[np.asarray(then, dtype=np.int64)])
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
            self.cache.release(self.infos[x].key(), fd, used=False)  # not used yet: evicted last

    def _unpin(self, s: int) -> None:
        fd = self._pins.pop(s)
        self._pinned_bytes -= int(self.shard_bytes[s])
        self._maps.pop(s, None)
        self.cache.release(self.infos[s].key(), fd)

    def _share(self) -> float:
        """Bytes this process may pin ahead: its share of the budget, or two windows of shards without one."""
        if self.cache.limit is None:
            return 2 * self.shuffle_window * float(self.shard_bytes.max()) + self.download_threads * float(
                self.shard_bytes.max()
            )
        return self.cache.limit / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def _next_to_fetch(self) -> int | None:
        """Under ``_cond``: the first shard of the plan not local, fetching or failed, if it fits the share."""
        for s in self._plan:
            if s in self._pins or s in self._fetching or s in self._bad or self._last_use[s] < self._delivered:
                continue  # local, under way, failed, or used up
            if self._pinned_bytes + self._fetching_bytes + self.shard_bytes[s] > self._share() and (
                self._pins or self._fetching
            ):
                return None
            return s
        return None

    def _start_threads(self) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < self.download_threads:
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
                fd = self._fetch(
                    s, pin=True, block_for_room=False, cancel=lambda: self._closed or generation != self._generation
                )
            except (ShardError, _Cancelled):
                pass
            except Exception as e:  # noqa: BLE001 - never leave a reader waiting on a dead thread
                self._bad[s] = ShardError(f"{self.infos[s].url}: {type(e).__name__}: {e}")
                log.exception("downloading %s failed", self.infos[s].url)
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
                        self.cache.release(self.infos[s].key(), fd, used=False)  # not wanted twice
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

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def stats(self) -> dict[str, int]:
        """This process's downloads (shards, bytes), evictions, and shards pinned now."""
        return {
            "downloads": self.cache.downloads,
            "downloaded_bytes": self.downloaded_bytes,
            "evictions": self.cache.evictions,
            "pinned": len(self._pins),
            "bad_shards": len(self._bad),
        }

    # ------------------------------------------------------------------ processes
    def _reset_process_state(self) -> None:
        """Per-process state, fresh: in a new reader, after unpickling, and in a forked child (whose
        pins were its parent's and whose threads did not survive the fork)."""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._maps: dict[int, np.ndarray] = {}
        self._pins: dict[int, int] = {}
        self._pinned_bytes = 0
        self._fetching: set[int] = set()
        self._fetching_bytes = 0
        self._bad: dict[int, ShardError] = getattr(self, "_bad", {})
        self._plan: list[int] = []
        self._last_use: dict[int, float] = {}
        self._delivered = 0
        self._threads: list[threading.Thread] = []
        self._generation = getattr(self, "_generation", 0) + 1
        self._closed = False
        self.downloaded_bytes = getattr(self, "downloaded_bytes", 0)
        if getattr(self, "_pid", None) not in (None, os.getpid()):
            self._fs = None  # fsspec's clients (event loops, connections) do not survive a fork
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k in _PICKLED}
        state["_fs"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pid = None
        self._reset_process_state()
        _READERS.add(self)

    def __repr__(self) -> str:
        return f"RemoteShardsReader({len(self.shards)} shards, records={len(self)}, classes={len(self.classes)})"


_PICKLED = ("_shard_of", "_offset", "_size", "_labels", "_names", "_name_ends", "_bad")


def _first_needs(shards: np.ndarray) -> tuple[np.ndarray, dict[int, float]]:
    """(shards in order of first need, the position of each shard's last need) of a per-record shard sequence."""
    uniq, first = np.unique(shards, return_index=True)
    seq = uniq[np.argsort(first, kind="stable")]
    _, last_rev = np.unique(shards[::-1], return_index=True)
    last = len(shards) - 1 - last_rev
    return seq.astype(np.int64), dict(zip(uniq.tolist(), last.astype(float).tolist(), strict=True))


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _pack_index(part: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {k: part[k] for k in ("offset", "size", "labels", "names", "name_ends")}
    out["crc"] = np.asarray(part["crc"], dtype=np.int64)
    out["meta"] = np.asarray(json.dumps({"skipped": part["skipped"], "ignored": part["ignored"]}).encode(), dtype=bytes)
    return out


def _load_index(path: Path) -> dict[str, Any] | None:
    try:
        with np.load(path) as z:
            part = {k: z[k] for k in ("offset", "size", "labels", "names", "name_ends")}
            part["crc"] = int(z["crc"])
            meta = json.loads(bytes(z["meta"]))
    except (OSError, KeyError, ValueError):
        return None
    part["skipped"] = [tuple(x) for x in meta["skipped"]]
    part["ignored"] = meta["ignored"]
    return part


def open_remote(spec: str, **kwargs: Any) -> RemoteShardsReader:
    """`RemoteShardsReader` over ``spec`` (what `open_dataset` calls for a URL)."""
    return RemoteShardsReader(spec, **kwargs)


__all__ = ["RemoteShardsReader", "ShardCache", "ShardChanged", "ShardError", "is_remote", "list_shards", "open_remote"]
