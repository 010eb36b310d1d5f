"""Batch operations on the tensor's own device, with no host synchronization: uint8 images to the recipe's
dtype and layout, normalized and erased (`finish_batch`), mirrored (`normalize_flip`), and a uint8 batch
normalized where it arrives (`normalize_images`), and a batch's labels or target rows copied to a GPU
without waiting (`to_device`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from .opencv import normalize_into
from .recipe import ERASING_FILL_255, IMAGENET_MEAN, IMAGENET_STD, Recipe


@functools.lru_cache(maxsize=16)
def _normalization(
    device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean`` and 1/``std`` as (1, 3, 1, 1) float32 tensors on ``device``, made once per device and recipe."""
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    inv_std = 1.0 / torch.tensor(std, device=device).view(1, 3, 1, 1)
    return mean_t, inv_std


def erase_boxes(x: torch.Tensor, boxes: torch.Tensor, fill: tuple[float, ...] = (0.0, 0.0, 0.0)) -> torch.Tensor:
    """Fill each sample's (top, left, h, w) box of NCHW ``x`` with ``fill`` (per channel), in place,
    without a host sync."""
    boxes = boxes.to(x.device, non_blocking=True)
    rows = torch.arange(x.shape[-2], device=x.device).view(1, -1, 1)
    cols = torch.arange(x.shape[-1], device=x.device).view(1, 1, -1)
    top, left, h, w = (boxes[:, k].view(-1, 1, 1) for k in range(4))
    inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
    if not any(fill):
        return x.masked_fill_(inside.unsqueeze(1), 0)
    for c, value in enumerate(fill):
        x[:, c].masked_fill_(inside, value)
    return x


def finish_batch(
    images: torch.Tensor,
    dtype: torch.dtype,
    memory_format: torch.memory_format = torch.contiguous_format,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    boxes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    fill: tuple[float, ...] = ERASING_FILL_255,
) -> torch.Tensor:
    """uint8 NCHW ``images`` (any strides: an NHWC slot's permuted view too) → a ``dtype`` tensor in
    ``memory_format``, normalized by ``mean``/``std`` (0–255 scale; None: left as is), erased in ``boxes``
    with the mean pixel (0 when normalized, ``fill`` when not: `Recipe.erasing_fill`'s rule);
    written into ``out`` when given (of that shape, dtype and format, e.g. reused by the caller), else new.

    Batched ops on the tensor's device, with no host synchronization. On the CPU, float32 in contiguous
    memory is one OpenCV multiply-add per pixel (`.opencv.normalize_into`); otherwise the conversion and
    the two normalizing passes run a few images at a time, so the second and third passes read what the
    first just wrote from the core's cache instead of memory (measured: a quarter less CPU time in the
    main process than whole-batch passes). The result never shares memory with ``images`` (a slot is
    reused right after).
    """
    if mean is None or std is None:
        x = images.to(dtype, memory_format=memory_format, copy=True) if out is None else out.copy_(images)
        return x if boxes is None else erase_boxes(x, boxes, fill)
    mean_t, inv_std = _normalization(images.device, tuple(mean), tuple(std))
    if images.is_cuda:
        x = images.to(torch.float32, memory_format=memory_format, copy=True)
        x.sub_(mean_t).mul_(inv_std)
        x = x if dtype == torch.float32 else x.to(dtype)
        x = x if out is None else out.copy_(x)
    else:
        x = torch.empty(images.shape, dtype=dtype, memory_format=memory_format) if out is None else out
        if normalize_into(images.numpy(), x.numpy(), mean, std):  # OpenCV: uint8 to float32, contiguous
            return x if boxes is None else erase_boxes(x, boxes)
        per_image = 4 * images[0].numel() if len(images) else 1
        step = max(1, _CACHE_CHUNK // per_image)
        work = x if dtype == torch.float32 else torch.empty((min(step, len(images)), *images.shape[1:]))
        for i in range(0, len(images), step):
            part = images[i : i + step]
            chunk = x[i : i + step] if dtype == torch.float32 else work[: len(part)]
            chunk.copy_(part)
            chunk.sub_(mean_t).mul_(inv_std)
            if dtype != torch.float32:
                x[i : i + step].copy_(chunk)
    return x if boxes is None else erase_boxes(x, boxes)


_CACHE_CHUNK = 1 << 20  # bytes of float32 per step of the CPU conversion: well inside a core's L2 cache


def normalize_flip(
    images: torch.Tensor,
    flips: torch.Tensor,
    dtype: torch.dtype,
    memory_format: torch.memory_format = torch.contiguous_format,
    mean: tuple[float, ...] | None = IMAGENET_MEAN,
    std: tuple[float, ...] | None = IMAGENET_STD,
    boxes: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 NHWC → NCHW ``dtype``, mirrored where ``flips``, normalized by ``mean``/``std`` (0–255 scale;
    None: left unnormalized), erased in ``boxes``; batched ops on the tensor's device.

    No host synchronization: the mirror is a `torch.where` whether or not any sample flips.
    ``memory_format=torch.channels_last`` keeps the NHWC storage (the NCHW result is a view of it).
    (`TorchIterator`'s workers mirror each image themselves and the batch goes through `finish_batch`.)
    """
    flips = flips.to(images.device, non_blocking=True)
    images = torch.where(flips.view(-1, 1, 1, 1), images.flip(2), images)  # mirror on uint8: 4x less memory
    return finish_batch(images.permute(0, 3, 1, 2), dtype, memory_format, mean, std, boxes)


def normalize_images(
    images: torch.Tensor, recipe: Recipe | None = None, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A loader's uint8 batch (``dtype=torch.uint8``) normalized on its own device, as the loader would have.

    Args:
        images: uint8 NCHW images (any memory format: channels_last stays channels_last), on any device,
            typically the GPU after a copy of a quarter of the bytes of a float batch.
        recipe: the loader's recipe, whose ``mean`` and ``std`` apply (None: the default recipe's, ImageNet's).
        dtype: torch.float32 or torch.float16.

    Returns:
        A new tensor of ``dtype`` on the same device, ``(x - mean) / std`` per channel (0-1 scale statistics on
        0-255 pixels); an erased box (the recipe's mean pixel) comes out at about 0.
    """
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(
            f"images of dtype {images.dtype} and shape {tuple(images.shape)}: pass a loader's uint8 NCHW batch "
            "(N, 3, H, W)"
        )
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype={dtype}: use torch.float32 or torch.float16")
    recipe = recipe if recipe is not None else Recipe()
    if recipe.mean is None:
        raise ValueError(
            "the recipe has mean=None: it has no normalization to apply; pass the recipe with its mean/std"
        )
    channels_last = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return finish_batch(images, dtype, fmt, recipe.mean_255, recipe.std_255)


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the enclosed torch CPU ops on one thread, then restore the setting.

    The batch's conversion is a few memory-bound passes; spread over torch's intra-op threads while the
    decode workers hold every core, its threads wait on each other at each op's barrier, and the main
    process spent twice the CPU time per batch (measured: 0.47 against 0.21 ms per image on 2 cores).
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``rows`` (labels or target rows, on the CPU) on ``device``. To a GPU through page-locked memory, so
    the copy is asynchronous: from pageable memory a ``non_blocking`` copy is staged by the host and waits.
    torch's pinned-memory pool keeps the page-locked copy until the transfer has finished."""
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)
