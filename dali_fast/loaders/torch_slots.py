"""`TorchIterator`'s main-process side of the process boundary: the ring of shared-memory batch slots
the workers write into (`SlotRing`), the tasks that name them (`Task`, `batch_parts`), and the pool of
batch outputs the main process hands to the consumer (`OutputPool`). The workers' side is `torch_worker`.

The main process owns a ring of batch slots in one shared-memory uint8 tensor. Each task sent to a
worker names a free slot and the batch's records; the main process then makes the batch's normalized
tensor in one pass (`finish_batch`; on a GPU, after a copy from the slot, which is page-locked there; on
the CPU into an output of its `OutputPool` that nothing outside the loader still reaches) and hands the
slot back. A slot goes to a worker only when the main process holds no claim on it, checked at every
hand-out.

The slot layout is CHW when the output is NCHW-contiguous (the worker's transposing copy of each image
is cheaper than the main process's transpose of a float batch) and HWC for ``channels_last`` output.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


class SlotRing:
    """``slots`` batch buffers of ``capacity`` images of ``image_shape`` uint8, in one tensor that worker
    processes share (shared memory; with ``pin``, page-locked for fast, asynchronous GPU copies).

    `take` hands out a free slot (waiting first for a GPU copy still reading it); `give_back` returns it,
    optionally with the event that marks the end of such a copy. Taking from an empty ring is a bug in
    the caller's accounting and raises, rather than letting a worker overwrite a batch in use.
    """

    def __init__(self, slots: int, capacity: int, image_shape: tuple[int, ...], *, shared: bool = True) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError(f"a ring needs at least one slot of one image (slots={slots}, capacity={capacity})")
        self.capacity = int(capacity)
        self.image_shape = tuple(image_shape)
        self.buffer = torch.empty((slots, capacity, *image_shape), dtype=torch.uint8)
        if shared:
            self.buffer.share_memory_()
        self.free: deque[int] = deque(range(slots))
        self.events: dict[int, Any] = {}
        self._pinned = False

    @property
    def slots(self) -> int:
        return int(self.buffer.shape[0])

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(
                f"no free batch slot (all {self.slots} are in flight or held): more batches were asked for "
                "than the ring was sized for"
            )
        slot = self.free.popleft()
        event = self.events.pop(slot, None)
        if event is not None:
            event.synchronize()  # a device copy still reads this slot
        return slot

    def give_back(self, slot: int, event: Any = None) -> None:
        if slot in self.free:
            raise RuntimeError(f"batch slot {slot} given back twice")
        if event is not None:
            self.events[slot] = event
        self.free.append(slot)

    def reset(self) -> None:
        """Every slot free (a new pass: no task of an earlier one is in flight any more)."""
        self.free = deque(range(self.slots))  # a copy still reading one is waited for when it is taken

    def view(self, slot: int, n: int) -> torch.Tensor:
        """The first ``n`` images of ``slot``."""
        return self.buffer[slot, :n]

    def pin(self) -> bool:
        """Page-lock the slots for the GPU copies (cudaHostRegister); False where that is refused."""
        if self._pinned:
            return True
        buf = self.buffer
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
        except (RuntimeError, AttributeError, TypeError) as e:
            err, why = -1, str(e)
        else:
            why = f"CUDA error {err}"
        if err != 0:
            log.warning("could not page-lock the batch slots (%s); copies to the GPU wait for the host", why)
            return False
        self._pinned = True
        return True

    def close(self) -> None:
        """Wait for copies in flight, unpin, and free the slots."""
        for event in self.events.values():
            event.synchronize()
        self.events.clear()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.free.clear()


@dataclass
class Task:
    """A part of one batch for a worker: the slot to write from ``offset`` on, and the records' keys
    ((index, epoch) or, with the main process's cache, (index, epoch, bytes, label, reason)). A batch is
    one task, or ``parts`` tasks (``part`` = 0, 1, ...) when it is split among the workers (`batch_parts`).
    ``batch`` is the batch's place in the pass (parts come back in any order). A task with slot `IDLE` has
    nothing to do: it is sent only while every slot is taken, and comes back a moment later."""

    slot: int
    keys: list[tuple] = field(default_factory=list)
    offset: int = 0
    part: int = 0
    parts: int = 1
    batch: int = 0


IDLE = -1  # the slot of a task with nothing to do


MIN_PART = 4  # images: a batch is split among the workers in parts of at least this many


def split(size: int, workers: int) -> list[tuple[int, int]]:
    """(start, stop) of the parts of a batch of ``size`` for ``workers`` workers: as equal as can be,
    one per worker, none under `MIN_PART` images (a batch under 2 x MIN_PART stays whole)."""
    parts = max(1, min(workers, size // MIN_PART))
    edges = [size * k // parts for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def batch_parts(b: int, batches: int, size: int, workers: int) -> list[tuple[int, int]]:
    """(start, stop) of the parts of batch ``b`` (of ``size`` images) of a pass of ``batches``: the whole
    batch, one task, except for the pass's last batches, which are `split` among the workers so that the
    pass ends with each of them busy. Each task costs its worker about a millisecond of messages and
    wake-ups, once per batch this way instead of once per part (measured: 11 % more images per second on
    2,000-image epochs with 2 workers, on 2 cpus).

    DataLoader deals tasks to its workers in turn (skipping one without room), so the whole batches before
    the split ones are a multiple of ``workers`` (the last ``workers`` to ``2 x workers - 1`` batches are
    split): workers of equal speed get as many whole batches and a part of each split one, the same
    number of images. (With one whole batch more for some workers, they ended their pass a batch later
    while the others waited.)"""
    first_split = max(0, batches - workers)
    first_split -= first_split % workers
    return split(size, workers) if b >= first_split else [(0, size)]


def slot_layout(memory_format: torch.memory_format) -> str:
    """'HWC' for channels_last output (the NCHW view of NHWC is what it wants), else 'CHW'."""
    return "HWC" if memory_format == torch.channels_last else "CHW"


def image_shape(layout: str, size: int) -> tuple[int, int, int]:
    return (size, size, 3) if layout == "HWC" else (3, size, size)


@dataclass
class _Output:
    """A pooled output tensor, its storage's Python object (held, so that a user's handle on the storage
    shows in its reference count), and the reference counts it has when nothing outside the pool holds it."""

    tensor: torch.Tensor
    storage: Any
    spec: tuple
    idle: tuple[int, ...] = ()


def _holds(o: _Output) -> tuple[int, ...]:
    """Every count through which something can reach ``o``'s memory: Python references to the tensor and
    to its storage object, C++ references to the tensor (a DLPack export) and to the storage (views,
    numpy arrays, tensors made from it)."""
    return (
        sys.getrefcount(o.tensor),
        sys.getrefcount(o.storage),
        o.tensor._use_count(),  # noqa: SLF001 - no public API counts these
        torch._C._storage_Use_Count(o.storage._cdata),  # noqa: SLF001
    )


class OutputPool:
    """The main process's batch outputs on the CPU, reused once nothing outside the pool holds them.

    A new batch tensor every step costs the main process a page fault per 4 KiB of it, each time (for a
    float batch of 32 at 224 px, 19 MiB: about 4,700 faults, most of its time per batch). The pool keeps
    the last ``keep`` outputs and hands one out again only when no reference to it, to a view of it, to
    its storage or to an array over it is left anywhere (`_holds`), it still is the tensor it was (shape,
    strides, memory, no gradient, no attributes) and the inference mode is the same: a batch the
    consumer still holds is never overwritten. A consumer that keeps every batch only makes the pool
    allocate, as without it. Where torch lacks the counts, every output is new.
    """

    COUNTED = hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")  # noqa: SLF001

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._outputs: list[_Output] = []
        self.reused = 0  # outputs handed out again (for tests and benchmarks)

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, memory_format: torch.memory_format) -> torch.Tensor:
        """A tensor of ``shape``, ``dtype`` and ``memory_format`` (contents undefined) that nothing else holds."""
        spec = (tuple(shape), dtype, memory_format, torch.is_inference_mode_enabled())
        for k, o in enumerate(self._outputs):
            if o.spec == spec and self._free(o):
                self._outputs.append(self._outputs.pop(k))  # the most recently used last
                self.reused += 1
                return o.tensor
        tensor = torch.empty(shape, dtype=dtype, memory_format=memory_format)
        if not self.COUNTED or self.keep < 1:
            return tensor
        o = _Output(tensor, tensor.untyped_storage(), spec)
        del tensor
        o.idle = _holds(o)
        if len(self._outputs) >= self.keep:
            self._outputs.pop(0)  # the least recently used: the consumer's, if it still holds it
        self._outputs.append(o)
        return o.tensor

    def _free(self, o: _Output) -> bool:
        t = o.tensor
        same = (
            not t.requires_grad
            and t.grad is None
            and not t.__dict__
            and t.untyped_storage() is o.storage
            and t.data_ptr() == o.storage.data_ptr()
            and (tuple(t.shape), t.dtype) == o.spec[:2]
            and t.is_contiguous(memory_format=o.spec[2])
        )
        del t
        return same and _holds(o) == o.idle

    def clear(self) -> None:
        self._outputs.clear()
