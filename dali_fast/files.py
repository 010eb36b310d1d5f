"""Files and folders every wing writes: atomic writes (a path holds a whole file or folder, or nothing),
the clean-up of what killed writers left, the cache folder, and writability checks made before any work."""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .machine import pid_alive

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where dali_fast keeps what it makes once and reuses (the default synthetic set, shard indexes,
    remote shards): ``$DALI_FAST_CACHE``, or ``~/.cache/dali_fast``."""
    return Path(os.environ.get("DALI_FAST_CACHE", Path.home() / ".cache" / "dali_fast"))


def cache_folder(name: str) -> Path:
    """The folder ``name`` under `default_cache_dir`, made if needed; one line naming ``DALI_FAST_CACHE``
    and the path when it cannot be made or written (a read-only home, a variable naming a file)."""
    base = default_cache_dir()
    path = base / name
    try:
        path.mkdir(parents=True, exist_ok=True)
        why = None if os.access(path, os.W_OK | os.X_OK) else "not writable"
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        where = f"DALI_FAST_CACHE={base}" if "DALI_FAST_CACHE" in os.environ else f"the cache folder {base}"
        raise ValueError(f"{where}: cannot write {path} ({why}); set DALI_FAST_CACHE to a writable folder")
    return path


def _temporary(path: Path, token: str = "") -> Path:
    """The temporary file or folder this process writes ``path`` through: ``.NAME.PID[-TOKEN].tmp`` beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}{token}.tmp")


def clean_stale(path: str | Path) -> None:
    """Remove the temporaries (files or folders, see `_temporary`) that writers of ``path`` killed mid-write
    left beside it; those of processes still running are theirs, and stay."""
    path = Path(path)
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -4].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        log.info("removing %s, left by a killed run", tmp)
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], *, durable: bool = False) -> None:
    """Write ``path`` through ``write(file)`` so that it only ever holds a whole file: a temporary file
    beside it, renamed over it when complete. ``durable`` also fsyncs the file and the rename."""
    with atomic_file(path, durable=durable) as f:
        write(f)


@contextlib.contextmanager
def atomic_file(path: str | Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A file opened for writing that appears at ``path`` only whole: the block writes a temporary file
    beside it (``.NAME.PID-TOKEN.tmp``, removed if the block fails, and by `clean_stale` if the process is
    killed), which replaces ``path`` when the block ends. ``durable`` also fsyncs the file and the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = _temporary(path, f"-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        with contextlib.suppress(OSError):  # the rename itself, where the platform allows
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, doing: str = "writing", what: str = "run") -> Iterator[Path]:
    """A new folder at ``path``, whole or not at all: the block fills the temporary folder it is given,
    which is renamed to ``path`` when the block ends (replacing an empty folder there) and removed if the
    block fails. Temporaries that killed runs left are removed first. Another folder appearing at
    ``path`` meanwhile is a `FileExistsError` (``doing`` and ``what`` word it: "appeared while packing
    (another pack ...)"); a ``path`` that cannot be made, or a block that runs out of room (a full disk,
    a quota, a file-size limit), a one-line `ValueError` naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = _temporary(path, f"-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        with contextlib.suppress(OSError):
            path.rmdir()  # only an empty folder goes
        try:
            os.rename(tmp, path)
        except OSError as e:
            if path.exists():
                raise FileExistsError(
                    f"{path}: appeared while {doing} (another {what} to the same place?); this {what} is discarded"
                ) from None
            raise ValueError(f"{path}: cannot be created ({e.strerror or e}); choose another destination") from e
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in OUT_OF_ROOM:
            raise
        raise ValueError(
            f"{path}: out of room while {doing} ({e.strerror or e}: the disk is full, or a quota or file-size limit "
            f"was reached); nothing was left there: free space, or choose another destination"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit


def check_writable_folder(path: str | Path, what: str) -> None:
    """Fail now, in one line, if folder ``path`` could not be created or written later (``what`` names it)."""
    why = _unwritable(Path(path))
    if why is not None:
        raise ValueError(f"{what} {path}: {why}; choose another path")


def check_writable_file(path: str | Path, what: str) -> None:
    """Fail now, in one line, if file ``path`` could not be written later: a folder there, an existing
    file that cannot be opened for writing, or a folder for it that cannot be made or written."""
    path = Path(path)
    why = "is a folder, not a file" if path.is_dir() else None
    if why is None and path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            why = f"cannot write it ({e.strerror or e})"
    elif why is None:
        why = _unwritable(path.parent)
    if why is not None:
        raise ValueError(f"{what} {path}: {why}; choose another path")


def _unwritable(path: Path) -> str | None:
    """Why folder ``path`` could not be made or written, or None: a file is made and removed in it, or in
    the nearest folder above it that exists (permission bits do not tell: root passes them, and a
    read-only mount, /proc or /sys refuse anyway)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{probe} is a file, not a folder"
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".dali_fast-probe-")
    except OSError as e:
        return f"cannot write in {probe} ({e.strerror or e})"
    os.close(fd)
    os.unlink(name)
    return None
