"""The DALI side of the recipe: the operators after the external source (`augment`: decode, crop, resize,
automatic augmentation, flip, normalize, erase; training decodes as `decode_choice` says, a GPU's decoder
is set up as `mixed_decoder.MixedDecoder` says), and DALI's host buffers from its pool
(`pool_host_buffers`). DALI is imported inside the functions, so importing this module needs no DALI.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch

from .decode_choice import choose_train_decode
from .mixed_decoder import MixedDecoder
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
