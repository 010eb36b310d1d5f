"""`DALIIterator`: the DALI pipeline behind a DataLoader-shaped PyTorch iterator.

`LoaderBase` holds what both iterators share (the epoch cursor, resume, sharding, batch size
and the controller hooks); a backend only turns a planned list of index batches into tensors.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from .data.base import Reader
from .data.cache import CachedReader, LRUCache
from .pipeline import BadRecordError, SkipLog
from .sampler import EpochSampler, dist_rank_world
from .shard_order import StreamingOrder, make_order
from .transforms.draws import erasing_boxes
from .transforms.recipe import Recipe, resolve_recipe

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
ON_ERROR = ("raise", "skip")


# pragma: no mutate start (device lookup)
def cuda_usable() -> bool:
    """True when torch sees a CUDA device it can use."""
    try:
        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:  # noqa: BLE001 - a broken driver means "no GPU" here
        return False


def local_device_index() -> int:
    """The CUDA device of this process: ``LOCAL_RANK`` under a launcher, else the current device.

    Launchers that give each process its own GPU through ``CUDA_VISIBLE_DEVICES`` (SLURM's
    ``--gpus-per-task=1``, for one) leave fewer visible devices than local ranks: device
    ``LOCAL_RANK`` does not exist there, so the index is ``LOCAL_RANK % device_count()``, and the
    log says so once.
    """
    import os

    if "LOCAL_RANK" not in os.environ:
        return torch.cuda.current_device() if cuda_usable() else 0
    local = int(os.environ["LOCAL_RANK"])
    count = torch.cuda.device_count() if cuda_usable() else 0
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)), local + 1)
    if count == 0 or count >= ranks:
        return local
    index = local % count
    _say_device_once(local, ranks, count, index)
    return index


_SAID: set[tuple[int, int, int]] = set()


def _say_device_once(local: int, ranks: int, count: int, index: int) -> None:
    if (local, ranks, count) in _SAID:
        return
    _SAID.add((local, ranks, count))
    shared = count > 1  # one visible device per process is the launcher's binding; several: ranks share them
    (log.warning if shared else log.info)(
        "LOCAL_RANK=%d of %d local ranks sees %d CUDA device(s) (the launcher set CUDA_VISIBLE_DEVICES per "
        "process): using CUDA device %d (LOCAL_RANK %% %d)%s",
        local,
        ranks,
        count,
        index,
        count,
        "; several ranks share a GPU" if shared else "",
    )


# pragma: no mutate end


_ABANDONED = (
    "this pass over the loader was abandoned when another started (iter(), set_epoch() or load_state_dict()); "
    "iterate one pass at a time"
)


class LoaderBase:
    """Epoch bookkeeping shared by `DALIIterator` and `TorchIterator`.

    ``recipe`` (a `dali_fast.Recipe`) is the per-image transform; ``image_size``, ``dtype`` and
    ``memory_format`` adjust the default recipe and must agree with a given one.

    The position is the number of this rank's samples already *yielded* in the current epoch
    (not the number handed to a prefetching backend), so ``state_dict()`` taken inside the loop
    resumes at exactly the next sample. ``last_indices`` holds the data set indices the last
    yielded batch accounts for (skipped undecodable records included), for audits and debugging.
    """

    backend = "base"

    def __init__(
        self,
        dataset: Reader,
        batch_size: int,
        *,
        train: bool = True,
        image_size: int | None = None,
        device: str = "auto",
        seed: int = 0,
        drop_last: bool = False,
        cache_bytes: int = 0,
        controller: Any = None,
        num_threads: int | None = None,
        dtype: torch.dtype | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        on_error: str = "raise",
        prefetch: int = 2,
        memory_format: torch.memory_format | None = None,
        recipe: Recipe | None = None,
    ) -> None:
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        # image_size, dtype and memory_format are the recipe's; as arguments they adjust the default one.
        self.recipe = resolve_recipe(recipe, image_size=image_size, dtype=dtype, memory_format=memory_format)
        if device not in ("auto", "cpu", "cuda", "gpu"):
            raise ValueError(f"device={device!r}: use 'auto' (GPU when CUDA is usable), 'cuda' or 'cpu'")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes={cache_bytes}: must be >= 0 (0 disables the cache)")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads={num_threads}: must be >= 1")
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch}: must be >= 1")
        if len(dataset) == 0:
            raise ValueError("the data set is empty; nothing to load")
        if device in ("cuda", "gpu") and not cuda_usable():
            raise ValueError(f"device={device!r} but CUDA is not usable here; use device='auto' or 'cpu'")
        self.gpu = device in ("cuda", "gpu") or (device == "auto" and cuda_usable())
        self._rank_arg, self._world_arg = rank, world_size
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        self.cache: LRUCache | None = LRUCache(cache_bytes) if cache_bytes else None
        self.dataset: Reader = CachedReader(dataset, self.cache) if self.cache is not None else dataset
        self.train = bool(train)
        self.image_size = self.recipe.image_size
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_threads = num_threads
        self.dtype = self.recipe.out_dtype
        self.on_error = on_error
        self.prefetch = int(prefetch)
        self.memory_format = self.recipe.memory_format
        self._data = dataset
        # A reader that streams shards (remote data) is told each pass's order, to download ahead.
        self._streaming: Any = dataset if getattr(dataset, "streaming", False) else None
        self.order: EpochSampler | StreamingOrder = self._new_order(self.rank, self.world_size)
        self.controller = controller
        self._batch_size = int(batch_size)
        if controller is not None:
            controller.attach(int(batch_size))
        self._epoch_bs: int | None = None  # batch size of the epoch in progress
        self._finished = False  # the current epoch was consumed to the end
        self._skips = SkipLog()
        self._ctrl_epoch: int | None = None  # the epoch the controller is measuring
        self.last_indices: np.ndarray = np.empty(0, dtype=np.int64)
        self._resumed = False  # load_state_dict() was called since the last iter()
        self._active: weakref.ref | None = None  # the pass in progress, if any
        self._current_pass: object | None = None  # the token of the pass allowed to deliver batches

    # ------------------------------------------------------------------ public surface
    batch_sampler = None  # batches are cut inside the loader (DataLoader's attribute, for frameworks that read it)

    @property
    def sampler(self) -> LoaderSampler:
        """This rank's order for the current epoch, as a `torch.utils.data.Sampler`.

        Frameworks call ``loader.sampler.set_epoch(epoch)`` (Lightning does, each epoch): that goes
        through ``loader.set_epoch``, so it keeps a resumed position and is refused during a pass.
        """
        return LoaderSampler(self)

    @property
    def batch_size(self) -> int:
        """The batch size of the epoch in progress, else of the next epoch."""
        if self._epoch_bs is not None:
            return self._epoch_bs
        return int(self.controller.batch_size) if self.controller is not None else self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if self._current_pass is not None and self._pass_running():
            raise ValueError("the batch size can change only between epochs; set it before iterating")
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"batch_size={value!r}: must be a positive integer")
        if self.controller is not None:
            self.controller.attach(int(value))
        self._batch_size = int(value)

    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def skipped(self) -> int:
        """Records skipped as undecodable (``on_error='skip'``), over the iterator's life."""
        return self._skips.count

    def _new_order(self, rank: int, world_size: int) -> EpochSampler | StreamingOrder:
        """The epoch order: shards streamed for a streaming reader, else random access (`shard_order.make_order`)."""
        return make_order(
            self._data, seed=self.seed, shuffle=self.train, rank=rank, world_size=world_size, drop_last=self.drop_last
        )

    def cache_stats(self) -> dict[str, float] | None:
        return self.cache.stats() if self.cache is not None else None

    def _follow_process_group(self) -> None:
        """Take rank and world size from a process group started after this loader was made (Lightning
        and Accelerate start it after the user built the loader); explicit rank/world_size stay."""
        rank, world = dist_rank_world(self._rank_arg, self._world_arg)
        if (rank, world) == (self.rank, self.world_size):
            return
        if self.order.position not in (0, len(self.order)) or self._pass_running():
            raise RuntimeError(
                f"the process group says rank {rank} of {world}, but this loader is mid-epoch as rank "
                f"{self.rank} of {self.world_size}; make the loader after the process group starts"
            )
        epoch = self.order.epoch
        self.rank, self.world_size = rank, world
        self.order = self._new_order(rank, world)
        self.order.set_epoch(epoch)
        log.info("loader: now rank %d of %d (the process group started after the loader was made)", rank, world)

    def __len__(self) -> int:
        """Batches in this epoch on this rank, at this epoch's batch size."""
        self._follow_process_group()
        n, bs = len(self.order), self.batch_size
        return n // bs if self.drop_last else math.ceil(n / bs)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order. Calling it with the epoch a resumed state is in keeps the position."""
        self._supersede_pass("set_epoch()")
        epoch = int(epoch)
        if epoch != self.order.epoch or self._finished:
            self.order.set_epoch(epoch)
            self._finished = False
            self._resumed = False

    def _pass_running(self) -> bool:
        """A pass has started (its first batch was asked for) and has not ended or been closed."""
        gen = self._active() if self._active is not None else None
        return gen is not None and inspect.getgeneratorstate(gen) in (inspect.GEN_SUSPENDED, inspect.GEN_RUNNING)

    def _supersede_pass(self, what: str) -> None:
        """Start over from ``what`` (a new iter(), set_epoch, load_state_dict) while an earlier pass is
        suspended: that pass is abandoned, as a DataLoader abandons its old iterator, and raises a
        one-line error if it is asked for another batch, so no batch is ever delivered by two passes."""
        if self._pass_running():  # started: abandon it (a pass not started yet plans when it starts)
            log.debug("%s abandons the pass in progress", what)
            self._current_pass = None
            self._epoch_bs = None

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: epoch, samples yielded so far, and what must match to resume."""
        sd: dict[str, Any] = {
            "sampler": self.order.state_dict(),
            "finished": self._finished,
            "batch_size": self._batch_size,
            "backend": self.backend,
        }
        if self.controller is not None:
            sd["controller"] = self.controller.state_dict()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next batch starts at exactly the sample after the last one yielded."""
        self._supersede_pass("load_state_dict()")
        if (
            not isinstance(state, dict)
            or not isinstance(state.get("sampler"), dict)
            or not {
                "epoch",
                "position",
            }
            <= set(state["sampler"])
        ):
            raise ValueError(
                "not a loader state_dict (no 'sampler' epoch and position); pass loader.state_dict() as saved"
            )
        saved_kind, kind = state["sampler"].get("order", "random"), getattr(self.order, "kind", "random")
        if saved_kind != kind:
            raise ValueError(
                f"cannot resume: the state was saved with the {saved_kind} order, this data set uses the {kind} "
                "order; resume with the data set it was saved with"
            )
        self.order.load_state_dict(state["sampler"])
        self._finished = bool(state.get("finished", False))
        self._batch_size = int(state.get("batch_size", self._batch_size))
        if self.controller is not None and "controller" in state:
            self.controller.load_state_dict(state["controller"])
        self._resumed = True  # the next iter() continues from here instead of restarting the epoch

    def __iter__(self) -> Iterator[Batch]:
        """A pass over the rest of the epoch: the whole current epoch, as a DataLoader does, unless
        ``load_state_dict()`` was called since the last ``iter()`` (then from the saved position).

        The pass decides what it covers when its first batch is asked for, so ``set_epoch`` between
        ``iter()`` and the first ``next()`` (as Lightning calls them) still applies.
        """
        self._supersede_pass("iter()")
        token = object()
        gen = self._epoch(token)
        self._current_pass = token
        self._active = weakref.ref(gen)
        return gen

    def _plan_pass(self) -> tuple[list[np.ndarray], int, int]:
        """(index batches, batch size, start position) of the pass that starts now."""
        self._follow_process_group()
        if self._finished:
            # Looping again without set_epoch: move on to the next epoch's order.
            self.order.set_epoch(self.order.epoch + 1)
            self._finished = False
        elif not self._resumed:
            self.order.position = 0  # e.g. after a peek with next(iter(loader)) or a break
        self._resumed = False
        bs = self.batch_size
        start = self.order.position
        shard = self.order.indices()
        stop = len(shard)
        if self.drop_last:
            stop = start + (len(shard) - start) // bs * bs
        return [shard[i : min(i + bs, stop)] for i in range(start, stop, bs)], bs, start

    # ------------------------------------------------------------------ epoch driver
    def _epoch(self, token: object) -> Iterator[Batch]:
        if self._current_pass is not token:
            raise RuntimeError(_ABANDONED)
        plan, bs, start = self._plan_pass()
        self._epoch_bs = bs
        self._release_stale(bs)  # before the controller releases caches and starts measuring
        if self.controller is not None and (start == 0 or self._ctrl_epoch != self.order.epoch):
            # From the epoch's start, or from a resumed position when this process has not measured it yet.
            self.controller.begin_epoch()
            self._ctrl_epoch = self.order.epoch
        shard = self.order.indices()
        if self._streaming is not None:  # what this pass reads, then the next epoch: downloaded ahead
            upcoming = np.concatenate(plan) if plan else shard[:0]
            self._streaming.schedule(upcoming, then=self.order.indices(self.order.epoch + 1))
        try:
            for images, labels, consumed in self._run(plan, start):
                at = self.order.position
                self.last_indices = shard[at : at + consumed]
                self.order.position += consumed
                if self._streaming is not None:
                    self._streaming.advance(consumed)  # the batch is decoded: its shards' use may be over
                yield images, labels
                if self._current_pass is not token:
                    raise RuntimeError(_ABANDONED)
            self.order.position = len(self.order)
            self._finished = True
            if self.controller is not None:
                self.controller.end_epoch(self.order.epoch)
        finally:
            if self._current_pass is token:
                self._epoch_bs = None

    def _release_stale(self, batch_size: int) -> None:
        """Free what the backend keeps that the pass about to start at ``batch_size`` will not use. Called
        before the controller releases cached memory and resets its peak, so the epoch's reading is its own."""

    def _run(self, plan: list[np.ndarray], start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """Yield (images, labels, planned samples accounted for) for each planned batch, in order."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the backend holds between passes (worker processes, a pipeline); a later pass
        starts again."""


# pragma: no mutate block (the DALI backend: outside the epoch driver)
class LoaderSampler(Sampler[int]):
    """A loader's order as a `torch.utils.data.Sampler`: iterates this rank's shard of the current epoch;
    ``set_epoch`` is the loader's (safe to call from a framework)."""

    def __init__(self, loader: LoaderBase) -> None:
        self.loader = loader

    @property
    def shuffle(self) -> bool:
        return self.loader.order.shuffle

    @property
    def epoch(self) -> int:
        return self.loader.order.epoch

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.loader.order.indices().tolist())

    def __len__(self) -> int:
        return len(self.loader.order)


class DALIIterator(LoaderBase):
    """Batches of decoded, augmented images from a DALI pipeline, as PyTorch tensors.

    ``images`` is NCHW (on the GPU in GPU mode, on the CPU in DALI's CPU-only mode), cropped,
    augmented, normalized and typed as ``recipe`` says (default: `Recipe()`, float32),
    ``labels`` int64 of shape (N,) on the same device. Each epoch yields each of this rank's
    samples exactly once, whatever the prefetch depth, batch-size changes between epochs or
    an early ``break``. The pipeline of an epoch that ended normally serves the next epoch of the same
    batch size (its source re-armed); a new batch size, a ``break`` or an error shuts it down and the
    next pass builds one seeded from (seed, epoch, rank, position), so an abandoned epoch leaves
    nothing in flight. ``close()`` shuts the kept pipeline down. Augmentation is reproducible for a
    run with the same history; it continues the kept pipeline's random stream across epochs.

    >>> loader = DALIIterator(open_dataset("data/train"), batch_size=256)   # doctest: +SKIP
    >>> for epoch in range(90):                                              # doctest: +SKIP
    ...     loader.set_epoch(epoch)
    ...     for images, labels in loader:
    ...         ...
    """

    backend = "dali"

    def __init__(self, dataset: Reader, batch_size: int, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size, **kwargs)
        try:
            import nvidia.dali  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "DALIIterator needs NVIDIA DALI: pip install nvidia-dali-cuda120 (Linux), "
                "or use dali_fast.TorchIterator / make_loader(backend='auto')"
            ) from e
        self.device_id = local_device_index() if self.gpu else None
        self.pipelines_built = 0
        self._kept: _Kept | None = None  # the pipeline of the last epoch that ended normally

    def _max_batch(self) -> int:
        """The pipeline's batch size: this epoch's (a new size means a new pipeline, so DALI and the
        hardware decoder preallocate for what is used, not for what a controller might reach)."""
        return self.batch_size

    def _run(self, plan: list[np.ndarray], start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """Run the plan through a pipeline; after a failure, tell what failed.

        An allocation failure is a `DALIMemoryError` (and reported to the controller); a failure of any
        operator but a decoder is a `DALIOperatorError` naming the operator, with DALI's own text. DALI
        stops a pipeline at the first record its decoder cannot decode: the records it had in flight are
        then checked one by one on the CPU; ``on_error='raise'`` names the ones that fail;
        ``on_error='skip'`` skips and counts them and continues with a new pipeline from the first batch
        not yet yielded, so every other sample still comes exactly once.
        """
        from .pipeline import undecodable

        bad: dict[int, str] = {}  # index -> reason, found after a pipeline failure
        done = 0  # planned batches yielded so far
        while done < len(plan):
            source, failure = None, None
            for item in self._run_pipeline(plan[done:], start, bad):
                if isinstance(item, BaseException):
                    source, failure = item.args[1], item.args[2]
                    break
                out_images, out_labels, consumed, batches = item
                done += batches
                start += consumed
                yield out_images, out_labels, consumed
            if failure is None:
                return
            what = parse_dali_error(failure)
            if is_memory_error(failure):
                if self.controller is not None and hasattr(self.controller, "report_oom"):
                    self.controller.report_oom(self.batch_size)
                raise DALIMemoryError(
                    f"DALI ran out of memory at batch size {self.batch_size}: {what.describe()}; "
                    "use a smaller batch size (or a BatchSizeController), fewer decode threads, or a smaller image_size"
                ) from failure
            in_flight = [i for fed in source.fed for i in fed.kept] if source is not None else []
            if not what.is_decoder or not in_flight:  # not the data's fault, or no record had reached DALI
                raise DALIOperatorError(f"DALI failed: {what.describe()}") from failure
            culprits = undecodable(self.dataset, in_flight)
            if not culprits or self.on_error == "raise":
                named = list(culprits) or in_flight
                names = ", ".join(f"{i} ({self.dataset.source(i)})" for i in named[:8])
                more = f" and {len(named) - 8} more" if len(named) > 8 else ""
                what_s = "record" if len(named) == 1 and culprits else "one of records" if not culprits else "records"
                why = f": {culprits[named[0]]}" if culprits else ""
                hint = (
                    "pass on_error='skip' (--on-error skip)"
                    if culprits
                    else "each of them decodes with Pillow, so they may not be at fault (DALI's decoder fails so "
                    "too when it runs short of memory): check them with `dali-fast inspect --verify`, or try a "
                    "smaller batch size"
                )
                raise RuntimeError(
                    f"DALI failed decoding {what_s} {names}{more}{why} ({what.describe()}); {hint}"
                ) from failure
            bad.update(culprits)
            log.warning("rebuilding the DALI pipeline after %d undecodable record(s)", len(culprits))

    def _run_pipeline(
        self, plan: list[np.ndarray], start: int, bad: dict[int, str]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int] | BaseException]:
        """Yield (images, labels, samples consumed, plan batches consumed) per batch from one pipeline;
        on a DALI failure, yield one exception carrying the source and the error, then stop.

        The pipeline of an epoch that ended normally is kept for the next one when the batch size is
        the same: its source is re-armed with the new plan and the pipeline reset, so decoder setup and
        preallocation happen once per run, not per epoch. A `break`, an error or a new batch size
        shuts it down, and the next pass builds a new one.
        """
        from .pipeline import shutdown_pipeline

        kept = self._kept if self._kept is not None and self._kept.batch_size == self._max_batch() else None
        if kept is None:
            self.close()
            try:
                kept = self._build(plan, start, bad)
            except Exception as e:  # noqa: BLE001 - DALI's build errors are classified like run errors
                if not from_dali(e):
                    raise
                yield _Failure("pipeline build failed", None, e)
                return
        else:
            kept.source.rearm(plan, bad, self._boxes())
            kept.iterator.reset()
        self._kept = None  # owned by this pass until it ends normally
        source, it = kept.source, kept.iterator
        ended = False
        try:
            while True:
                try:
                    out = next(it)[0]
                except StopIteration:
                    source.finish()
                    ended = True
                    return
                except Exception as e:  # noqa: BLE001 - DALI maps its errors to several Python types
                    if not from_dali(e):
                        raise
                    yield _Failure("pipeline failed", source, e)
                    return
                fed = source.consume()
                images = out["images"]
                if self.memory_format == torch.channels_last:
                    images = images.permute(0, 3, 1, 2)  # HWC from DALI: an NCHW view, channels_last, no copy
                yield images, out["labels"].reshape(-1), fed.consumed, fed.batches
        finally:
            if ended:
                self._kept = kept
            else:
                source.stop()
                # Stop the pipeline's threads now, not when the garbage collector gets to it: a failed
                # epoch's traceback keeps the pipeline referenced, and DataLoader workers forked while
                # one was still running were seen to crash.
                shutdown_pipeline(kept.pipeline)
            del it, kept

    def _release_stale(self, batch_size: int) -> None:
        """Shut down the kept pipeline when the coming pass needs another batch size: its buffers go back
        to DALI's pool before the controller releases the pool and starts the new epoch's reading."""
        if self._kept is not None and self._kept.batch_size != batch_size:
            self.close()

    def _boxes(self) -> Any:
        """This epoch's erasing boxes for a batch of sample indices, as float32 rows (top, left, h, w): drawn
        for the batch at once by the rule `TorchIterator` draws one sample's with; None without erasing."""
        if not self.train or self.recipe.random_erasing <= 0:
            return None
        recipe, seed, epoch = self.recipe, self.seed, self.order.epoch
        return lambda indices: erasing_boxes(recipe, seed, epoch, indices).astype(np.float32)

    def _build(self, plan: list[np.ndarray], start: int, bad: dict[int, str]) -> _Kept:
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        from .pipeline import BatchSource, build_pipeline, derive_seed
        from .transforms.dali import default_num_threads

        source = BatchSource(self.dataset, plan, self.on_error, self._skips, exclude=bad, boxes=self._boxes())
        batch_size = self._max_batch()
        pipe = build_pipeline(
            source,
            max_batch=batch_size,
            train=self.train,
            recipe=self.recipe,
            gpu=self.gpu,
            device_id=self.device_id,
            seed=derive_seed(self.seed, self.order.epoch, self.rank, start),
            num_threads=self.num_threads or default_num_threads(self.gpu),
            prefetch=self.prefetch,
            layout="HWC" if self.memory_format == torch.channels_last else "CHW",
        )
        self.pipelines_built += 1
        it = DALIGenericIterator(
            pipe,
            ["images", "labels"],
            auto_reset=False,
            prepare_first_batch=False,
            last_batch_policy=LastBatchPolicy.PARTIAL,
        )
        return _Kept(pipe, it, source, batch_size)

    def close(self) -> None:
        """Shut down the pipeline kept between epochs (also done when the iterator is collected)."""
        kept, self._kept = getattr(self, "_kept", None), None
        if kept is not None:
            from .pipeline import shutdown_pipeline

            kept.source.stop()
            shutdown_pipeline(kept.pipeline)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@dataclass
class _Kept:
    """A DALI pipeline kept between epochs, with its iterator and source, built for ``batch_size``."""

    pipeline: Any
    iterator: Any
    source: Any
    batch_size: int


class _Failure(Exception):
    """A pipeline's failure, handed from `_run_pipeline` to `_run` (args: text, source, error)."""


class DALIMemoryError(RuntimeError):
    """DALI could not allocate memory (device or host) for a batch; not a bad record."""


class DALIOperatorError(RuntimeError):
    """A DALI operator other than a decoder failed: DALI's own message, with the operator named."""


# Allocation failures, as DALI 2.4's libraries word them (dali/core/cuda_error.h, dali/util/nvml.h, the
# nvImageCodec status codes, NPP and cuFFT), plus the CUDA runtime's and torch's own texts. Compared
# lower-case with the spaces removed.
_MEMORY_SIGNS = (
    "CUDA allocation failed",  # dali::CUDABadAlloc() and dali::NvmlBadAlloc: cudaMalloc / cuMemAlloc failed
    "Can't allocate",  # dali::CUDABadAlloc(size): "Can't allocate N bytes on device D." / "... on host."
    "bad_alloc",  # std::bad_alloc (host), what() == "std::bad_alloc"
    "cudaErrorMemoryAllocation",  # "CUDA runtime API error cudaErrorMemoryAllocation (2):\nout of memory"
    "CUDA_ERROR_OUT_OF_MEMORY",  # "CUDA driver API error CUDA_ERROR_OUT_OF_MEMORY (2):\nout of memory"
    "out of memory",  # cudaGetErrorString's text, and torch's "CUDA out of memory. Tried to allocate ..."
    "nvImageCodec failure: '#5'",  # NVIMGCODEC_STATUS_ALLOCATOR_FAILURE
    "nvImageCodec failure: '#15'",  # NVIMGCODEC_STATUS_EXTENSION_ALLOCATOR_FAILURE
    "NPP_MEMORY_ALLOCATION_ERROR",
    "cuFFT failed to allocate memory",
    "Failed to allocate",  # "Failed to allocate %llu bytes" (host buffers)
    "Cannot allocate memory",  # strerror(ENOMEM)
    "Could not allocate virtual address space",  # DALI's virtual-memory pool
)
_SIGNS = tuple(x.lower().replace(" ", "") for x in _MEMORY_SIGNS)
_OPERATOR = re.compile(r"Error (?:in|when executing) (CPU|GPU|MIXED) operator `([^`]+)`")
_NOISE = ("Critical error in pipeline", "Critical error when building pipeline", "Current pipeline object")


def from_dali(error: BaseException) -> bool:
    """True for an error a DALI pipeline raised (run or build), False for others (e.g. the source's own
    `BadRecordError`, which names its record already)."""
    if isinstance(error, BadRecordError):
        return False
    return isinstance(error, RuntimeError | MemoryError) or "Critical error" in str(error)


def is_memory_error(error: BaseException) -> bool:
    """True when a DALI error is an allocation failure rather than a decode failure."""
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower().replace(" ", "")
    return any(sign in text for sign in _SIGNS)


@dataclass(frozen=True)
class DaliFailure:
    """What a DALI error says: the failing operator (``None`` when it names none), its device, and
    DALI's own text of what went wrong."""

    operator: str | None
    device: str | None
    reason: str

    @property
    def is_decoder(self) -> bool:
        """The failing operator decodes images (``fn.decoders.image*``, the older ``fn.image_decoder*``)."""
        if self.operator is None:
            return False
        parts = self.operator.split(".")
        return "decoders" in parts[:-1] or parts[-1].startswith("image_decoder")

    def describe(self) -> str:
        """One line: ``MIXED operator `nvidia.dali.fn.erase`: <DALI's text>``, or DALI's text alone."""
        if self.operator is None:
            return self.reason
        return f"{self.device} operator `{self.operator}`: {self.reason}"


def parse_dali_error(error: BaseException) -> DaliFailure:
    """Split a DALI pipeline error ("Critical error in pipeline: / Error in MIXED operator `...`, which was
    used in the pipeline definition with the following traceback: ... encountered: <text>") into the
    operator, its device and the text after "encountered:"."""
    text = str(error)
    m = _OPERATOR.search(text)
    body = text.rsplit("encountered:", 1)[1] if "encountered:" in text else text
    useful = []
    for line in (x.strip() for x in body.splitlines()):
        op = _OPERATOR.search(line)
        if op is not None:  # "Error in CPU operator `x`," (DALI's layout) or "...`x`: text" on one line
            line = line[op.end() :].lstrip(" ,:")
        if line and not line.startswith(_NOISE) and not line.startswith("C++ context:"):
            useful.append(line)
    reason = " ".join(useful) or type(error).__name__
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    return DaliFailure(m.group(2) if m else None, m.group(1) if m else None, reason)


def dali_message(error: BaseException) -> str:
    """The informative part of a DALI error on one line: the operator and DALI's own text."""
    return parse_dali_error(error).describe()
