"""`DALIIterator`: the DALI pipeline behind a DataLoader-shaped PyTorch iterator (the epoch driver is
`LoaderBase`'s; this backend turns each planned list of index batches into tensors), and what its
failures say (`parse_dali_error`: the operator, DALI's own text; memory, decoder and other failures apart)."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..data.base import Reader
from ..machine import local_device_index
from ..transforms.batch import to_device
from ..transforms.dali import pool_host_buffers
from ..transforms.decode_choice import decide_train_decode, requested_train_decode
from ..transforms.draws import erasing_boxes
from ..transforms.mixed_decoder import default_num_threads
from .bad_records import BadRecordError
from .base import LoaderBase
from .dali_pipeline import (
    BatchSource,
    ReadAheadError,
    build_pipeline,
    derive_seed,
    shutdown_pipeline,
    undecodable,
)

log = logging.getLogger(__name__)


class DALIIterator(LoaderBase):
    """Batches of decoded, augmented images from a DALI pipeline, as PyTorch tensors.

    ``images`` is NCHW (on the GPU in GPU mode, on the CPU in DALI's CPU-only mode), cropped,
    augmented, normalized and typed as ``recipe`` says (default: `Recipe()`, float32),
    ``labels`` int64 of shape (N,) on the same device (or the float32 target rows of a data set opened
    with ``target="multihot"`` or ``"float"``, made from the records the batch holds). Each epoch yields
    each of this rank's samples exactly once, whatever the prefetch depth, batch-size changes between epochs or
    an early ``break``. The pipeline of an epoch that ended normally serves the next epoch of the same
    batch size (its source re-armed); a new batch size, a ``break`` or an error shuts it down and the
    next pass builds one seeded from (seed, epoch, rank, position), so an abandoned epoch leaves
    nothing in flight. With a resolution schedule (``Recipe(resolution=...)``), an epoch whose size
    changed builds one pipeline for it; an epoch of the same size keeps the pipeline. ``close()`` shuts
    the kept pipeline down. Augmentation is reproducible for a run with the same history; it continues
    the kept pipeline's random stream across epochs. Its host buffers of 2 MiB and more come from DALI's
    pool, which keeps the process's resident set flat over epochs (`pool_host_buffers`).

    Args:
        dataset: a reader (`open_dataset`): ``len``, ``reader[i] -> (bytes, label)``, ``classes``.
        batch_size: samples per batch (a controller may change it between epochs).
        train_decode: how training decodes JPEGs: "whole" images (on a GPU's hardware JPEG engine, then
            cropped), "roi" (the crop window only), or "auto" (None: ``DALI_FAST_TRAIN_DECODE``, else
            "auto"), which picks the faster for the device (`doctor` says which).
        **kwargs: the arguments every loader takes, with `TorchIterator`:

            - ``train``: training order and augmentation (shuffled each epoch, random-resized crop, flip,
              the recipe's extras) if True; evaluation (data set order, resize, centre crop) if False.
            - ``image_size``: the output's side in pixels (default: the recipe's, 224).
            - ``device``: "auto" (the GPU when CUDA is usable, else the CPU), "cuda" or "cpu".
            - ``seed``: the seed of the order and the augmentation; (seed, epoch, rank) fix an epoch.
            - ``drop_last``: leave out each epoch's last, short batch.
            - ``cache_bytes``: bytes of encoded records an LRU cache in this process keeps (0: none).
            - ``controller``: a `BatchSizeController`, which sets the batch size between epochs.
            - ``num_threads``: decode threads; None: one per CPU of this rank (on a GPU at most 8).
            - ``dtype``: the images' dtype (default: the recipe's, float32).
            - ``rank``, ``world_size``: this process's shard (None: the process group's, else ``RANK`` and
              ``WORLD_SIZE``, else one process).
            - ``on_error``: a bad record: "raise" names it; "skip" leaves it out and counts it.
            - ``prefetch``: batches prepared ahead of the one in use.
            - ``memory_format``: the images' memory format (default: the recipe's).
            - ``recipe``: the per-image transform, a `Recipe` (default: ``Recipe()``).
            - ``even``: the same number of samples on every rank (default: ``train``); False repeats no
              sample: exact evaluation, ``len()`` per rank.

    >>> loader = DALIIterator(open_dataset("data/train"), batch_size=256)   # doctest: +SKIP
    >>> for epoch in range(90):                                              # doctest: +SKIP
    ...     loader.set_epoch(epoch)
    ...     for images, labels in loader:
    ...         ...
    """

    backend = "dali"

    def __init__(self, dataset: Reader, batch_size: int, *, train_decode: str | None = None, **kwargs: Any) -> None:
        requested = requested_train_decode(train_decode)
        super().__init__(dataset, batch_size, **kwargs)
        try:
            import nvidia.dali  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "DALIIterator needs NVIDIA DALI: pip install nvidia-dali-cuda120 (Linux), "
                "or use dali_fast.TorchIterator / make_loader(backend='auto')"
            ) from e
        pool_host_buffers()  # before the process's first pipeline
        self.device_id = local_device_index() if self.gpu else None
        self.train_decode = decide_train_decode(self.gpu, self.device_id, requested)  # "whole" or "roi", logged
        self.pipelines_built = 0
        self.build_seconds = 0.0  # spent building pipelines (graph and operators), for reports apart from img/s
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
        kept = self._kept if self._kept is not None and self._kept.fits(self._max_batch(), self.image_size) else None
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
                # The labels (or target rows) of the records the batch holds, from the source: they skip the
                # pipeline, and go to the images' device once
                targets = self._batch_targets(fed.kept, fed.labels)
                yield images, to_device(targets, images.device), fed.consumed, fed.batches
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

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "train_decode": self.train_decode}  # how its images were decoded

    def _release_stale(self, batch_size: int) -> None:
        """Shut down the kept pipeline when the coming pass needs another batch size or image size (a
        resolution schedule): its buffers go back to DALI's pool before the controller releases the pool
        and starts the new epoch's reading."""
        if self._kept is not None and not self._kept.fits(batch_size, self.image_size):
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

        started = time.perf_counter()
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
            decode=self.train_decode,
        )
        self.pipelines_built += 1
        self.build_seconds += time.perf_counter() - started
        it = DALIGenericIterator(
            pipe,
            ["images"],
            auto_reset=False,
            prepare_first_batch=False,
            last_batch_policy=LastBatchPolicy.PARTIAL,
        )
        return _Kept(pipe, it, source, batch_size, self.recipe.image_size)

    def close(self) -> None:
        """Shut down the pipeline kept between epochs (also when collected; a no-op in a forked child: `fork_guard`)."""
        kept, self._kept = getattr(self, "_kept", None), None
        if kept is not None:
            kept.source.stop()
            shutdown_pipeline(kept.pipeline)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@dataclass
class _Kept:
    """A DALI pipeline kept between epochs, with its iterator and source, built for ``batch_size`` images
    of ``image_size`` px (the size is fixed in the graph: a new size is a new pipeline)."""

    pipeline: Any
    iterator: Any
    source: Any
    batch_size: int
    image_size: int

    def fits(self, batch_size: int, image_size: int) -> bool:
        return self.batch_size == batch_size and self.image_size == image_size


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
    """True for an error a DALI pipeline raised (run or build), False for others (the source's own: a
    `BadRecordError`, which names its record already, or a `ReadAheadError`)."""
    if isinstance(error, BadRecordError | ReadAheadError):
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
