"""Readings of the machine this process runs on: its CPUs, its CUDA device and NVML's handle for it, its
memory, and the processes it may outlive or must die with. torch is imported inside the functions that need it."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpus_per_local_rank() -> int:
    """This process's share of the CPUs when torchrun starts LOCAL_WORLD_SIZE processes on the node."""
    return max(1, available_cpus() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def devices_remapped() -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` gives CUDA device k another GPU than NVML's device k: it lists
    UUIDs, or indices other than 0, 1, 2, ... in that order. Unset, or "0,1,...": the same numbering."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return False
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return entries != [str(k) for k in range(len(entries))]


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
