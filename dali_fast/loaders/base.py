"""`LoaderBase`: the epoch driver every backend shares, and what a backend must write (see its docstring).
It imports no backend: `DALIIterator` and `TorchIterator` are subclasses in their own modules; what both
raise and count for a bad record is in `bad_records` (`BadRecordError`, `SkipLog`)."""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..data.base import ON_ERROR, Reader, StreamingReader, check_on_error, provides
from ..data.cache import CachedReader, LRUCache
from ..data.targets import reader_targets
from ..machine import cuda_usable
from ..transforms.recipe import Recipe, describe_resolution, resolve_recipe
from .bad_records import SkipLog
from .order import EpochSampler, StreamingOrder, make_order
from .passes import ABANDONED, CLOSED, Pass, close_ends_the_pass
from .resume import load_loader_state, loader_state
from .sampler import LoaderSampler, dist_rank_world, sharding_note

__all__ = ["ON_ERROR", "LoaderBase"]

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class LoaderBase:
    """The epoch driver every backend shares: the epoch order and its cursor, resume, sharding across
    ranks, the batch size and the controller hooks. Exactly-once and resume live here, once.

    ``recipe`` (a `dali_fast.Recipe`) is the per-image transform; ``image_size``, ``dtype`` (uint8: batches
    the consumer normalizes, `normalize_images`) and ``memory_format`` adjust it and must agree with it.

    ``even`` (default: ``train``) gives every rank the same number of samples, as DDP training needs, by at
    most ``world_size - 1`` repeats (or, with ``drop_last``, cutting the tail); ``even=False`` repeats
    nothing, so ranks may differ by one sample and ``len()`` is this rank's own: exact evaluation.

    The position is the number of this rank's samples already *yielded* in the current epoch
    (not the number handed to a prefetching backend), so ``state_dict()`` taken inside the loop
    resumes at exactly the next sample. ``last_indices``: the data set indices of the last yielded batch's
    rows, in order (a skipped record is not among them: `gather_outputs` of rows and indices lines up).

    A backend is a subclass that calls ``super().__init__(dataset, batch_size, **kwargs)`` first and
    writes two methods, which the base does not:

    - ``_run(plan, start)``: for each batch of ``plan`` (arrays of data set indices, in order; ``start``
      is the position of the first), yield ``(images, labels, consumed)``, ``consumed`` being the planned
      samples the batch accounts for, bad records it skipped included. In order, nothing dropped or
      repeated; it may work ahead (the base counts what was yielded, not what was asked for). Bad records
      follow ``self.on_error``: `BadRecordError` naming the record, or ``self._skips.add(...)``.
    - ``close()``: release what the backend holds between passes (processes, a pipeline, buffers); the
      next pass starts them again. A backend that holds nothing writes ``def close(self): pass``.

    Optional: ``_release_stale(batch_size)``, to free before the controller measures what the coming
    pass will not use. A subclass that lacks one of the two, or whose ``__init__`` does not reach the
    base's, is told so in one line.

    ``close()`` between two batches ends the pass for every backend alike (`passes`): its ``_run`` is
    closed, then the backend's ``close()`` runs, and the pass raises one line if asked for more.
    """

    backend = "base"
    _REQUIRED = ("_run", "close")

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
        even: bool | None = None,
    ) -> None:
        missing = [name for name in self._REQUIRED if getattr(type(self), name) is getattr(LoaderBase, name)]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} does not write {' and '.join(missing)}: a LoaderBase backend writes "
                "_run(plan, start), which yields each planned batch, and close(), which releases what it holds"
            )
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        # image_size, dtype and memory_format are the recipe's; as arguments they adjust the default one.
        # With a resolution schedule (progressive resizing), ``recipe`` is the epoch's fixed-size recipe
        # (`Recipe.at_epoch`) and ``base_recipe`` the one given; an evaluation loader keeps image_size.
        self.base_recipe = resolve_recipe(recipe, image_size=image_size, dtype=dtype, memory_format=memory_format)
        self.recipe = self.base_recipe
        if device not in ("auto", "cpu", "cuda", "gpu"):
            raise ValueError(f"device={device!r}: use 'auto' (GPU when CUDA is usable), 'cuda' or 'cpu'")
        check_on_error(on_error)
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
        self.even = self.train if even is None else bool(even)
        self.num_threads = num_threads
        self.dtype = self.recipe.out_dtype
        self.on_error = on_error
        self.prefetch = int(prefetch)
        self.memory_format = self.recipe.memory_format
        self._data = dataset
        self._targets = reader_targets(dataset)  # rows by index (`_batch_targets`); None: the labels are targets
        # A reader that streams shards (remote data) is told each pass's order, to download ahead.
        self._streaming: Any = dataset if provides(dataset, StreamingReader) and dataset.streaming else None  # type: ignore[attr-defined]
        self.order: EpochSampler | StreamingOrder = self._new_order(self.rank, self.world_size)
        self.controller = controller
        self._batch_size = int(batch_size)
        if controller is not None:
            controller.attach(int(batch_size))
        self._apply_resolution()
        self._epoch_bs: int | None = None  # batch size of the epoch in progress
        self._finished = False  # the current epoch was consumed to the end
        self._skips = SkipLog()
        self._ctrl_epoch: int | None = None  # the epoch the controller is measuring
        self.last_indices: np.ndarray = np.empty(0, dtype=np.int64)
        self._resumed = False  # load_state_dict() was called since the last iter()
        self._active: weakref.ref | None = None  # the pass in progress, if any
        self._current_pass: Pass | None = None  # the token of the pass allowed to deliver batches
        self._said: set[str] = set()  # disagreements about the ranks, logged once per loader
        self._ready = True  # the base's __init__ ran (see `_check_ready`)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A backend's ``close()`` also ends the pass in progress (see the class docstring), so no backend
        has to write that rule itself (`passes.close_ends_the_pass`)."""
        super().__init_subclass__(**kwargs)
        close_ends_the_pass(cls)

    def _check_ready(self) -> None:
        """A subclass whose ``__init__`` did not run the base's is named in one line, not an AttributeError."""
        if not self.__dict__.get("_ready"):
            raise NotImplementedError(
                f"{type(self).__name__} was not set up by LoaderBase.__init__: "
                "did you call super().__init__(dataset, batch_size, **kwargs)?"
            )

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
        """The epoch order: shards streamed for a streaming reader, else random access (`order.make_order`)."""
        kw = {"seed": self.seed, "shuffle": self.train, "drop_last": self.drop_last, "even": self.even}
        return make_order(self._data, rank=rank, world_size=world_size, **kw)

    def cache_stats(self) -> dict[str, float] | None:
        return self.cache.stats() if self.cache is not None else None

    def follow_process_group(self, starting: bool = False) -> None:
        """Take the rank and world size of a process group started after this loader was made (Lightning and
        Accelerate start it after the user built the loader); explicit rank/world_size stay. A pass
        ``starting`` now restarts its epoch unless a state was loaded, so only a loaded mid-epoch position
        stands in the way then (one line, as a position mid-epoch does)."""
        self._check_ready()
        rank, world = dist_rank_world(self._rank_arg, self._world_arg)
        if (rank, world) == (self.rank, self.world_size):
            return
        mid_epoch = self.order.position not in (0, len(self.order))
        if (mid_epoch and (self._resumed or not starting)) or (not starting and self._pass_running()):
            raise RuntimeError(
                f"the process group says rank {rank} of {world}, but this loader is mid-epoch as rank "
                f"{self.rank} of {self.world_size}; make the loader after the process group starts"
            )
        epoch = self.order.epoch
        self.rank, self.world_size = rank, world
        self.order = self._new_order(rank, world)
        self.order.set_epoch(epoch)
        log.info("loader: now rank %d of %d (the process group started after the loader was made)", rank, world)

    def _batch_targets(self, indices: Any, labels: np.ndarray) -> torch.Tensor:
        """What a batch yields beside its images (on the CPU): its labels (int64), or for a reader's multi-hot
        or float targets (`data.targets`) the float32 rows of ``indices``, the records its images are. Made
        once per batch in the main process: nothing per sample crosses a process boundary, and a resume
        gives the same rows as the images."""
        if self._targets is None:
            return torch.from_numpy(labels)
        return torch.from_numpy(self._targets.rows(indices))

    def __len__(self) -> int:
        """Batches in this epoch on this rank, at this epoch's batch size."""
        self.follow_process_group()
        n, bs = len(self.order), self.batch_size
        self._counted_at = bs  # a framework may count the epoch's batches before it restores a state (`resume`)
        return n // bs if self.drop_last else math.ceil(n / bs)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (and, with a resolution schedule, its training size). Calling it with
        the epoch a resumed state is in keeps the position."""
        self._supersede_pass("set_epoch()")
        epoch = int(epoch)
        if epoch != self.order.epoch or self._finished:
            self.order.set_epoch(epoch)
            self._finished = False
            self._resumed = False
        self._apply_resolution()

    def _apply_resolution(self) -> None:
        """The current epoch's recipe from the schedule (training loaders only); the controller is told the
        pixels per sample, so a batch size chosen at a lower resolution is scaled before it is used."""
        self.recipe = self.base_recipe.at_epoch(self.order.epoch, self.train)
        self.image_size = self.recipe.image_size
        if self.controller is not None and hasattr(self.controller, "set_pixels"):
            self.controller.set_pixels(self.image_size * self.image_size)

    @property
    def resolution(self) -> Any:
        """The resolution schedule as plain values (None without one), as ``state_dict`` keeps it."""
        return describe_resolution(self.base_recipe.resolution) if self.train else None

    def _pass_running(self) -> bool:
        """A pass has started (its first batch was asked for) and has not ended or been closed."""
        if self._current_pass is None:
            return False
        gen = self._active() if self._active is not None else None
        return gen is not None and inspect.getgeneratorstate(gen) in (inspect.GEN_SUSPENDED, inspect.GEN_RUNNING)

    def _supersede_pass(self, what: str) -> None:
        """Start over from ``what`` (a new iter(), set_epoch, load_state_dict) while an earlier pass is
        suspended: that pass is abandoned, as a DataLoader abandons its old iterator, and raises a
        one-line error if it is asked for another batch, so no batch is ever delivered by two passes."""
        self._check_ready()
        if self._pass_running():  # started: abandon it (a pass not started yet plans when it starts)
            log.debug("%s abandons the pass in progress", what)
            self._current_pass = None
            self._epoch_bs = None

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: epoch, samples yielded so far, and what must match to resume (`resume`)."""
        self._check_ready()
        return loader_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next batch starts at exactly the sample after the last one yielded. A state saved by one
        rank of a lockstep run on another world size resumes too (`loaders.order`), keeping the global batch
        (`resume.load_loader_state` has what it checks)."""
        self._supersede_pass("load_state_dict()")
        load_loader_state(self, state)
        self._resumed = True  # the next iter() continues from here instead of restarting the epoch
        self._apply_resolution()  # the saved epoch's size (the schedule is a pure function of the epoch)

    def __iter__(self) -> Iterator[Batch]:
        """A pass over the rest of the epoch: the whole current epoch, as a DataLoader does, unless
        ``load_state_dict()`` was called since the last ``iter()`` (then from the saved position).

        The pass decides what it covers when its first batch is asked for, so ``set_epoch`` between
        ``iter()`` and the first ``next()`` (as Lightning calls them) still applies.
        """
        self._supersede_pass("iter()")
        token = Pass()
        gen = self._epoch(token)
        self._current_pass = token
        self._active = weakref.ref(gen)
        return gen

    def _plan_pass(self) -> tuple[list[np.ndarray], int, int]:
        """(index batches, batch size, start position) of the pass that starts now."""
        self.follow_process_group(starting=True)
        note = sharding_note(self._rank_arg, self._world_arg)
        if note is not None and note not in self._said:  # the launcher and the process group disagree
            self._said.add(note)
            log.warning("loader: %s", note)
        if self._finished:
            # Looping again without set_epoch: move on to the next epoch's order.
            self.order.set_epoch(self.order.epoch + 1)
            self._finished = False
        elif not self._resumed:
            self.order.position = 0  # e.g. after a peek with next(iter(loader)) or a break
        self._resumed = False
        self._apply_resolution()  # before the batch size is read: the controller scales it to the size
        bs = self.batch_size
        start = self.order.position
        shard = self.order.indices()
        stop = len(shard)
        if self.drop_last:
            stop = start + (len(shard) - start) // bs * bs
        return [shard[i : min(i + bs, stop)] for i in range(start, stop, bs)], bs, start

    # ------------------------------------------------------------------ epoch driver
    def _epoch(self, token: Pass) -> Iterator[Batch]:
        if self._current_pass is not token:
            raise RuntimeError(CLOSED if token.closed else ABANDONED)
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
        run = self._run(plan, start)
        token.run = weakref.ref(run) if inspect.isgenerator(run) else None
        try:
            for images, labels, consumed in run:
                at = self.order.position
                self.last_indices = self._skips.yielded(shard[at : at + consumed], len(labels))
                self.order.position += consumed
                if self._streaming is not None:
                    self._streaming.advance(consumed)  # the batch is decoded: its shards' use may be over
                yield images, labels
                if self._current_pass is not token:
                    raise RuntimeError(CLOSED if token.closed else ABANDONED)
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
        """Yield (images, labels, planned samples accounted for) for each planned batch, in order (the
        backend writes it; see the class docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not write _run(plan, start)")

    def close(self) -> None:
        """Release what the backend holds between passes (worker processes, a pipeline); a later pass
        starts again (the backend writes it; see the class docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not write close()")
