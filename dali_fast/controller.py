"""`BatchSizeController`: the batch size follows measured peak memory, changed only between epochs.

Probes read real memory (NVML, torch's CUDA allocator, this process's RSS); none is ever
simulated. A probe that cannot read says so once and the controller holds the batch size.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .system import nvml_handle, read_proc_kib

log = logging.getLogger(__name__)
GiB = 2**30


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


class BatchSizeController:
    """Picks each epoch's batch size from the previous epochs' measured peak memory.

    After each epoch it fits ``peak = fixed + per_sample * batch`` to the epochs seen (with one
    epoch, the cautious guess that the whole peak scales with the batch). It grows by ``grow``
    only when the grown batch's predicted peak stays ``hysteresis`` below ``target_fraction``,
    shrinks by ``shrink`` when the peak went over the target (or an out-of-memory was reported),
    else holds; it never grows back to a size that once went over, so readings near the target
    do not make it flip-flop. Sizes are rounded down to ``multiple_of`` and clamped to
    [min_batch, max_batch]. Under ``torch.distributed`` (``sync_ranks``) every rank decides from
    the highest peak of all ranks, so all ranks keep the same batch size and the same number of
    batches per epoch (DDP would hang otherwise).

    Each epoch starts by ``release()`` (default: `release_unused_memory`, torch's and DALI's cached
    GPU blocks back to the device), so a GPU reading is the epoch's own need, not what the caches
    kept from a larger epoch before.

    ``on_change(old, new)`` runs when the size changes, e.g. to keep the learning rate linear
    in the batch size (Goyal et al., 2017)::

        def rescale_lr(old, new):
            for group in optimizer.param_groups:
                group["lr"] *= new / old

        controller = BatchSizeController(64, 1024, on_change=rescale_lr)
        loader = DALIIterator(dataset, batch_size=256, controller=controller)
    """

    def __init__(
        self,
        min_batch: int,
        max_batch: int,
        target_fraction: float = 0.85,
        *,
        grow: float = 2.0,
        shrink: float = 0.5,
        multiple_of: int = 8,
        hysteresis: float = 0.05,
        probe: MemoryProbe | None = None,
        on_change: Callable[[int, int], None] | None = None,
        sync_ranks: bool = True,
        release: Callable[[], None] | None = release_unused_memory,
    ) -> None:
        if not 1 <= min_batch <= max_batch:
            raise ValueError(f"min_batch={min_batch}, max_batch={max_batch}: need 1 <= min_batch <= max_batch")
        if not 0 < target_fraction <= 1:
            raise ValueError(f"target_fraction={target_fraction}: must be in (0, 1]")
        if grow <= 1 or not 0 < shrink < 1:
            raise ValueError(f"grow={grow}, shrink={shrink}: need grow > 1 and 0 < shrink < 1")
        if multiple_of < 1:
            raise ValueError(f"multiple_of={multiple_of}: must be >= 1")
        self.min_batch, self.max_batch = int(min_batch), int(max_batch)
        self.target_fraction, self.grow, self.shrink = float(target_fraction), float(grow), float(shrink)
        self.multiple_of, self.hysteresis = int(multiple_of), float(hysteresis)
        self._probe = probe
        self.on_change = on_change
        self.sync_ranks = bool(sync_ranks)
        self.release = release
        self.batch_size = self.min_batch
        self.history: list[dict[str, Any]] = []
        self.observations: list[tuple[int, float]] = []  # (batch size, peak fraction)
        self.ceiling: int | None = None  # smallest batch size that went over the target
        self._oom = False
        self._warned_unreadable = False

    @property
    def probe(self) -> MemoryProbe:
        if self._probe is None:
            self._probe = default_probe()
        return self._probe

    def _round(self, batch: float) -> int:
        """Round down to ``multiple_of``, within the multiples inside [min_batch, max_batch] where any exist."""
        m = self.multiple_of
        lo = -(-self.min_batch // m) * m
        lo = lo if lo <= self.max_batch else self.min_batch
        hi = self.max_batch // m * m
        hi = hi if hi >= lo else self.max_batch
        return int(min(hi, max(lo, int(batch) // m * m)))

    def attach(self, batch_size: int) -> None:
        """Start from ``batch_size`` (clamped to [min_batch, max_batch])."""
        self.batch_size = int(min(self.max_batch, max(self.min_batch, batch_size)))

    def begin_epoch(self) -> None:
        """Release what the caches hold, then start measuring: the reading is this epoch's own need.

        Without the release, torch's caching allocator and DALI's memory pool keep the blocks of an
        earlier, larger epoch, every later reading includes them, and the size could only shrink.
        """
        if self.release is not None:
            self.release()
        self.probe.reset_peak()

    def report_oom(self, batch_size: int) -> None:
        """An out-of-memory happened at ``batch_size`` inside the epoch: shrink at the next boundary."""
        log.warning("out of memory at batch %d: the batch size shrinks at the next epoch", batch_size)
        self._oom = True

    def predict(self, batch: int) -> float | None:
        """Predicted peak fraction at ``batch`` from the epochs seen."""
        if not self.observations:
            return None
        sizes = {b for b, _ in self.observations}
        if len(sizes) >= 2:
            n = len(self.observations)
            mb = sum(b for b, _ in self.observations) / n
            mf = sum(f for _, f in self.observations) / n
            var = sum((b - mb) ** 2 for b, _ in self.observations)
            slope = sum((b - mb) * (f - mf) for b, f in self.observations) / var
            if slope > 0:
                fixed = mf - slope * mb
                return max(fixed, 0.0) + slope * batch
        b, f = self.observations[-1]
        return f * batch / b  # cautious: all of the peak scales with the batch

    def end_epoch(self, epoch: int) -> int:
        """Read the epoch's peak and choose the next epoch's batch size; returns it."""
        old = self.batch_size
        frac = self.probe.peak_fraction()
        if self.sync_ranks:
            frac, self._oom = agree_across_ranks(frac, self._oom)
        cap = probe_capacity(self.probe)
        cap_s = f" of {cap / GiB:.0f} GiB" if cap else ""
        target = self.target_fraction
        if self._oom:
            new, decision = self._round(old * self.shrink), "shrink"
            self.ceiling = old if self.ceiling is None else min(self.ceiling, old)
            reason = "out of memory during the epoch"
        elif frac is None:
            new, decision, reason = old, "hold", "memory could not be read"
            if not self._warned_unreadable:
                self._warned_unreadable = True
                log.warning(
                    "memory probe %r gave no reading at the end of epoch %d: batch size held at %d",
                    probe_name(self.probe),
                    epoch,
                    old,
                )
        else:
            self.observations.append((old, frac))
            if frac > target:
                new, decision = self._round(old * self.shrink), "shrink"
                self.ceiling = old if self.ceiling is None else min(self.ceiling, old)
                reason = f"peak {frac:.0%}{cap_s} > {target:.0%}"
            else:
                grown = self._round(old * self.grow)
                pred = self.predict(grown)
                if grown <= old:
                    new, decision, reason = old, "hold", f"peak {frac:.0%}{cap_s}; at max_batch {self.max_batch}"
                elif self.ceiling is not None and grown >= self.ceiling:
                    new, decision = old, "hold"
                    reason = f"peak {frac:.0%}{cap_s}; batch {self.ceiling} went over {target:.0%} before"
                elif pred is not None and pred < target - self.hysteresis:
                    new, decision = grown, "grow"
                    reason = f"peak {frac:.0%}{cap_s}, predicted {pred:.0%} at {grown} < {target - self.hysteresis:.0%}"
                else:
                    new, decision = old, "hold"
                    reason = f"peak {frac:.0%}{cap_s}, predicted {pred:.0%} at {grown} too close to {target:.0%}"
        if new == old and decision != "hold":
            decision = "hold"
            reason += f" (already at {'min' if new == self.min_batch else 'max'}_batch)"
        self._oom = False
        self.history.append(
            {
                "epoch": int(epoch),
                "batch_size": old,
                "peak_fraction": frac,
                "decision": decision,
                "reason": reason,
                "next_batch_size": new,
            }
        )
        log.info("epoch %d: %s → batch %d → %d (%s)", epoch, reason, old, new, decision)
        self.batch_size = new
        if new != old and self.on_change is not None:
            self.on_change(old, new)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "history": list(self.history),
            "observations": list(self.observations),
            "ceiling": self.ceiling,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_size = int(state["batch_size"])
        self.history = list(state.get("history", []))
        self.observations = [tuple(o) for o in state.get("observations", [])]
        self.ceiling = state.get("ceiling")


# pragma: no mutate block (rank agreement and the OOM split: tested with real processes and fakes)
def agree_across_ranks(frac: float | None, oom: bool) -> tuple[float | None, bool]:
    """The highest peak and any out-of-memory over all ranks of an initialized process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return frac, oom
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    t = torch.tensor([-1.0 if frac is None else float(frac), float(oom)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    worst, any_oom = t.tolist()
    return (None if worst < 0 else worst), bool(any_oom)


def oom_safe_step(
    step: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor | float],
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    zero_grad: Callable[[], None],
    controller: BatchSizeController | None = None,
    min_split: int = 1,
) -> torch.Tensor | float:
    """Run ``step(images, labels, weight)`` (forward + backward, loss scaled by ``weight``); on CUDA
    out-of-memory, empty the cache and run the batch as two halves (each sample once), recursively.

    The caller steps the optimizer after it returns; gradients then equal the whole batch's.
    Returns the batch's loss. The OOM is reported to ``controller``, which shrinks at the next epoch.
    """
    n = len(labels)
    try:
        return step(images, labels, 1.0)  # as the step returns it: a device tensor is not synced here
    except torch.cuda.OutOfMemoryError:
        if n <= min_split:
            raise
    # Recover here, outside the `except` block: inside it, the exception's traceback would keep the
    # failed step's frames, and with them its activations and graph, alive while the halves run.
    zero_grad()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if controller is not None:
        controller.report_oom(n)
    log.warning("out of memory on a batch of %d: running it as two halves", n)
    half = n // 2
    total: torch.Tensor | float = 0.0
    for lo, hi in ((0, half), (half, n)):

        def part(x: torch.Tensor, y: torch.Tensor, w: float, _s: float = (hi - lo) / n) -> torch.Tensor | float:
            return step(x, y, w * _s)

        total += oom_safe_step(
            part, images[lo:hi], labels[lo:hi], zero_grad=lambda: None, controller=None, min_split=min_split
        ) * ((hi - lo) / n)
    return total
