"""The DALI side of the recipe: the operators after the external source (`augment`: decode, crop, resize,
automatic augmentation, flip, normalize, erase; training decodes as `decode_choice` says), and how a
pipeline's decoding is set up (threads; the `mixed` decoder's memory paddings within fixed budgets, its
preallocation hints from the data set's image sizes, its load on the JPEG engine and its thread affinity:
`MixedDecoder`). DALI is imported inside the functions, so importing this module needs no DALI.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..data.base import Reader, StreamingReader, provides
from ..machine import cpus_per_local_rank, devices_remapped
from .decode import stored_size
from .decode_choice import HW_DECODER_LOAD, choose_train_decode, hw_decoder_load
from .recipe import Recipe

log = logging.getLogger(__name__)

# DALI allocates host buffers above this size from its own pool, below it with malloc (its
# DALI_MALLOC_POOL_THRESHOLD; DALI's default is 32 MiB, glibc's highest mmap threshold).
HOST_POOL_THRESHOLD = "2M"
_MALLOC_SETTINGS = ("DALI_MALLOC_POOL_THRESHOLD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")


def pool_host_buffers() -> bool:
    """Have DALI's host pool, not malloc, serve the per-batch host buffers of 2 MiB and more.

    Below DALI's default threshold (32 MiB) those buffers come from malloc, whose moving mmap threshold
    then maps and unmaps them or carves them from a heap that fragments: a CPU-mode training process's
    resident set stepped between 570 and 864 MiB over 30 epochs, and its page faults cost system time.
    With 2 MiB it stays within a few MiB, in less CPU time (benchmarks/worker_rss.py, docs/loaders.md).
    DALI reads the setting when it first allocates, so this must run before the process's first
    pipeline. A setting of the user's (``DALI_MALLOC_POOL_THRESHOLD``, or malloc's own
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_MMAP_MAX_``, from which DALI derives it) is kept.

    Returns:
        Whether the setting was made here.
    """
    if any(name in os.environ for name in _MALLOC_SETTINGS):
        return False
    os.environ["DALI_MALLOC_POOL_THRESHOLD"] = HOST_POOL_THRESHOLD
    log.debug("DALI_MALLOC_POOL_THRESHOLD=%s: DALI's pool serves host buffers from that size", HOST_POOL_THRESHOLD)
    return True


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


def augment(
    jpegs,
    *,
    train: bool,
    recipe: Recipe,
    gpu: bool,
    num_threads: int,
    layout: str = "CHW",
    erase=None,
    decode: str | None = None,
    decoder: MixedDecoder | None = None,
):
    """The operators after the source, inside a pipeline definition, as ``recipe`` says.

    Train: random-resized-crop, automatic augmentation, random horizontal flip, normalize, random erasing
    (``erase``: per-sample (top, left, h, w) boxes from the source). The crop follows ``decode`` ("whole",
    "roi"; None: `choose_train_decode` without NVML's answer, so "whole" on a GPU, "roi" on the CPU):
    "whole" decodes the whole image (on a GPU with the JPEG engine taking ``decoder.hw_load`` of the work)
    then `fn.random_resized_crop` crops and resizes it on the device; "roi" decodes only the crop window
    (`fn.decoders.image_random_crop`) then resizes it. Both draw the window by one rule (DALI's
    `RandomCropAttr`: area in ``recipe.scale``, aspect ratio in ``recipe.ratio``, 10 attempts, then the
    image cut to the nearest allowed ratio, shrunk to the largest allowed area and placed at random; where
    torchvision and `TorchIterator` centre that last window and keep its full side, DALI's differs). Eval:
    resize the shorter side, centre crop, normalize. ``num_threads`` is the pipeline's; ``decoder`` sets up
    the `mixed` decoder (default: `MixedDecoder.for_data` of ``num_threads``, without preallocation hints).
    """
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    S = recipe.image_size
    decode_device = "mixed" if gpu else "cpu"
    interp = {"interp_type": getattr(types, DALI_INTERP[recipe.interpolation])}
    if gpu and decoder is None:
        decoder = MixedDecoder.for_data(num_threads, (), 1)
    if train:
        how = choose_train_decode(gpu, None, decode or "auto")
        crop = {"random_area": list(recipe.scale), "random_aspect_ratio": list(recipe.ratio), "num_attempts": 10}
        extra = decoder.arguments(roi=how == "roi") if decoder is not None and gpu else {}
        if how == "whole":
            images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **extra)
            images = fn.random_resized_crop(images, size=[S, S], **crop, **interp)
        else:
            images = fn.decoders.image_random_crop(jpegs, device=decode_device, output_type=types.RGB, **crop, **extra)
            images = fn.resize(images, resize_x=S, resize_y=S, **interp)
        if recipe.auto_augment is not None:
            images = auto_augment(images, recipe)
        mirror = fn.random.coin_flip(probability=recipe.hflip) if recipe.hflip > 0 else 0
    else:
        extra = decoder.arguments() if decoder is not None and gpu else {}
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
        fill = list(recipe.erasing_fill)  # the mean pixel (per channel: the layout has a C)
        images = fn.erase(images, anchor=erase[0:2], shape=erase[2:4], axis_names="HW", fill_value=fill)
        if cast_after:
            images = fn.cast(images, dtype=types.FLOAT16)
    return images


# The hardware decoder preallocates for ``max batch`` images of the hinted size (nvImageCodec's
# nvjpegDecodeBatchedPreAllocate, taken here as 3 bytes a pixel); the hint is shrunk to keep that within this.
HW_HINT_BUDGET = 512 * 2**20
HINT_PERCENTILE = 99  # the hint covers this share of the data set's widths and of its heights


def preallocation_hints(sizes: Sequence[tuple[int, int]], max_batch: int) -> tuple[int, int]:
    """``(width, height)`` for the `mixed` decoder's ``preallocate_width_hint`` / ``preallocate_height_hint``:
    the `HINT_PERCENTILE` of the widths and of the heights in ``sizes`` (the data set's, stored), shrunk with
    its aspect kept until ``max_batch`` images of it fit `HW_HINT_BUDGET`; (0, 0), DALI's "no hint", without
    sizes. Without hints the engine's buffers grow during the first epoch, as larger images come."""
    if not sizes or max_batch < 1:
        return 0, 0
    widths, heights = sorted(w for w, _ in sizes), sorted(h for _, h in sizes)
    k = min(len(sizes) - 1, math.ceil(HINT_PERCENTILE / 100 * len(sizes)) - 1)
    width, height = widths[k], heights[k]
    shrink = min(1.0, math.sqrt(HW_HINT_BUDGET / (max_batch * width * height * 3)))
    return max(1, int(width * shrink)), max(1, int(height * shrink))


def decoder_affinity(dali_version: str | None = None) -> bool:
    """The `mixed` decoder's ``affine``: True (DALI ties each decoding thread to the GPU's CPUs, as NVML
    names them, within the thread's own CPU set) unless this DALI looks that set up by the CUDA index
    read as an NVML index (releases before 1.40; NVIDIA/DALI PR #5566 reads it by UUID) while
    CUDA_VISIBLE_DEVICES remaps the devices: it would then pin the threads to another GPU's socket, so
    they are left to the process's own CPU set (False)."""
    if not devices_remapped():
        return True
    if dali_version is None:
        import nvidia.dali

        dali_version = nvidia.dali.__version__
    try:
        major, minor = (int(x) for x in dali_version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (1, 40)


# Records whose stored sizes set the `mixed` decoder's preallocation hints: spread evenly over the data set,
# more where a read is a view of a map (a packed set), none from a reader that streams remote shards.
SIZE_SAMPLE_VIEWS = 256
SIZE_SAMPLE_FILES = 64


def sample_sizes(reader: Reader) -> list[tuple[int, int]]:
    """The stored (width, height) of records spread evenly over ``reader`` (JPEG and PNG headers; others
    are left out); none from a reader of streamed shards, where a read may fetch a whole shard."""
    if provides(reader, StreamingReader) or len(reader) == 0:
        return []
    count = SIZE_SAMPLE_VIEWS if getattr(reader, "reads_views", False) else SIZE_SAMPLE_FILES
    sizes = []
    for i in np.unique(np.linspace(0, len(reader) - 1, min(count, len(reader))).astype(np.int64)).tolist():
        try:
            size = stored_size(reader[i][0])
        except Exception:  # noqa: BLE001 - a bad record is the feed's to name; here it only has no size
            size = None
        if size is not None:
            sizes.append(size)
    return sizes


@dataclass(frozen=True)
class MixedDecoder:
    """How one pipeline's `mixed` decoder is set up.

    Args:
        threads: the pipeline's threads: nvJPEG's memory paddings are per thread, within fixed budgets.
        hw_load: the share of whole-image JPEG work for the hardware engine (`decode_choice.hw_decoder_load`).
        width_hint: the hardware decoder's preallocation width (`preallocation_hints`; 0: none).
        height_hint: its preallocation height.
        affine: tie the decoding threads to the GPU's CPUs (`decoder_affinity`).
    """

    threads: int
    hw_load: float = HW_DECODER_LOAD
    width_hint: int = 0
    height_hint: int = 0
    affine: bool = True

    @classmethod
    def for_data(cls, threads: int, sizes: Sequence[tuple[int, int]], max_batch: int) -> MixedDecoder:
        """The decoder for a pipeline of ``max_batch`` images drawn from images of ``sizes``: the load from
        the environment (or ours), hints from the sizes, the affinity rule for this process."""
        width, height = preallocation_hints(sizes, max_batch)
        return cls(threads, hw_decoder_load(), width, height, decoder_affinity())

    def arguments(self, roi: bool = False) -> dict[str, Any]:
        """The decoder's arguments: bounded memory paddings, the preallocation hints, the thread affinity;
        for whole images, chroma upsampled the "fancy" way, as DALI's CPU decoder, Pillow and
        `TorchIterator` do (DALI's default for `mixed` is another filter: the same JPEG would train on other
        pixels on a GPU), with ``hw_load`` of the work on the hardware JPEG engine. A crop window (``roi``)
        keeps the GPU decoder's own upsampling: with nvJPEG older than 13.2 nvImageCodec refuses a window
        with fancy upsampling on both its GPU decoders (nvJPEG may get its one-pixel edge wrong) and hands
        it to its CPU decoder."""
        pre = decoder_preallocation(self.threads, gpu=True)
        out: dict[str, Any] = {
            "device_memory_padding": pre["device_padding"],
            "host_memory_padding": pre["host_padding"],
            "affine": self.affine,
        }
        if self.width_hint > 0 and self.height_hint > 0:
            out.update(preallocate_width_hint=self.width_hint, preallocate_height_hint=self.height_hint)
        if not roi:
            out.update(jpeg_fancy_upsampling=True, hw_decoder_load=self.hw_load)
        return out


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
    with warnings.catch_warnings(record=True) as caught, _no_origin_traces():
        out = _auto_augment(images, recipe)
    for w in caught:
        if not str(w.message).startswith("WARNING: `nvidia.dali.fn.experimental."):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


@contextlib.contextmanager
def _no_origin_traces() -> Iterator[None]:
    """DALI records the Python stack of every operator it creates, to name where an operator came from in
    an error. auto_aug creates ``num_ops x 14`` of them (a conditional select over its suite per level), all
    inside DALI's own code, and the stack walks were about half of a RandAugment pipeline's build (0.70 s
    against 0.39 s at num_ops=2, benchmarks/randaugment_build.py): they are off while auto_aug builds, on after."""
    try:
        from nvidia.dali._utils import dali_trace
    except ImportError:
        dali_trace = None
    if not hasattr(dali_trace, "set_tracing"):  # another DALI release: its traces stay on, the build is slower
        yield
        return
    enabled = dali_trace.is_tracing_enabled()
    dali_trace.set_tracing(enabled=False)
    try:
        yield
    finally:
        dali_trace.set_tracing(enabled=enabled)


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
