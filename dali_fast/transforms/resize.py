"""Crop boxes and the resize to the output square: Pillow's bilinear where it matters, at a fraction of its
cost; and `decode_crop`, a record decoded, cropped and resized as the recipe says (TorchIterator's workers).

The random-resized-crop box is drawn here (`random_resized_crop_box`), for every loader. ``bilinear``
(the default) antialiases where antialiasing matters and is plain bilinear interpolation where it
does not:

- an upscale, or a shrink by 2x or more (on either side), goes through torch's antialiased uint8 kernel
  (``_upsample_bilinear2d_aa``), which computes Pillow's filter (a triangle whose support widens with
  the shrink factor) within a few hundredths of a level on average; a plain bilinear would alias on
  such a shrink (it reads 2 of every 3 or more source pixels);
- a shrink under 2x (on both sides) is plain bilinear interpolation (OpenCV's ``INTER_LINEAR``, read
  from the crop where it lies; torch's non-antialiased uint8 kernel, ``upsample_bilinear2d``, where
  OpenCV is missing: the two within a level of each other and of the definition; `.opencv`), in less
  time: each output pixel reads its 2x2 source neighbours, which skips no source pixel, so nothing
  aliases. Pillow widens its triangle there too, a little: on photos the two differ by under a level on
  average (``benchmarks/resize_filters.py``); on pixel-sized noise, by more.

``bicubic`` is always Pillow's antialiased bicubic (torch's ``_upsample_bicubic2d_aa``), ``nearest``
Pillow's centre-sampling nearest neighbour (torch's ``nearest-exact``); ``lanczos`` has no torch
kernel and goes through Pillow. DALI's linear resize antialiases every shrink.

A box in the decoded image's pixel grid is rounded to whole pixels (the decoded image is at full
scale except where a JPEG was decoded at 1/2, 1/4 or 1/8 scale, and then the crop still has twice
the output's resolution, so the rounding moves it by under a quarter of an output pixel).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..data.checks import pillow_reason
from .decode import CorruptJpeg, Decoder
from .draws import SampleDraws
from .opencv import resize_plain_bilinear
from .recipe import Recipe

PIL_RESAMPLE = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "nearest": "NEAREST", "lanczos": "LANCZOS"}
ANTIALIAS_FROM = 2  # shrink factor (on either side) from which ``bilinear`` antialiases


def plain_bilinear(src_hw: tuple[int, int], out_hw: tuple[int, int]) -> bool:
    """Whether ``bilinear`` from ``src_hw`` to ``out_hw`` (height, width) is plain bilinear interpolation: a
    shrink (on one side at least) by less than `ANTIALIAS_FROM` (on both). Upscales and larger shrinks are
    Pillow's filter."""
    shrinks = src_hw[0] > out_hw[0] or src_hw[1] > out_hw[1]
    return shrinks and src_hw[0] < ANTIALIAS_FROM * out_hw[0] and src_hw[1] < ANTIALIAS_FROM * out_hw[1]


def random_resized_crop_box(
    rng: np.random.Generator | SampleDraws, width: int, height: int, scale=Recipe.scale, ratio=Recipe.ratio
) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a random-resized-crop window (the usual 10-attempt algorithm), drawn from ``rng``
    (a numpy generator, or one sample's `SampleDraws`)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def pixel_box(
    box: tuple[float, float, float, float], fx: float, fy: float, width: int, height: int
) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of ``box`` (left, top, right, bottom in displayed pixels) in an image decoded at
    scale (``fx``, ``fy``) of size ``width`` x ``height``, rounded to whole pixels, never empty."""
    x0 = min(max(0, round(box[0] * fx)), width - 1)
    y0 = min(max(0, round(box[1] * fy)), height - 1)
    x1 = min(max(x0 + 1, round(box[2] * fx)), width)
    y1 = min(max(y0 + 1, round(box[3] * fy)), height)
    return x0, y0, x1, y1


def _nchw(hwc: torch.Tensor) -> torch.Tensor:
    return hwc.permute(2, 0, 1).unsqueeze(0)


def resize_into(src: np.ndarray, out: torch.Tensor, interpolation: str = "bilinear") -> None:
    """Resize uint8 HWC RGB ``src`` (any strides, e.g. a crop view) into uint8 ``out`` (H, W, 3), in place,
    by the module's rule for ``interpolation``."""
    height, width = int(out.shape[0]), int(out.shape[1])
    if interpolation == "lanczos":
        from PIL import Image

        im = Image.fromarray(np.ascontiguousarray(src)).resize((width, height), Image.LANCZOS)
        out.copy_(torch.from_numpy(np.asarray(im).copy()))
        return
    plain = interpolation == "bilinear" and plain_bilinear(src.shape[:2], (height, width))
    if plain and resize_plain_bilinear(src, out.numpy()):  # OpenCV's kernel reads the crop where it lies
        return
    # A crop view (rows apart in memory) is copied whole first: torch's uint8 kernels read a contiguous
    # image faster, which more than pays for the copy (on photos, side by side: about a tenth less time
    # per crop at 224 px, a third less at 112, half on 2x+ shrinks; benchmarks/resize_filters.py).
    contiguous = src.flags.c_contiguous and src.flags.writeable
    x = _nchw(torch.from_numpy(src if contiguous else np.array(src, order="C")))
    o = _nchw(out)
    if plain:
        torch.ops.aten.upsample_bilinear2d.out(x, [height, width], False, None, None, out=o)
    elif interpolation == "bilinear":
        torch.ops.aten._upsample_bilinear2d_aa.out(x, [height, width], False, None, None, out=o)
    elif interpolation == "bicubic":
        torch.ops.aten._upsample_bicubic2d_aa.out(x, [height, width], False, None, None, out=o)
    elif interpolation == "nearest":
        torch.ops.aten._upsample_nearest_exact2d.out(x, [height, width], None, None, out=o)
    else:
        raise ValueError(f"interpolation={interpolation!r}: use one of {', '.join(PIL_RESAMPLE)}")


def resize(src: np.ndarray, size: tuple[int, int], interpolation: str = "bilinear") -> torch.Tensor:
    """``src`` (uint8 HWC) resized to ``size`` = (width, height): a new uint8 (height, width, 3) tensor."""
    out = torch.empty((size[1], size[0], 3), dtype=torch.uint8)
    resize_into(src, out, interpolation)
    return out


def eval_resize(width: int, height: int, recipe: Recipe) -> tuple[int, int, int, int]:
    """Eval, in every loader: the size (w, h) the image is resized to, its shorter side
    ``recipe.resize_shorter`` (neither side under ``image_size``), and the centre square's top-left corner
    (x0, y0) in it, rounded half up as DALI's centre crop is."""
    S = recipe.image_size
    scale = recipe.resize_shorter / min(width, height)
    rw, rh = max(S, round(width * scale)), max(S, round(height * scale))
    return rw, rh, (rw - S + 1) // 2, (rh - S + 1) // 2


class BadImage(ValueError):
    """A record the decoder cannot read (the message is the reason, as `pillow_reason` words it)."""


def decode_crop(
    data: bytes | np.ndarray,
    *,
    train: bool,
    recipe: Recipe,
    rng: np.random.Generator | SampleDraws,
    decoder: Decoder | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode one record by the shared rule and crop and resize it as ``recipe`` says: uint8 (S, S, 3) RGB.

    Train: a random-resized-crop box drawn from ``rng``; eval: the shorter side resized to
    ``recipe.resize_shorter``, then the centre square. A JPEG much larger than the output is decoded at
    1/2, 1/4 or 1/8 scale (Pillow's draft rule: the crop keeps twice the output's resolution). Written
    into ``out`` when given (train). Raises `BadImage` for a record that does not decode, or whose JPEG data
    libjpeg-turbo reports damaged (`CorruptJpeg`).
    """
    S = recipe.image_size
    decoder = decoder if decoder is not None else Decoder()
    try:
        opened = decoder.open(data)
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
        raise BadImage(pillow_reason(e)) from None
    width, height = opened.width, opened.height
    if train:
        left, top, w, h = random_resized_crop_box(rng, width, height, recipe.scale, recipe.ratio)
        need = (max(1, math.ceil(width * S / w)), max(1, math.ceil(height * S / h)))
    else:
        scale = recipe.resize_shorter / min(width, height)
        need = (max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale)))
    try:
        pixels = opened.decode(need)
    except CorruptJpeg as e:  # damage libjpeg-turbo reported: the reason is in its words
        raise BadImage(str(e)) from None
    except Exception as e:  # noqa: BLE001 - as above: the decoders' verdict on the record
        raise BadImage(pillow_reason(e)) from None
    if train:
        fx, fy = pixels.shape[1] / width, pixels.shape[0] / height
        x0, y0, x1, y1 = pixel_box((left, top, left + w, top + h), fx, fy, pixels.shape[1], pixels.shape[0])
        out = out if out is not None else torch.empty((S, S, 3), dtype=torch.uint8)
        resize_into(pixels[y0:y1, x0:x1], out, recipe.interpolation)
        return out
    rw, rh, x0, y0 = eval_resize(width, height, recipe)
    full = resize(pixels, (rw, rh), recipe.interpolation)
    return full[y0 : y0 + S, x0 : x0 + S]
