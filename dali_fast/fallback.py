"""`TorchIterator`: the same API and rules as `DALIIterator` in pure PyTorch, and the backend choice.

Workers decode, crop, resize, augment and mirror each image into shared-memory batch slots
(`dali_fast.workers`); the main process makes each normalized batch in one pass, on the GPU after
a page-locked copy on a side stream where there is one. Each sample's augmentation is drawn from
(seed, epoch, index), so it does not depend on the number of workers, the batch size or a resume.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .data.base import Reader, read_checked
from .iterator import LoaderBase, cuda_usable, local_device_index
from .pipeline import BadRecordError, bad_record_message
from .system import cpus_per_local_rank
from .transforms.batch import finish_batch, normalize_flip, one_intra_op_thread
from .transforms.resize import PIL_RESAMPLE, decode_crop, random_resized_crop_box
from .workers import (
    BatchMaker,
    SlotRing,
    Task,
    _as_is,
    image_shape,
    slot_layout,
    split,
    worker_init,
)

__all__ = [
    "PIL_RESAMPLE",
    "TorchIterator",
    "create_optimized_dataloader",
    "dali_status",
    "decode_crop",
    "default_num_workers",
    "make_loader",
    "normalize_flip",
    "random_resized_crop_box",
    "shutdown_workers",
]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- DataLoader factory


def default_num_workers() -> int:
    """One decode process per cpu of this rank's share, up to 8; none (decode in this process) on one cpu.

    The main process's share of the work is small (a batch's conversion, or on a GPU a copy), so a
    worker per cpu keeps every core decoding: on 2 cpus, 2 workers made 1.6x the images of 1 (side by side)."""
    cpus = cpus_per_local_rank()
    return 0 if cpus < 2 else min(8, cpus)


def create_optimized_dataloader(
    dataset: Dataset,
    batch_size: int | None,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = 2,
    persistent_workers: bool | None = None,
    sampler: Sampler | None = None,
    batch_sampler: Sampler | None = None,
    shuffle: bool = False,
    drop_last: bool = False,
    collate_fn: Callable | None = None,
    worker_init_fn: Callable | None = None,
) -> DataLoader:
    """A `DataLoader` with sensible defaults, and clear errors for bad combinations.

    ``num_workers=None`` picks `default_num_workers` (a worker per cpu, up to 8); ``pin_memory`` defaults
    to CUDA being usable; ``persistent_workers`` defaults to ``num_workers > 0``.
    """
    if num_workers is None:
        num_workers = default_num_workers()
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: must be >= 0 (0 loads in the main process)")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1 (or None with a batch_sampler)")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(f"prefetch_factor={prefetch_factor}: must be >= 1")
    if num_workers == 0 and prefetch_factor not in (None, 2):
        raise ValueError(
            f"prefetch_factor={prefetch_factor} needs worker processes; set num_workers > 0 or prefetch_factor=None"
        )
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers > 0")
    if batch_sampler is not None and (sampler is not None or shuffle or drop_last or batch_size not in (None, 1)):
        raise ValueError("batch_sampler excludes batch_size, shuffle, sampler and drop_last; pass batch_size=None")
    if sampler is not None and shuffle:
        raise ValueError("sampler and shuffle=True exclude each other; the sampler decides the order")
    if pin_memory is None:
        pin_memory = cuda_usable()
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    kw: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "collate_fn": collate_fn,
        "worker_init_fn": worker_init_fn,
    }
    if num_workers > 0:
        kw["prefetch_factor"] = prefetch_factor
        kw["persistent_workers"] = persistent_workers
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **kw)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=shuffle, drop_last=drop_last, **kw)


def shutdown_workers(loader: DataLoader | None) -> None:
    """Shut a DataLoader's persistent worker pool down now. Left to the garbage collector, a pool whose
    pass ended in an error was seen to wait 5 s per worker for them to exit."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()  # noqa: SLF001 - DataLoader's own clean-up of a persistent pool
        loader._iterator = None  # noqa: SLF001


# ----------------------------------------------------------------------------- batches


class _PlanSampler(Sampler):
    """The current pass's batches as `Task`s: each batch split among the workers (`split`), and given a
    free slot of the ring when its first part is sent (DataLoader draws from this as it dispatches).
    Splitting keeps every worker on the batch the main process waits for, and lets the last batch of an
    epoch end as soon as possible. Re-armed before each pass."""

    def __init__(self) -> None:
        self.keys: Sequence[list[tuple]] = []
        self.sizes: list[int] = []
        self.ring: SlotRing | None = None
        self.workers = 1

    def __iter__(self) -> Iterator[Task]:
        ring = self.ring
        for keys in self.keys:
            slot = ring.take()  # type: ignore[union-attr]
            parts = split(len(keys), self.workers)
            for k, (start, stop) in enumerate(parts):
                yield Task(slot, keys[start:stop], start, k, len(parts))

    def __len__(self) -> int:
        return sum(len(split(n, self.workers)) for n in self.sizes)


class TorchIterator(LoaderBase):
    """`DALIIterator`'s API and rules in pure PyTorch: the fallback, and the yardstick.

    Worker processes decode (libjpeg-turbo for plain JPEGs, Pillow for the rest, one rule), crop and
    resize (Pillow's filter through torch's antialiased uint8 kernels), augment and mirror each image
    straight into a shared-memory batch slot; the main process makes the normalized batch in one pass
    (on a GPU, after a page-locked, overlapped copy). See `dali_fast.workers`.

    Extra arguments: ``num_workers`` (decode processes; None: one per cpu of this rank, 0 on one
    cpu). The sample order is identical to `DALIIterator` for the same (seed, epoch, rank). With
    ``cache_bytes`` the LRU cache lives in the main process (shared by all workers, exact statistics):
    it reads encoded bytes through the cache and hands them to the workers with the indices.
    """

    backend = "torch"

    def __init__(self, dataset: Reader, batch_size: int, *, num_workers: int | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size, **kwargs)
        self.num_workers = default_num_workers() if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers={num_workers}: must be >= 0")
        self.device = torch.device("cuda", local_device_index()) if self.gpu else torch.device("cpu")
        self._plan = _PlanSampler()
        self._layout = slot_layout(self.memory_format)
        self._ring: SlotRing | None = None
        self._maker: BatchMaker | None = None
        self._loader: DataLoader | None = None
        self._stream: Any = None

    # ------------------------------------------------------------------ workers and slots
    def _slots_for(self, batch_size: int) -> SlotRing:
        """The ring, made (or made larger, with a new worker pool) for batches of ``batch_size``."""
        ring = self._ring
        if ring is not None and ring.capacity >= batch_size:
            return ring
        self.close()
        # Every task in flight holds a slot (prefetch per worker), plus the batch the main process is
        # finishing and one whose device copy may still be running.
        slots = self.prefetch * self.num_workers + 2 if self.num_workers else 1
        S = self.recipe.image_size
        ring = SlotRing(slots, batch_size, image_shape(self._layout, S), shared=self.num_workers > 0)
        if self.gpu:
            ring.pin()
        # With a cache, the keys carry the bytes (read through it in this process); workers never
        # touch the cache, so it needs no copy per worker and is never pickled.
        self._maker = BatchMaker(self.dataset, self.train, self.recipe, self.seed, ring.buffer, self._layout)
        self._ring = ring
        return ring

    def _dataloader(self) -> DataLoader:
        if self._loader is None:
            self._loader = create_optimized_dataloader(
                self._maker,
                None,
                batch_sampler=self._plan,
                num_workers=self.num_workers,
                pin_memory=False,  # pixels never travel through the DataLoader; the slots are pinned
                prefetch_factor=self.prefetch,
                persistent_workers=True,
                collate_fn=_as_is,
                worker_init_fn=worker_init,
            )
        return self._loader

    def close(self) -> None:
        """Shut the decode workers down and free the batch slots now (a later pass starts new ones)."""
        self._discard_workers()
        ring, self._ring, self._maker = self._ring, None, None
        if ring is not None:
            ring.close()

    def _discard_workers(self) -> None:
        """Shut the worker pool down; the next pass starts a new one."""
        loader, self._loader = self._loader, None
        shutdown_workers(loader)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ a pass
    def _keys(self, plan: Sequence[np.ndarray]) -> Sequence[list[tuple]]:
        epoch = self.order.epoch
        if self.cache is None:
            return [[(int(i), epoch) for i in batch] for batch in plan]
        # Shared cache: the main process reads the bytes (lazily, one batch at a time).
        return _LazyCachedKeys(self.dataset, plan, epoch)  # type: ignore[return-value]

    def _run(self, plan: list[np.ndarray], start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        if not plan:
            return
        try:
            yield from self._run_workers(plan)
        except (RuntimeError, ConnectionError, EOFError) as e:
            # A worker killed (OOM killer, SIGKILL) surfaces as DataLoader's RuntimeError, or first as a
            # broken pipe to it: either way the persistent pool is broken for good. An error a worker
            # raised (and survived) is DataLoader's re-raise of it, with the worker's traceback: it goes
            # up as it is, and the pool serves the next pass.
            if isinstance(e, RuntimeError) and "DataLoader worker (pid" not in str(e):
                raise
            why = str(e).split("\n")[0] or type(e).__name__
            log.warning("a decode worker died (%s); a new worker pool starts with the next pass", why)
            self._discard_workers()
            raise RuntimeError(
                f"a DataLoader worker died during this pass ({why}); the next pass starts a new one"
            ) from e

    def _run_workers(self, plan: list[np.ndarray]) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        ring = self._slots_for(max(len(b) for b in plan))
        ring.reset()  # DataLoader drains an earlier pass's tasks before it sends this one's
        self._plan.keys, self._plan.ring = self._keys(plan), ring
        self._plan.sizes, self._plan.workers = [len(b) for b in plan], max(1, self.num_workers)
        if self.num_workers:
            parts: Iterator[dict[str, Any]] = iter(self._dataloader())
        else:
            maker = self._maker
            parts = (maker.make(task) for task in self._plan)  # type: ignore[union-attr]
        carry = 0  # planned samples of batches that were all bad, accounted with the next batch
        for b in _whole_batches(parts):
            event = None
            try:
                self._handle_bad(b["bad"])
                if b["n"] == 0:
                    carry += b["consumed"]
                    continue
                images, labels, event = self._finish(_pixels(ring, b), b)
            finally:
                ring.give_back(b["slot"], event)
            consumed, carry = b["consumed"] + carry, 0
            yield images, labels, consumed

    def _finish(self, pixels: torch.Tensor, b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The batch's output tensor (a new one: the slot is reused next), labels, and on a GPU the event
        that marks the end of the copy out of the slot."""
        recipe = self.recipe
        labels = torch.from_numpy(b["labels"])
        boxes = None if b["boxes"] is None else torch.from_numpy(b["boxes"])
        if self._layout == "HWC":
            pixels = pixels.permute(0, 3, 1, 2)  # NCHW view, channels_last in memory
        event = None
        if self.gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                pixels = pixels.to(self.device, non_blocking=True)  # from page-locked memory: asynchronous
                labels = labels.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            pixels.record_stream(current)
            labels.record_stream(current)
        mean, std = (recipe.mean_255, recipe.std_255) if recipe.normalize else (None, None)
        if self.gpu:
            images = finish_batch(pixels, self.dtype, self.memory_format, mean, std, boxes)
        else:
            with one_intra_op_thread():
                images = finish_batch(pixels, self.dtype, self.memory_format, mean, std, boxes)
        return images, labels, event

    def _handle_bad(self, bad: list[tuple[int, str]]) -> None:
        for index, reason in bad:
            if self.on_error == "raise":
                raise BadRecordError(bad_record_message(self.dataset, index, reason))
            self._skips.add(index, self.dataset.source(index), reason)


def _whole_batches(parts: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Join the parts of each batch (they arrive in order) into one batch's metadata; ``ranges`` holds
    each part's (offset, images) in the slot."""
    pending: list[dict[str, Any]] = []
    for part in parts:
        pending.append(part)
        if part["part"] + 1 < part["parts"]:
            continue
        boxes = [p["boxes"] for p in pending if p["boxes"] is not None]
        yield {
            "slot": part["slot"],
            "n": sum(p["n"] for p in pending),
            "ranges": [(p["offset"], p["n"]) for p in pending],
            "labels": np.concatenate([p["labels"] for p in pending]),
            "boxes": np.concatenate(boxes) if boxes else None,
            "consumed": sum(p["consumed"] for p in pending),
            "bad": [bad for p in pending for bad in p["bad"]],
        }
        pending = []


def _pixels(ring: SlotRing, b: dict[str, Any]) -> torch.Tensor:
    """The batch's images in its slot: a view when its parts lie end to end (no bad record among them),
    else the good images gathered into one tensor."""
    at = 0
    for offset, n in b["ranges"]:
        if offset != at:
            return torch.cat([ring.buffer[b["slot"], o : o + k] for o, k in b["ranges"] if k])
        at += n
    return ring.view(b["slot"], b["n"])


class _LazyCachedKeys:
    """Batches of keys carrying encoded bytes read through the main process's cache, made on demand."""

    def __init__(self, reader: Reader, plan: Sequence[np.ndarray], epoch: int) -> None:
        self.reader, self.plan, self.epoch = reader, plan, epoch

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[tuple]]:
        for batch in self.plan:
            keys = []
            for i in batch.tolist():
                data, label, reason = read_checked(self.reader, i)
                keys.append((i, self.epoch, None if data is None else np.asarray(data), label, reason))
            yield keys


# ----------------------------------------------------------------------------- backend choice


def dali_status() -> tuple[bool, str]:
    """(usable, why): whether NVIDIA DALI imports and can build a pipeline here."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "use the fallback"
        return False, f"nvidia.dali does not import ({type(e).__name__}: {e})"
    return True, "nvidia.dali imports"


_said: set[str] = set()


def _say_once(level: int, message: str) -> None:
    """Log the backend choice once per process (train makes a training and an evaluation loader)."""
    if message not in _said:
        _said.add(message)
        log.log(level, message)


def make_loader(dataset: Reader, batch_size: int, *, backend: str = "auto", **kw: Any) -> LoaderBase:
    """`DALIIterator` when DALI works here (``backend='auto'``), else `TorchIterator`; logs which and why."""
    if backend not in ("auto", "dali", "torch"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'dali' or 'torch'")
    if backend in ("auto", "dali"):
        ok, why = dali_status()
        if ok:
            from .iterator import DALIIterator

            kw.pop("num_workers", None)
            _say_once(logging.INFO, f"loader: DALI ({why})")
            return DALIIterator(dataset, batch_size, **kw)
        if backend == "dali":
            raise ImportError(f"backend='dali' but {why}; pip install nvidia-dali-cuda120 or use backend='auto'")
        _say_once(logging.WARNING, f"loader: falling back to TorchIterator: {why}")
    else:
        _say_once(logging.INFO, "loader: TorchIterator (asked for backend='torch')")
    return TorchIterator(dataset, batch_size, **kw)
