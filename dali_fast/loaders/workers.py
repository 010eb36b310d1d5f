"""`TorchIterator`'s decode workers: uint8 batches written in place into shared memory.

The main process owns a ring of batch slots in one shared-memory uint8 tensor (`SlotRing`). Each
task sent to a worker names a free slot and the batch's records; the worker decodes, crops, resizes,
augments and mirrors each image straight into that slot (`BatchMaker`) and sends back only labels,
erasing boxes and the bad records it met: no per-sample tensors, no pickled pixels, no collate copy.
The main process then makes the batch's normalized tensor in one pass (`finish_batch`; on a GPU, after
a copy from the slot, which is page-locked there; on the CPU into an output of its `OutputPool` that
nothing outside the loader still reaches) and hands the slot back. A slot goes to a worker only
when the main process holds no claim on it, checked at every hand-out.

The slot layout is CHW when the output is NCHW-contiguous (the worker's transposing copy of each image
is cheaper than the main process's transpose of a float batch) and HWC for ``channels_last`` output.
Per sample, the crop, flip, policy and erasing box are drawn from (seed, epoch, index), as in every
loader here, so the pixels do not depend on the number of workers, the batch size or a resume.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..data.base import Reader, read_batch_checked
from ..transforms.autoaugment import apply_policy
from ..transforms.decode import Decoder
from ..transforms.draws import SampleDraws, crop_draws, sample_erasing_box, sample_rng
from ..transforms.recipe import AUGMENT_SALT, Recipe
from ..transforms.resize import BadImage, decode_crop

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tame_malloc(arenas: int = 2, mmap_threshold: int = 1 << 20) -> bool:
    """Keep a long-lived decode process's heap from growing epoch after epoch (glibc only).

    Varying image sizes make glibc raise its mmap threshold after each large free, so later large
    buffers come from the heap, which then fragments, and extra arenas multiply it. A fixed threshold
    (buffers above it are mapped and returned whole) and two arenas keep the resident set flat
    (benchmarks/worker_rss.py). Returns whether the settings were applied.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_ARENA_MAX, arenas) == 1
    ok &= mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold) == 1
    return bool(ok)


def worker_init(_worker_id: int) -> None:
    """DataLoader ``worker_init_fn`` of the decode workers."""
    tame_malloc()


# ----------------------------------------------------------------------------- the slots


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
IDLE_WAIT = 0.001  # seconds a worker waits on an idle task, so that a run of them costs little CPU


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


# ----------------------------------------------------------------------------- the worker's side


class BatchMaker(Dataset):
    """Runs in the workers: a `Task` → its images written into the slot, and the part's metadata.

    Good samples are packed from the task's offset on, in plan order; bad records (unreadable, failing
    the structural check, undecodable) are listed with their reason, never raised, so the consumer
    decides (``on_error``) and names them.
    """

    def __init__(
        self, reader: Reader, train: bool, recipe: Recipe, seed: int, buffer: torch.Tensor, layout: str
    ) -> None:
        self.reader, self.train, self.recipe, self.seed = reader, train, recipe, seed
        self.buffer, self.layout = buffer, layout
        self._decoder: Decoder | None = None
        self._tmp: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.reader)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_decoder"], state["_tmp"] = None, None  # per process, made on first use
        return state

    def __getitems__(self, task: Task) -> dict[str, Any]:
        """DataLoader's batched fetch (its batch sampler yields `Task`s)."""
        return self.make(task)

    def make(self, task: Task) -> dict[str, Any]:
        if task.slot == IDLE:
            time.sleep(IDLE_WAIT)
            return {"slot": IDLE}
        if self._decoder is None:
            self._decoder = Decoder()
            S = self.recipe.image_size
            self._tmp = torch.empty((S, S, 3), dtype=torch.uint8)
        keys = task.keys
        if keys and len(keys[0]) > 2:  # read (and checked) in the main process, through its cache
            datas = [key[2] for key in keys]
            found = [key[3] for key in keys]
            reasons = {pos: key[4] for pos, key in enumerate(keys) if key[4] is not None}
        else:  # one read of the whole part: O(1) checks per packed record, files read in parallel
            datas, found, reasons = read_batch_checked(self.reader, [key[0] for key in keys])
        slot = self.buffer[task.slot].numpy()
        draws = self._draws(keys)
        at = task.offset
        labels: list[int] = []
        boxes: list[tuple[int, int, int, int]] = []
        bad: list[tuple[int, str]] = []
        for pos, key in enumerate(keys):
            index = key[0]
            reason = reasons.get(pos)
            if reason is None:
                reason, box = self._sample(datas[pos], index, key[1], slot[at], draws[pos])
            if reason is not None:
                bad.append((index, reason))
                continue
            at += 1
            labels.append(int(found[pos]))
            if box is not None:
                boxes.append(box)
        return {
            "slot": task.slot,
            "batch": task.batch,
            "offset": task.offset,
            "part": task.part,
            "parts": task.parts,
            "n": len(labels),
            "labels": np.asarray(labels, dtype=np.int64),
            "boxes": np.asarray(boxes, dtype=np.int64).reshape(-1, 4) if boxes else None,
            "consumed": len(keys),
            "bad": bad,
        }

    def _draws(self, keys: list[tuple]) -> list[list[float]]:
        """Each key's crop and flip uniforms (`crop_draws`), for the part at once."""
        if not self.train or not keys:
            return [[]] * len(keys)
        epoch = keys[0][1]
        if all(key[1] == epoch for key in keys):
            return crop_draws(self.seed, epoch, [key[0] for key in keys])
        return [crop_draws(self.seed, key[1], [key[0]])[0] for key in keys]

    def _sample(
        self, data: Any, index: int, epoch: int, out: np.ndarray, uniforms: list[float]
    ) -> tuple[str | None, tuple[int, int, int, int] | None]:
        """Decode, crop, resize, augment and mirror one record into ``out`` (its place in the slot, in the
        slot's layout), the crop and flip drawn from ``uniforms``; (why it is bad, erasing box)."""
        recipe = self.recipe
        rng = SampleDraws(uniforms)
        tmp: torch.Tensor = self._tmp  # type: ignore[assignment]
        try:
            image = decode_crop(data, train=self.train, recipe=recipe, rng=rng, decoder=self._decoder, out=tmp)
        except BadImage as e:
            return str(e), None
        flip, box = False, None
        if self.train:
            flip = bool(rng.random() < recipe.hflip)
            if recipe.auto_augment is not None:
                augmented = apply_policy(image.numpy(), recipe, sample_rng(self.seed, epoch, index, AUGMENT_SALT))
                np.copyto(tmp.numpy(), augmented)
                image = tmp
            if recipe.random_erasing > 0:
                box = sample_erasing_box(recipe, self.seed, epoch, index)
        src = image.numpy()
        src = src[:, ::-1] if flip else src
        # CHW: numpy's transposing copy is the cheaper one here, mirrored or not
        np.copyto(out, src.transpose(2, 0, 1) if self.layout == "CHW" else src)
        return None, box


def _as_is(batch: Any) -> Any:
    """DataLoader ``collate_fn``: the worker's batch is already made."""
    return batch


# ----------------------------------------------------------------------------- the main process's side


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
