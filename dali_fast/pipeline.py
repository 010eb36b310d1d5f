"""The DALI pipeline and the external-source batch callable that feeds it.

The source owns the epoch's cursor: it is armed with the epoch's list of index batches and
hands them out in order, raising StopIteration when the list is done. DALI calls it ahead of
consumption (prefetch) and past the end of the epoch; since the list, not an
``iteration * batch_size`` formula, decides what comes next, prefetch depth and batch-size
changes cannot duplicate or lose samples.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .data.base import Reader, read_batch_checked, read_checked
from .data.checks import pillow_reason
from .recipe import Recipe
from .system import cpus_per_local_rank

log = logging.getLogger(__name__)

IMAGENET_MEAN = Recipe().mean_255  # the default recipe's normalization, on the 0-255 scale of decoded pixels
IMAGENET_STD = Recipe().std_255


class BadRecordError(ValueError):
    """A record that cannot be decoded; names its index and source path."""


@dataclass
class SkipLog:
    """Skipped records: counted, and each logged once."""

    count: int = 0
    logged: set[int] = field(default_factory=set)

    def add(self, index: int, source: str, reason: str) -> None:
        self.count += 1
        if index not in self.logged:
            self.logged.add(index)
            log.warning("skipping record %d (%s): %s", index, source, reason)


def bad_record_message(reader: Reader, index: int, reason: str) -> str:
    return (
        f"record {index} ({reader.source(index)}): {reason}; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )


class BatchSource:
    """A batch-mode external-source callable over a planned list of index batches.

    Returns ``(encoded images, labels)`` per call. ``fed`` records, per batch handed to DALI,
    how many planned samples it accounts for (skipped ones included), in order, so the
    consumer can advance its cursor exactly by what it received.
    """

    def __init__(
        self,
        reader: Reader,
        plan: Sequence[np.ndarray],
        on_error: str,
        skips: SkipLog,
        exclude: Mapping[int, str] | None = None,
        boxes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.reader = reader
        self.boxes = boxes  # indices -> float32 (n, 4) rows (top, left, h, w) of their erasing boxes, a third output
        self.plan = list(plan)
        self.on_error = on_error
        self.skips = skips
        self.exclude = exclude or {}  # records known to break the decoder: skipped and counted
        self.next = 0
        self.stopped = False
        self.fed: deque[Fed] = deque()  # batches handed to DALI, not yet delivered
        self.tail_skipped: list[tuple[int, str]] = []

    def stop(self) -> None:
        """Hand out nothing more (the consumer has left the epoch)."""
        self.stopped = True

    def rearm(
        self,
        plan: Sequence[np.ndarray],
        exclude: Mapping[int, str] | None = None,
        boxes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """Start handing out a new plan (the next epoch's, in a pipeline kept from the last one)."""
        if (boxes is None) != (self.boxes is None):
            raise ValueError("a kept pipeline's source cannot start or stop giving erasing boxes")
        self.boxes = boxes
        self.plan = list(plan)
        self.exclude = exclude or {}
        self.next = 0
        self.stopped = False
        self.fed.clear()
        self.tail_skipped = []

    def __call__(self) -> tuple:
        consumed = batches = 0
        skipped: list[tuple[int, str]] = []
        while not self.stopped and self.next < len(self.plan):
            indices = np.asarray(self.plan[self.next], dtype=np.int64)
            self.next += 1
            batches += 1
            consumed += len(indices)
            datas, labels, bad = read_batch_checked(self.reader, indices)
            if self.exclude:  # records known to break the decoder (after a pipeline failure in skip mode)
                bad.update((pos, self.exclude[i]) for pos, i in enumerate(indices.tolist()) if i in self.exclude)
            kept = indices
            if bad:
                if self.on_error == "raise":
                    first = min(bad)
                    raise BadRecordError(bad_record_message(self.reader, int(indices[first]), bad[first]))
                skipped += [(int(indices[pos]), bad[pos]) for pos in sorted(bad)]
                keep = [pos for pos in range(len(indices)) if pos not in bad]
                datas, labels, kept = [datas[pos] for pos in keep], labels[keep], indices[keep]
            if datas:
                self.fed.append(Fed(consumed, kept.tolist(), batches, skipped))
                if self.boxes is not None:
                    return datas, labels, self.boxes(kept)
                return datas, labels
        self.tail_skipped += skipped  # the plan ended on records that were all skipped
        skipped = []
        raise StopIteration

    def finish(self) -> None:
        """The pipeline delivered everything: count the skipped records after its last batch."""
        for i, reason in self.tail_skipped:
            self.skips.add(i, self.reader.source(i), reason)
        self.tail_skipped = []

    def consume(self) -> Fed:
        """The oldest batch handed to DALI, now delivered: its skipped records are counted here, so a
        batch that was prefetched but never delivered (the pipeline failed first) counts nothing."""
        fed = self.fed.popleft()
        for i, reason in fed.skipped:
            self.skips.add(i, self.reader.source(i), reason)
        return fed


@dataclass
class Fed:
    """One batch handed to DALI: planned samples and plan batches it accounts for, what it kept and skipped."""

    consumed: int
    kept: list[int]
    batches: int
    skipped: list[tuple[int, str]]


def undecodable(reader: Reader, indices: Sequence[int]) -> dict[int, str]:
    """The records among ``indices`` that do not decode on the CPU (Pillow), with the reason for each."""
    from PIL import Image

    out: dict[int, str] = {}
    for i in indices:
        data, _, reason = read_checked(reader, i)
        if reason is None:
            try:
                with Image.open(io.BytesIO(bytes(data))) as im:
                    im.load()
            except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
                reason = pillow_reason(e)
        if reason is not None:
            out[int(i)] = reason
    return out


def shutdown_pipeline(pipe: Any) -> None:
    """Stop a DALI pipeline's worker threads and free its buffers now, not at garbage collection."""
    shutdown = getattr(pipe, "_shutdown", None)  # what Pipeline.__del__ calls
    if shutdown is not None:
        shutdown()


# nvJPEG preallocates, for the `mixed` decoder, one device buffer and two pinned host buffers per
# thread (DALI's decoders.image* docstring). Per-thread sizes are what DALI's ImageNet examples use,
# but the totals are bounded: with every core of a 224-core node as a thread they would reach tens
# of GB of GPU memory. So each pipeline spends at most these budgets, split between its threads.
DEVICE_PADDING_PER_THREAD = 211_025_920
HOST_PADDING_PER_THREAD = 140_544_512
DECODER_DEVICE_BUDGET = 512 * 2**20  # all threads' device paddings together, per pipeline
DECODER_PINNED_BUDGET = 1024 * 2**20  # all threads' pinned host paddings together (2 per thread)
MIXED_MAX_THREADS = 8  # default threads for GPU decoding (DALI's ResNet-50 example uses 4 per GPU)


def default_num_threads(gpu: bool = False) -> int:
    """CPU threads for one pipeline: this process's cores, split between local ranks; at most
    ``MIXED_MAX_THREADS`` when decoding on the GPU, where the threads only feed nvJPEG."""
    cpus = cpus_per_local_rank()
    return min(cpus, MIXED_MAX_THREADS) if gpu else cpus


def decoder_preallocation(num_threads: int, gpu: bool = True) -> dict[str, int]:
    """What one pipeline's decoder preallocates with ``num_threads`` threads: the per-thread paddings
    passed to DALI, and the device and pinned-host totals, both within their budgets."""
    if not gpu:
        return {"threads": num_threads, "device_padding": 0, "host_padding": 0, "device_total": 0, "pinned_total": 0}
    device = min(DEVICE_PADDING_PER_THREAD, DECODER_DEVICE_BUDGET // num_threads)
    host = min(HOST_PADDING_PER_THREAD, DECODER_PINNED_BUDGET // (2 * num_threads))
    return {
        "threads": num_threads,
        "device_padding": device,
        "host_padding": host,
        "device_total": device * num_threads,
        "pinned_total": 2 * host * num_threads,
    }


def derive_seed(*parts: int) -> int:
    """A 31-bit pipeline seed from integers (seed, epoch, rank, start position)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def augment(jpegs, *, train: bool, recipe: Recipe, gpu: bool, num_threads: int, layout: str = "CHW", erase=None):
    """The operators after the source, inside a pipeline definition, as ``recipe`` says.

    Train: random-resized-crop (decoding only the crop window), resize to ``image_size``, automatic
    augmentation, random horizontal flip, normalize, random erasing (``erase``: per-sample
    (top, left, h, w) boxes from the source). Eval: resize the shorter side, centre crop, normalize.
    ``num_threads`` is the pipeline's: the `mixed` decoder's memory paddings are sized per thread.
    """
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    S = recipe.image_size
    decode_device = "mixed" if gpu else "cpu"
    extra = gpu_decoder_arguments(num_threads) if gpu else {}
    interp = {"interp_type": getattr(types, DALI_INTERP[recipe.interpolation])}
    if train:
        images = fn.decoders.image_random_crop(
            jpegs,
            device=decode_device,
            output_type=types.RGB,
            random_area=list(recipe.scale),
            random_aspect_ratio=list(recipe.ratio),
            num_attempts=10,
            **extra,
        )
        images = fn.resize(images, resize_x=S, resize_y=S, **interp)
        if recipe.auto_augment is not None:
            images = auto_augment(images, recipe)
        mirror = fn.random.coin_flip(probability=recipe.hflip) if recipe.hflip > 0 else 0
    else:
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **extra)
        images = fn.resize(images, resize_shorter=recipe.resize_shorter, **interp)
        mirror = 0
    norm = {"mean": list(recipe.mean_255), "std": list(recipe.std_255)} if recipe.normalize else {}
    out_dtype = recipe.out_dtype
    # DALI 2.4's GPU `erase` has no float16 kernel (its CPU one has): erase in float32, then cast.
    cast_after = erase is not None and gpu and out_dtype == torch.float16
    images = fn.crop_mirror_normalize(
        images,
        dtype=getattr(types, DALI_DTYPES[torch.float32 if cast_after else out_dtype]),
        output_layout=layout,
        crop=(S, S),
        mirror=mirror,
        **norm,
    )
    if erase is not None:  # the boxes stay on the CPU: DALI takes argument inputs from CPU memory only
        images = fn.erase(images, anchor=erase[0:2], shape=erase[2:4], axis_names="HW", fill_value=0)
        if cast_after:
            images = fn.cast(images, dtype=types.FLOAT16)
    return images


def gpu_decoder_arguments(num_threads: int) -> dict[str, Any]:
    """The `mixed` decoder's arguments: bounded memory paddings for ``num_threads`` threads, and chroma
    upsampled the "fancy" way, as DALI's CPU decoder, Pillow and `TorchIterator` do (DALI's default for
    `mixed` is another filter: the same JPEG would train on other pixels on a GPU)."""
    pre = decoder_preallocation(num_threads, gpu=True)
    return {
        "device_memory_padding": pre["device_padding"],
        "host_memory_padding": pre["host_padding"],
        "jpeg_fancy_upsampling": True,
    }


DALI_INTERP = {
    "bilinear": "INTERP_LINEAR",
    "bicubic": "INTERP_CUBIC",
    "nearest": "INTERP_NN",
    "lanczos": "INTERP_LANCZOS3",
}
DALI_DTYPES = {torch.float32: "FLOAT", torch.float16: "FLOAT16", torch.uint8: "UINT8"}


def auto_augment(images, recipe: Recipe):
    """``recipe.auto_augment`` through `nvidia.dali.auto_aug` (the pipeline needs ``enable_conditionals``).

    Translations span torchvision's ranges (150/331 of the side; 32 px for TrivialAugmentWide), geometric
    ops use nearest-neighbour sampling and fill with ``recipe.fill``, as the Pillow twin does.
    """
    # auto_aug builds a few operators by their old `fn.experimental` names, and DALI forces their
    # DeprecationWarning on ("default" filter) at every build: that is DALI's affair, not the user's.
    with warnings.catch_warnings(record=True) as caught:
        out = _auto_augment(images, recipe)
    for w in caught:
        if not str(w.message).startswith("WARNING: `nvidia.dali.fn.experimental."):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def _auto_augment(images, recipe: Recipe):
    import nvidia.dali.types as types
    from nvidia.dali.auto_aug import auto_augment, rand_augment, trivial_augment

    S = recipe.image_size
    common = {"fill_value": recipe.fill, "interp_type": types.INTERP_NN}
    if recipe.auto_augment == "randaugment":
        return rand_augment.rand_augment(
            images,
            n=recipe.num_ops,
            m=recipe.magnitude,
            num_magnitude_bins=recipe.num_magnitude_bins,
            shape=(S, S),
            max_translate_rel=150 / 331,
            **common,
        )
    if recipe.auto_augment == "trivialaugment":
        return trivial_augment.trivial_augment_wide(
            images, num_magnitude_bins=recipe.num_magnitude_bins, max_translate_abs=32, **common
        )
    return auto_augment.auto_augment_image_net(images, shape=(S, S), max_translate_rel=150 / 331, **common)


def build_pipeline(
    source: BatchSource,
    *,
    max_batch: int,
    train: bool,
    recipe: Recipe,
    gpu: bool,
    device_id: int | None,
    seed: int,
    num_threads: int,
    prefetch: int,
    layout: str = "CHW",
):
    """Build the decode → (random-resized-)crop → augment → normalize/flip → erase pipeline, fed by ``source``."""
    from nvidia.dali import pipeline_def

    conditionals = {"enable_conditionals": True} if train and recipe.auto_augment is not None else {}

    @pipeline_def(
        batch_size=max_batch,
        num_threads=num_threads,
        device_id=device_id if gpu else None,
        seed=seed,
        prefetch_queue_depth=prefetch,
        **conditionals,
    )
    def pipe():
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types

        if source.boxes is None:
            jpegs, labels = fn.external_source(
                source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64]
            )
            erase = None
        else:
            jpegs, labels, erase = fn.external_source(
                source=source, num_outputs=3, batch=True, dtype=[types.UINT8, types.INT64, types.FLOAT]
            )
        images = augment(
            jpegs, train=train, recipe=recipe, gpu=gpu, layout=layout, num_threads=num_threads, erase=erase
        )
        if gpu:
            labels = labels.gpu()
        return images, labels

    p = pipe()
    p.build()
    return p
