"""Small readings of the machine shared by the loaders, probes and monitor."""

from __future__ import annotations

import os


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
