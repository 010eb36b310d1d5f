"""`TorchIterator`: the same API and rules as `DALIIterator` in pure PyTorch (the fallback, and the yardstick).

Workers decode, crop, resize, augment and mirror each image into shared-memory batch slots
(`torch_worker`, `torch_slots`); the main process makes each normalized batch in one pass, on the GPU
after a page-locked copy on a side stream where there is one. Each sample's augmentation is drawn from
(seed, epoch, index), so it does not depend on the number of workers, the batch size or a resume.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from ..data.base import Reader, read_checked
from ..machine import local_device_index
from ..transforms.batch import finish_batch, one_intra_op_thread, to_device
from .bad_records import BadRecordError, bad_record_message
from .base import LoaderBase
from .dataloader import default_num_workers, make_dataloader, shutdown_workers
from .fork_guard import hold
from .torch_slots import IDLE, OutputPool, SlotRing, Task, batch_parts, image_shape, slot_layout
from .torch_watch import StuckWorkerError, watched
from .torch_worker import BatchMaker, collate_as_is, worker_init

log = logging.getLogger(__name__)


class _PlanSampler(Sampler):
    """The current pass's batches as `Task`s: each batch whole, the last ones split among the workers
    (`batch_parts`), and given a free slot of the ring when its first part is sent (DataLoader draws from
    this as it dispatches). Re-armed before each pass.

    With ``idle_when_full`` (worker processes, whose results come back in any order), a batch that finds
    every slot taken (batches done early wait in theirs for an earlier one) is preceded by `IDLE` tasks
    until one is free: DataLoader sends a task for each result it hands over, so a draw must never be
    refused, and the ring is never overbooked."""

    def __init__(self) -> None:
        self.keys: Sequence[list[tuple]] = []
        self.sizes: list[int] = []
        self.ring: SlotRing | None = None
        self.workers = 1
        self.idle_when_full = False

    def __iter__(self) -> Iterator[Task]:
        ring, batches = self.ring, len(self.keys)
        for b, keys in enumerate(self.keys):
            while self.idle_when_full and not ring.free:  # type: ignore[union-attr]
                yield Task(IDLE)
            slot = ring.take()  # type: ignore[union-attr]
            parts = batch_parts(b, batches, len(keys), self.workers)
            for k, (start, stop) in enumerate(parts):
                yield Task(slot, keys[start:stop], start, k, len(parts), b)

    def __len__(self) -> int:
        batches = len(self.sizes)
        return sum(len(batch_parts(b, batches, n, self.workers)) for b, n in enumerate(self.sizes))


class TorchIterator(LoaderBase):
    """`DALIIterator`'s API and rules in pure PyTorch: the fallback, and the yardstick.

    Worker processes decode (libjpeg-turbo for plain JPEGs, Pillow for the rest, one rule), crop and
    resize (torch's uint8 kernels: plain bilinear under a 2x shrink, Pillow's antialiased filter
    otherwise; `transforms.resize`), augment and mirror each image
    straight into a shared-memory batch slot; the main process makes the normalized batch in one pass
    (on a GPU, after a page-locked, overlapped copy). See `workers`.

    Extra arguments: ``num_workers`` (decode processes; None: one per cpu of this rank, 0 on one
    cpu). The sample order is identical to `DALIIterator` for the same (seed, epoch, rank). With
    ``cache_bytes`` the LRU cache lives in the main process (shared by all workers, exact statistics):
    it reads encoded bytes through the cache and hands them to the workers with the indices.

    Args:
        dataset: a reader (`open_dataset`).
        batch_size: samples per batch (a controller may change it between epochs).
        num_workers: decode processes; None: one per CPU of this rank, 0 (decode in this process) on one.
        **kwargs: the arguments every loader takes: ``train``, ``image_size``, ``device``, ``seed``,
            ``drop_last``, ``cache_bytes``, ``controller``, ``dtype``, ``rank``, ``world_size``,
            ``on_error``, ``prefetch``, ``memory_format``, ``recipe``, ``even``, as `DALIIterator` lists them.
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
        self._outputs = OutputPool()
        self.pools_started = 0  # batch rings (each with its worker pool) made: one per batch and image size
        # A forked child (another loader's worker) never shuts this pool down or frees its slots: `fork_guard`.
        hold(self, "_loader", "_ring", "_maker", "_stream")

    # ------------------------------------------------------------------ workers and slots
    def _slots_for(self, batch_size: int) -> SlotRing:
        """The ring, made (or made larger, with a new worker pool) for batches of ``batch_size`` at this
        epoch's image size (a resolution schedule's new size is a new ring and pool, once per change)."""
        ring = self._ring
        S = self.recipe.image_size
        if ring is not None and ring.capacity >= batch_size and ring.image_shape == image_shape(self._layout, S):
            return ring
        self.close()
        # Every task in flight holds a slot (prefetch per worker), plus the batch the main process is
        # finishing, one whose device copy may still be running, and one per worker for batches that
        # came back before an earlier one (results come back as they are made).
        slots = (self.prefetch + 1) * self.num_workers + 2 if self.num_workers else 1
        self.pools_started += 1
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
            self._loader = make_dataloader(
                self._maker,
                None,
                batch_sampler=self._plan,
                num_workers=self.num_workers,
                pin_memory=False,  # pixels never travel through the DataLoader; the slots are pinned
                prefetch_factor=self.prefetch,
                persistent_workers=True,
                collate_fn=collate_as_is,
                worker_init_fn=worker_init,
            )
            # Each result as soon as it is made, and the next task to a worker with room: a worker that
            # is ahead (the other shares its cpu with this process) is not held back by the other's
            # batch. `_whole_batches` puts the batches back in order.
            self._loader.in_order = False
        return self._loader

    def close(self) -> None:
        """Shut the decode workers down and free the batch slots and kept outputs now (a later pass starts
        new ones)."""
        self._discard_workers()
        self._outputs.clear()
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
        except StuckWorkerError as e:  # killed: the pool is broken, as for a worker that died
            log.warning("%s", e)
            self._discard_workers()
            raise RuntimeError(f"{e}; the next pass starts a new worker pool") from e
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
        self._plan.idle_when_full = self.num_workers > 0
        if self.num_workers:
            parts: Iterator[dict[str, Any]] = watched(self._dataloader())  # never waits on a dead or stuck worker
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
        """The batch's output tensor (never the slot, which is reused next: on the CPU one of the pool's when
        nothing outside holds it, else new), labels, and on a GPU the event that marks the end of the copy
        out of the slot."""
        recipe = self.recipe
        labels = self._batch_targets(b["indices"], b["labels"])
        boxes = None if b["boxes"] is None else torch.from_numpy(b["boxes"])
        if self._layout == "HWC":
            pixels = pixels.permute(0, 3, 1, 2)  # NCHW view, channels_last in memory
        event = None
        if self.gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                pixels = pixels.to(self.device, non_blocking=True)  # from page-locked memory: asynchronous
                labels = to_device(labels, self.device)  # page-locked first: the copy does not wait
                event = torch.cuda.Event()
                event.record(self._stream)
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            pixels.record_stream(current)
            labels.record_stream(current)
        mean, std = (recipe.mean_255, recipe.std_255) if recipe.normalize else (None, None)
        if self.gpu:
            images = finish_batch(pixels, self.dtype, self.memory_format, mean, std, boxes, fill=recipe.erasing_fill)
        else:
            out = self._outputs.get(tuple(pixels.shape), self.dtype, self.memory_format)
            with one_intra_op_thread():
                images = finish_batch(
                    pixels, self.dtype, self.memory_format, mean, std, boxes, out, recipe.erasing_fill
                )
            del out
        return images, labels, event

    def _handle_bad(self, bad: list[tuple[int, str]]) -> None:
        for index, reason in bad:
            if self.on_error == "raise":
                raise BadRecordError(bad_record_message(self.dataset, index, reason))
            self._skips.add(index, self.dataset.source(index), reason)


def _whole_batches(parts: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Join the parts of each batch (they arrive in any order; idle tasks' are dropped) into one batch's
    metadata, the batches in the pass's order; ``ranges`` holds each part's (offset, images) in the slot."""
    pending: dict[int, dict[int, dict[str, Any]]] = {}  # batch -> part -> the part's metadata
    at = 0  # the next batch to yield

    def part_count(got: dict[int, dict[str, Any]]) -> int:
        return next(iter(got.values()))["parts"]

    for part in parts:
        if part["slot"] == IDLE:
            continue
        pending.setdefault(part["batch"], {})[part["part"]] = part
        while at in pending and len(pending[at]) == part_count(pending[at]):
            got = pending.pop(at)
            at += 1
            done = [got[k] for k in range(len(got))]
            boxes = [p["boxes"] for p in done if p["boxes"] is not None]
            yield {
                "slot": done[0]["slot"],
                "n": sum(p["n"] for p in done),
                "ranges": [(p["offset"], p["n"]) for p in done],
                "labels": np.concatenate([p["labels"] for p in done]),
                "indices": np.concatenate([p["indices"] for p in done]),
                "boxes": np.concatenate(boxes) if boxes else None,
                "consumed": sum(p["consumed"] for p in done),
                "bad": [bad for p in done for bad in p["bad"]],
            }


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
