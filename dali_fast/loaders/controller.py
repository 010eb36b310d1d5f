"""`BatchSizeController`: the batch size follows measured peak memory, changed only between epochs.

The memory readings come from `memory_probes` (NVML, the device, torch's CUDA allocator, this process's RSS);
none is ever simulated. A probe that cannot read says so once and the controller holds the batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .memory_probes import MemoryProbe, default_probe, probe_capacity, probe_name, release_unused_memory

log = logging.getLogger(__name__)
GiB = 2**30


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

    Progressive resizing: the loader tells it each epoch's pixels per sample (`set_pixels`). Readings are
    kept in batches of the first size seen (``ref_pixels``), so memory that grows with the pixels of a
    batch is predicted at any size; when the size changes, the batch size is cut before the epoch starts
    if the prediction at the new size passes the target (never an epoch at full resolution run with a
    batch size chosen at a lower one). Growing stays the end-of-epoch decision.

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

    Args:
        min_batch: the smallest batch size it picks.
        max_batch: the largest batch size it picks.
        target_fraction: the share of the device's memory a peak may reach.
        grow: the factor of a step up.
        shrink: the factor of a step down.
        multiple_of: sizes are rounded down to a multiple of this.
        hysteresis: how far below the target a grown size's predicted peak must stay.
        probe: what reads the peak memory (default: `memory_probes.default_probe`: NVML, the device and
            torch's allocator on a GPU, this process's RSS otherwise).
        on_change: called with (old, new) when the size changes.
        sync_ranks: every rank decides from the highest peak of all ranks (under ``torch.distributed``).
        release: called at each epoch's start, so cached blocks are not read as the epoch's need.
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
        self.pixels: int | None = None  # pixels per sample of the coming epoch (None: never told)
        self.ref_pixels: int | None = None  # the size observations and ceiling are counted in

    def _scale(self) -> float:
        """How many reference-size samples one sample of the current size weighs (memory ~ pixels)."""
        if self.pixels is None or self.ref_pixels is None:
            return 1.0
        return self.pixels / self.ref_pixels

    def set_pixels(self, pixels: int) -> int:
        """The coming epoch's pixels per sample (``image_size**2``); returns the batch size to use.

        A change of size re-predicts the current batch size's peak at the new size from the readings so
        far (scaled by the pixel ratio); over ``target_fraction - hysteresis`` (or at or over the ceiling
        of a size that once went over), the batch size shrinks to the largest that fits.
        """
        pixels = int(pixels)
        if pixels < 1:
            raise ValueError(f"pixels={pixels}: must be >= 1")
        if self.ref_pixels is None:
            self.ref_pixels = pixels
        old_pixels, self.pixels = self.pixels, pixels
        if old_pixels == pixels or old_pixels is None:
            return self.batch_size
        old = self.batch_size
        limit = self.target_fraction - self.hysteresis
        scale = self._scale()

        def fits(b: int) -> bool:
            if self.ceiling is not None and b * scale >= self.ceiling:
                return False
            pred = self.predict(b * scale)
            return pred is None or pred <= limit

        new = old
        while new > self.min_batch and not fits(new):
            smaller = self._round(new - 1)
            if smaller >= new:
                break
            new = smaller
        if new != old:
            pred = self.predict(old * scale)
            why = f"predicted {pred:.0%} at {old}" if pred is not None else f"batch {old} over the ceiling"
            reason = f"image size {_size_change(old_pixels, pixels)}: {why} > {limit:.0%}"
            self.history.append(
                {
                    "epoch": None,
                    "batch_size": old,
                    "peak_fraction": None,
                    "decision": "shrink",
                    "reason": reason,
                    "next_batch_size": new,
                }
            )
            log.info("%s → batch %d → %d (shrink)", reason, old, new)
            self.batch_size = new
            if self.on_change is not None:
                self.on_change(old, new)
        return new

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

    def predict(self, batch: float) -> float | None:
        """Predicted peak fraction at ``batch`` (in samples of ``ref_pixels``) from the epochs seen."""
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
            at = _as_batch(old * self._scale())
            self.ceiling = at if self.ceiling is None else min(self.ceiling, at)
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
            scale = self._scale()
            self.observations.append((_as_batch(old * scale), frac))
            if frac > target:
                new, decision = self._round(old * self.shrink), "shrink"
                self.ceiling = (
                    _as_batch(old * scale) if self.ceiling is None else min(self.ceiling, _as_batch(old * scale))
                )
                reason = f"peak {frac:.0%}{cap_s} > {target:.0%}"
            else:
                grown = self._round(old * self.grow)
                pred = self.predict(grown * scale)
                if grown <= old:
                    new, decision, reason = old, "hold", f"peak {frac:.0%}{cap_s}; at max_batch {self.max_batch}"
                elif self.ceiling is not None and grown * scale >= self.ceiling:
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
        state = {
            "batch_size": self.batch_size,
            "history": list(self.history),
            "observations": list(self.observations),
            "ceiling": self.ceiling,
        }
        if self.pixels is not None:  # told by a loader: readings are counted in samples of ref_pixels
            state["pixels"], state["ref_pixels"] = self.pixels, self.ref_pixels
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_size = int(state["batch_size"])
        self.history = list(state.get("history", []))
        self.observations = [tuple(o) for o in state.get("observations", [])]
        self.ceiling = state.get("ceiling")
        if "ref_pixels" in state:
            self.pixels, self.ref_pixels = state["pixels"], state["ref_pixels"]


def _as_batch(x: float) -> float | int:
    """A batch in reference-size samples: an int when it is one (as readings at one size always are)."""
    return int(x) if float(x).is_integer() else float(x)


def _size_change(old: int, new: int) -> str:
    """'160 → 192 px' for square images (their sides), else the pixel counts: '10000 → 20000 pixels'."""
    sides = [round(p**0.5) for p in (old, new)]
    if sides[0] * sides[0] == old and sides[1] * sides[1] == new:
        return f"{sides[0]} → {sides[1]} px"
    return f"{old} → {new} pixels"


# pragma: no mutate block (rank agreement: tested with real processes and fakes)
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
