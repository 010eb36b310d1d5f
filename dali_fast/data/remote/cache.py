"""`ShardCache`: the node-local files of remote shards, within a byte budget shared by every process of
the node. One download per shard per node (a file lock per shard); a download goes to a temporary file of
the shard's full size (so the budget counts it), then is renamed; shards a process still needs are pinned
with a shared lock (released by the kernel if the process dies); when room is needed, unpinned shards go,
the most recently used up first (a used shard is not needed again this epoch). POSIX file locks.

Without a budget given, the budget is what the disk can spare at open: its free space plus the shards
already cached, less a margin kept free for everything else (`DISK_MARGIN`), so the cache never fills the
disk by itself. A disk that fills anyway (other writers) stops the run with `CacheDiskFullError`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ...machine import pid_alive
from .errors import CacheDiskFullError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02  # waiting on another process's download or for room
# Kept free on the cache's disk when no budget is given: 10 % of the disk, and at least 2 GiB (room for
# checkpoints, logs and the other writers of a node's scratch disk).
DISK_MARGIN, DISK_MARGIN_MIN = 0.10, 2 << 30

_LOCK_FDS: set[int] = set()  # lock files this process holds open; a forked child closes its copies
# Held while a lock file is opened and recorded, or forgotten and closed, and across a fork: a fork can
# then never fall between the two, which would leave the child an fd it does not know it holds.
_LOCK_FDS_GUARD = threading.Lock()


def open_lock(path: Path) -> int:
    with _LOCK_FDS_GUARD:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _LOCK_FDS.add(fd)
    return fd


def close_lock(fd: int) -> None:
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_locks_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep its parent's locks: flock locks belong to the
    open file, which fork shares, so a lock the child kept open would outlive the parent's release."""
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _LOCK_FDS_GUARD.release()  # taken by the forking thread before the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_LOCK_FDS_GUARD.acquire,
        after_in_parent=_LOCK_FDS_GUARD.release,
        after_in_child=_close_locks_in_child,
    )


class ShardCache:
    """The node-local shard files under ``folder``, within ``limit`` bytes (None: what the disk can spare at
    open, `disk_budget`; ``limit_given`` says which).

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
        with self.locked():
            self._clean_stale()
        self.limit_given = limit is not None
        self.limit = limit if limit is not None else self.disk_budget()
        self.overflow_after = overflow_after  # a read that needs a shard now waits this long for room at most
        self.downloads = 0  # shards this process downloaded
        self.evictions = 0
        self._warned_overflow = False

    def disk_budget(self) -> int:
        """What the disk can spare for shards: its free space and the shards already here, less the margin
        kept free (`DISK_MARGIN`); said once. One line when that leaves no room at all."""
        usage = shutil.disk_usage(self.folder)
        margin = max(int(usage.total * DISK_MARGIN), DISK_MARGIN_MIN)
        cached = self.used()
        budget = cached + usage.free - margin
        if budget <= 0:
            raise ValueError(
                f"cache_dir {self.folder}: its disk has {_gib(usage.free)} free, less than the {_gib(margin)} kept "
                "free for other writers; free space there, or choose a cache folder on a larger disk (--cache-dir, "
                "cache_dir)"
            )
        log.info(
            "shard cache %s: up to %s of shards (no cache_limit given: the disk's %s free and %s already cached, "
            "less %s kept free)",
            self.folder,
            _gib(budget),
            _gib(usage.free),
            _gib(cached),
            _gib(margin),
        )
        return budget

    def _disk_full(self, e: OSError) -> CacheDiskFullError:
        return CacheDiskFullError(
            f"shard cache {self.folder}: the disk is full ({e.strerror or e}); free space on it, or keep the cache "
            "below what the disk can hold with --cache-limit (cache_limit), or choose another --cache-dir"
        )

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.tar"

    @contextlib.contextmanager
    def locked(self):
        """The cache-wide lock: budget checks, evictions and renames happen under it."""
        fd = open_lock(self.folder / ".cache.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            close_lock(fd)

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
            fd = open_lock(self.folder / (name[: -len(".tar")] + ".lock"))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                close_lock(fd)
                continue  # pinned by a process that still needs it
            try:
                os.unlink(self.folder / name)
                used -= size
                self.evictions += 1
                log.debug("evicted %s (%d bytes)", name, size)
            except FileNotFoundError:
                pass
            finally:
                close_lock(fd)
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
                    try:
                        with open(tmp, "wb") as f:
                            f.truncate(size)
                    except OSError as e:
                        tmp.unlink(missing_ok=True)
                        if e.errno in _DISK_FULL:
                            raise self._disk_full(e) from e
                        raise
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
            fd = open_lock(lock_path)
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
                    except BaseException as e:
                        tmp.unlink(missing_ok=True)  # never read: only a whole, checked download is renamed
                        if isinstance(e, OSError) and e.errno in _DISK_FULL:
                            raise self._disk_full(e) from e
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
                    close_lock(fd)

    def release(self, key: str, fd: int, used: bool = True) -> None:
        """Unpin a shard; ``used``: its use is over (it becomes the first to evict)."""
        if used:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path(key))
        close_lock(fd)


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _gib(n: int) -> str:
    """Bytes as people read them: GiB, MiB, or bytes."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n} bytes"
