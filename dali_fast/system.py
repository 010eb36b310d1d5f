"""Small readings of the machine (CPUs, the CUDA device of this process, NVML's handle for it) and the atomic
writes (files and folders) shared by every wing. torch is imported inside the functions that need it."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpus_per_local_rank() -> int:
    """This process's share of the CPUs when torchrun starts LOCAL_WORLD_SIZE processes on the node."""
    return max(1, available_cpus() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def read_proc_kib(path: str, key: str) -> int | None:
    """The kB value of ``key`` in a /proc status-style file (``VmRSS``, ``MemAvailable``...), or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_capacity(kind: str) -> int | None:
    """Bytes of the memory a peak is a fraction of: the GPU's (``kind`` "gpu") or the machine's RAM."""
    if kind == "gpu":
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    total_kib = read_proc_kib("/proc/meminfo", "MemTotal")
    return (total_kib or 0) * 1024 or None


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def die_with_parent(parent: int) -> None:
    """Make this worker process end when ``parent`` (the process that started it) dies, even by SIGKILL.

    A forked pool worker holds copies of its task pipe's write end, so it never sees end-of-file and
    would wait for tasks forever once its parent is gone. On Linux the kernel sends SIGKILL at the
    parent's death (PR_SET_PDEATHSIG); elsewhere this does nothing. Pass ``os.getpid()`` of the parent:
    a parent that died before the call already left the worker to another, so it exits at once.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun that agrees with it: "1 sample", "2 samples" (``many`` for irregular plurals)."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def progress_bar(total: int, desc: str, unit: str, *, enabled: bool = True, leave: bool = True) -> Any:
    """A tqdm bar on stderr when stderr is a terminal; otherwise (a log file, CI) no bar, and one log line
    saying the stage has begun. Close it (``finally``) before an error is written, so the error has its own line."""
    from tqdm import tqdm

    drawn = enabled and sys.stderr.isatty()
    if enabled and not drawn:
        log.info("%s: %s ...", desc, plural(total, {"img": "image"}.get(unit, unit)))
    return tqdm(total=total, desc=desc, unit=unit, leave=leave, disable=not drawn)


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
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
    (another pack ...)"); a ``path`` that cannot be made, a one-line `ValueError`."""
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def cuda_usable() -> bool:
    """True when torch sees a CUDA device it can use."""
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:  # noqa: BLE001 - a broken driver means "no GPU" here
        return False


def local_device_index() -> int:
    """The CUDA device of this process: ``LOCAL_RANK`` under a launcher, else the current device.

    Launchers that give each process its own GPU through ``CUDA_VISIBLE_DEVICES`` (SLURM's
    ``--gpus-per-task=1``, for one) leave fewer visible devices than local ranks: device
    ``LOCAL_RANK`` does not exist there, so the index is ``LOCAL_RANK % device_count()``, and the
    log says so once.
    """
    import torch

    if "LOCAL_RANK" not in os.environ:
        return torch.cuda.current_device() if cuda_usable() else 0
    local = int(os.environ["LOCAL_RANK"])
    count = torch.cuda.device_count() if cuda_usable() else 0
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)), local + 1)
    if count == 0 or count >= ranks:
        return local
    index = local % count
    _say_device_once(local, ranks, count, index)
    return index


_SAID: set[tuple[int, int, int]] = set()


def _say_device_once(local: int, ranks: int, count: int, index: int) -> None:
    if (local, ranks, count) in _SAID:
        return
    _SAID.add((local, ranks, count))
    shared = count > 1  # one visible device per process is the launcher's binding; several: ranks share them
    (log.warning if shared else log.info)(
        "LOCAL_RANK=%d of %d local ranks sees %d CUDA device(s) (the launcher set CUDA_VISIBLE_DEVICES per "
        "process): using CUDA device %d (LOCAL_RANK %% %d)%s",
        local,
        ranks,
        count,
        index,
        count,
        "; several ranks share a GPU" if shared else "",
    )


def cuda_device_uuid(cuda_index: int) -> str | None:
    """The UUID torch reports for CUDA device ``cuda_index``, without NVML's "GPU-"/"MIG-" prefix, or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:  # noqa: BLE001 - no CUDA, an old torch without .uuid: fall back to the environment
        return None
    return uuid.split("-", 1)[1] if uuid.startswith(("GPU-", "MIG-")) else uuid


def nvml_handle(nvml: Any, cuda_index: int) -> Any:
    """NVML's handle for the GPU, or MIG slice, that CUDA calls ``cuda_index``.

    NVML's index is not CUDA's: with ``CUDA_VISIBLE_DEVICES=5,6`` CUDA device 1 is NVML device 6, and
    a MIG slice has no NVML index at all. So the device is looked up by UUID (from torch when CUDA is
    up: NVML spells a whole GPU's "GPU-<uuid>" and a MIG slice's "MIG-<uuid>", so both are tried; else
    from CUDA_VISIBLE_DEVICES when it names UUIDs), by the index CUDA_VISIBLE_DEVICES gives, and only
    without either by ``cuda_index`` itself.
    """
    uuid = cuda_device_uuid(cuda_index)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:  # noqa: BLE001 - NVML's "not found": a MIG slice goes by its MIG- UUID
            return nvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and 0 <= cuda_index < len(visible):
        entry = visible[cuda_index]
        if entry.startswith(("GPU-", "MIG-")):
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
