"""Memory probes: the peak memory of an epoch, as a fraction of capacity, for `controller.BatchSizeController`.

Each reads real memory (NVML, the device's ``mem_get_info``, torch's CUDA allocator, this process's RSS),
sampled through the epoch in a thread; none is simulated. The contract is two methods (`MemoryProbe`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..machine import nvml_handle, read_proc_kib

log = logging.getLogger(__name__)


# pragma: no mutate start (probes: readings of the machine, tested against fakes)
def release_unused_memory() -> None:
    """Return cached GPU memory to the device: torch's caching allocator, and DALI's pool where the
    installed DALI can (``nvidia.dali.backend.ReleaseUnusedMemory``). Nothing to do without CUDA."""
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    try:
        from nvidia.dali import backend
    except ImportError:
        return
    release = getattr(backend, "ReleaseUnusedMemory", None)
    if release is not None:
        release()


class MemoryProbe(Protocol):
    """Peak memory of one epoch, as a fraction of capacity.

    The contract is two methods: ``reset_peak()`` at the epoch's start and ``peak_fraction()``
    at its end (None when it cannot read). Everything else is optional: ``name`` (for messages;
    the class name otherwise) and ``capacity_bytes`` (to say "of 80 GiB" in the reasons).
    """

    def reset_peak(self) -> None: ...
    def peak_fraction(self) -> float | None: ...


def probe_name(probe: object) -> str:
    return str(getattr(probe, "name", type(probe).__name__))


def probe_capacity(probe: object) -> int | None:
    cap = getattr(probe, "capacity_bytes", None)
    return int(cap) if cap else None


class _Sampler:
    """A daemon thread calling ``read()`` every ``interval`` s and keeping the maximum."""

    def __init__(self, read: Callable[[], int | None], interval: float = 0.05) -> None:
        self.read, self.interval = read, interval
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.stop()
        self.peak = None
        self._stop.clear()
        self._take()
        self._thread = threading.Thread(target=self._loop, name="dali_fast-memprobe", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        value = self.read()
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def stop(self) -> int | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._take()
        return self.peak


class NvmlProbe:
    """Device memory used (all processes) from NVML, sampled through the epoch; needs nvidia-ml-py.

    ``device_index`` is the CUDA index (as torch and DALI count); the NVML device is found by UUID.
    """

    name = "nvml"

    def __init__(self, device_index: int = 0, interval: float = 0.05, nvml: Any = None) -> None:
        self.capacity_bytes: int | None = None
        self._handle = None
        self._warned = False
        try:
            if nvml is None:
                import pynvml as nvml  # provided by the nvidia-ml-py package
            nvml.nvmlInit()
            self._nvml = nvml
            self._handle = nvml_handle(nvml, device_index)  # by UUID: NVML's index is not CUDA's
            self.capacity_bytes = int(nvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        except Exception as e:  # noqa: BLE001 - no driver / no library: the probe cannot read
            self._why = f"{type(e).__name__}: {e}"
            self._handle = None
        self._sampler = _Sampler(self._used, interval)

    def _used(self) -> int | None:
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except Exception as e:  # noqa: BLE001 - an NVML error mid-run makes this reading unavailable
            self._why = f"{type(e).__name__}: {e}"
            return None

    def reset_peak(self) -> None:
        self._sampler.start()

    def peak_fraction(self) -> float | None:
        peak = self._sampler.stop()
        if peak is None or not self.capacity_bytes:
            if not self._warned:
                log.warning("NVML memory probe cannot read (%s)", getattr(self, "_why", "no reading"))
                self._warned = True
            return None
        return peak / self.capacity_bytes


class TorchCudaProbe:
    """This process's peak reserved CUDA memory (torch's allocator), reset each epoch."""

    name = "torch.cuda"

    def __init__(self, device: int | None = None) -> None:
        self.device = device
        self.capacity_bytes = (
            int(torch.cuda.get_device_properties(device or 0).total_memory) if torch.cuda.is_available() else None
        )
        self._warned = False

    def reset_peak(self) -> None:
        if self.capacity_bytes:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_fraction(self) -> float | None:
        if not self.capacity_bytes:
            if not self._warned:
                log.warning("torch.cuda memory probe: CUDA is not available; batch size held")
                self._warned = True
            return None
        return torch.cuda.max_memory_reserved(self.device) / self.capacity_bytes


class DeviceMemoryProbe:
    """Device memory in use (every process and allocator: torch's cache, DALI's pool, NVML-invisible
    contexts alike) from ``torch.cuda.mem_get_info``, sampled through the epoch.

    Works where NVML cannot read: a container without the driver's ``utility`` capability, a MIG slice
    (whose free and total memory are the slice's). ``mem_get_info`` is injectable for tests.
    """

    name = "cuda.mem_get_info"

    def __init__(self, device: int | None = None, interval: float = 0.05, mem_get_info: Any = None) -> None:
        self.device = device
        self._mem_get_info = mem_get_info or torch.cuda.mem_get_info
        self.capacity_bytes: int | None = None
        self._why = "CUDA is not available"
        self._warned = False
        if mem_get_info is not None or torch.cuda.is_available():
            try:
                self.capacity_bytes = int(self._mem_get_info(device)[1])
            except Exception as e:  # noqa: BLE001 - a broken CUDA context: this probe cannot read
                self._why = f"{type(e).__name__}: {e}"
        self._sampler = _Sampler(self._used, interval)

    def _used(self) -> int | None:
        if not self.capacity_bytes:
            return None
        try:
            free, total = self._mem_get_info(self.device)
        except Exception as e:  # noqa: BLE001 - a failed reading is skipped
            self._why = f"{type(e).__name__}: {e}"
            return None
        return int(total) - int(free)

    def reset_peak(self) -> None:
        self._sampler.start()

    def peak_fraction(self) -> float | None:
        peak = self._sampler.stop()
        if peak is None or not self.capacity_bytes:
            if not self._warned:
                log.warning("device memory probe cannot read (%s)", self._why)
                self._warned = True
            return None
        return peak / self.capacity_bytes


class HostProbe:
    """This process's peak RSS against the RAM it could use (available at epoch start + its own RSS).

    Resets the kernel's high-water mark (``/proc/self/clear_refs``) each epoch where allowed and
    also samples RSS, so the reading is the epoch's own peak.
    """

    name = "host"

    def __init__(self, interval: float = 0.05, proc: str = "/proc") -> None:
        self.proc = proc
        self.capacity_bytes: int | None = None
        self._warned = False
        self._sampler = _Sampler(self._rss, interval)

    def _rss(self) -> int | None:
        kib = read_proc_kib(f"{self.proc}/self/status", "VmRSS")
        return None if kib is None else kib * 1024

    def reset_peak(self) -> None:
        try:
            with open(f"{self.proc}/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        avail = read_proc_kib(f"{self.proc}/meminfo", "MemAvailable")
        rss = self._rss()
        self.capacity_bytes = None if avail is None or rss is None else avail * 1024 + rss
        self._sampler.start()

    def peak_fraction(self) -> float | None:
        sampled = self._sampler.stop()
        hwm = read_proc_kib(f"{self.proc}/self/status", "VmHWM")
        peak = max(x for x in (sampled, None if hwm is None else hwm * 1024, 0) if x is not None)
        if not self.capacity_bytes or not peak:
            if not self._warned:
                log.warning("host memory probe cannot read %s/self/status; batch size held", self.proc)
                self._warned = True
            return None
        return peak / self.capacity_bytes


class MaxProbe:
    """The highest reading of several probes (e.g. NVML and torch on a GPU); None if none can read."""

    def __init__(self, probes: Sequence[MemoryProbe]) -> None:
        self.probes = list(probes)
        self.name = "+".join(probe_name(p) for p in self.probes)

    @property
    def capacity_bytes(self) -> int | None:
        return next((c for c in map(probe_capacity, self.probes) if c), None)

    def reset_peak(self) -> None:
        for p in self.probes:
            p.reset_peak()

    def peak_fraction(self) -> float | None:
        readings = [f for f in (p.peak_fraction() for p in self.probes) if f is not None]
        return max(readings) if readings else None


def default_probe(device: int | None = None) -> MemoryProbe:
    """On a GPU the highest of NVML, the device-wide ``mem_get_info`` and torch's allocator (NVML may be
    missing or blind to a MIG slice; ``mem_get_info`` sees DALI's memory everywhere); this process's RSS
    otherwise."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else device
        return MaxProbe([NvmlProbe(index), DeviceMemoryProbe(index), TorchCudaProbe(index)])
    return HostProbe()


# pragma: no mutate end
