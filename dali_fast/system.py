"""Small readings of the machine shared by the loaders, probes and monitor."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
