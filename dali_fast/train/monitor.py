"""A background sampler of GPU utilization and memory (NVML), or of this process tree's CPU use."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from ..machine import available_cpus, nvml_handle, read_proc_kib

log = logging.getLogger(__name__)


def _children_map() -> dict[int, list[int]]:
    """parent pid → child pids, from a scan of /proc (where the kernel has no per-task children file)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(name))
    return out


def _children(pid: int, scan: dict[int, list[int]] | None) -> list[int]:
    if scan is not None:
        return scan.get(pid, [])
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


_HAS_CHILDREN_FILE = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _proc_tree_cpu_seconds(root: int) -> float | None:
    """User+system CPU seconds of ``root`` and its live descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, seen, frontier = 0.0, set(), [root]
    scan = None if _HAS_CHILDREN_FILE else _children_map()
    while frontier:
        pid = frontier.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            if pid == root:
                return None
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        try:
            frontier += _children(pid, scan)
        except OSError:
            continue
    return total


class UtilizationMonitor:
    """Samples every ``interval`` s in a thread; ``with monitor.phase("name"):`` groups the samples.

    On a GPU (NVML readable) it records GPU utilization % and memory used; otherwise this process
    tree's CPU utilization, in % of all cpus. Never raises because NVML is missing: ``kind`` is
    then "cpu", and GPU figures read "n/a".
    """

    def __init__(self, interval: float = 0.2, device_index: int = 0, gpu: bool | None = None, nvml: Any = None) -> None:
        self.interval = interval
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self._phase: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        if gpu is not False:
            try:
                if nvml is None:
                    import pynvml
                else:
                    pynvml = nvml
                pynvml.nvmlInit()
                self._handle = nvml_handle(pynvml, device_index)  # CUDA's index, found by UUID
                self._nvml = pynvml
                self.gpu_name = str(pynvml.nvmlDeviceGetName(self._handle))
            except Exception as e:  # noqa: BLE001 - no GPU/driver: fall back to CPU utilization
                log.debug("NVML unavailable (%s); monitoring CPU", e)
                self._nvml = None
        self.kind = "gpu" if self._nvml is not None else "cpu"
        self.ncpu = available_cpus()
        self._last: tuple[float, float] | None = None
        self._lock = threading.Lock()  # the sampling thread and phase ends both read

    def _read(self) -> tuple[float, float] | None:
        with self._lock:
            return self._read_unlocked()

    def _read_unlocked(self) -> tuple[float, float] | None:
        if self._nvml is not None:
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
                return float(util), float(self._process_gpu_memory())
            except Exception:  # noqa: BLE001 - a failed reading is skipped, not fatal
                return None
        now, cpu = time.perf_counter(), _proc_tree_cpu_seconds(os.getpid())
        if cpu is None:
            return None
        last, self._last = self._last, (now, cpu)
        if last is None or now <= last[0]:
            return None
        rss = read_proc_kib("/proc/self/status", "VmRSS")
        # A child that exits takes its CPU time out of the tree's total: never below 0 %.
        busy = max(0.0, min(100.0, 100.0 * (cpu - last[1]) / (now - last[0]) / self.ncpu))
        return busy, float((rss or 0) * 1024)

    def _process_gpu_memory(self) -> int:
        """GPU memory this process uses (NVML's per-process figure: torch's and DALI's allocations,
        caches and pools alike); the device's used memory where per-process figures are unavailable."""
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # noqa: BLE001 - not supported (some containers, MIG): the device figure
            procs = None
        mine = [p for p in procs or [] if int(p.pid) == os.getpid()]
        if mine and all(getattr(p, "usedGpuMemory", None) is not None for p in mine):
            return sum(int(p.usedGpuMemory) for p in mine)
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            r = self._read()
            if r is not None and self._phase is not None:
                self.samples.setdefault(self._phase, []).append(r)

    def start(self) -> UtilizationMonitor:
        self._read()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="dali_fast-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> UtilizationMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def summary(self, name: str) -> dict[str, Any]:
        """mean/p50/p95 utilization % and peak memory bytes of a phase ("n/a" when nothing was read)."""
        s = self.samples.get(name, [])
        if not s:
            return {"kind": self.kind, "samples": 0, "mean": "n/a", "p50": "n/a", "p95": "n/a", "peak_mem": "n/a"}
        util = np.array([u for u, _ in s])
        return {
            "kind": self.kind,
            "samples": len(s),
            "mean": float(util.mean()),
            "p50": float(np.percentile(util, 50)),
            "p95": float(np.percentile(util, 95)),
            "peak_mem": float(max(m for _, m in s)),
        }


class _Phase:
    def __init__(self, monitor: UtilizationMonitor, name: str) -> None:
        self.monitor, self.name = monitor, name

    def __enter__(self) -> None:
        self.monitor._read()  # fresh CPU baseline
        self.monitor._phase = self.name

    def __exit__(self, *exc: object) -> None:
        # One reading at the end covers the phase's tail, so even a phase shorter than the sampling
        # interval has a figure (CPU: the average since the last reading).
        r = self.monitor._read()
        if r is not None:
            self.monitor.samples.setdefault(self.name, []).append(r)
        self.monitor._phase = None
