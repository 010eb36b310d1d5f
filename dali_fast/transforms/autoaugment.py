"""RandAugment, TrivialAugmentWide and AutoAugment (ImageNet policy) on Pillow images.

The Pillow-side twin of `nvidia.dali.auto_aug`, for `TorchIterator` and the baseline DataLoader.
torchvision's ``transforms.v2`` has these, but torchvision wheels are built against one torch
release each and do not import beside every torch we support, so the policies live here: the
operations and magnitude tables of torchvision's implementation (``torchvision/transforms/
autoaugment.py``), applied with Pillow (as timm does), every random choice drawn from a numpy
generator so a sample's augmentation is a pure function of (seed, epoch, index).
Geometric operations fill uncovered pixels with ``fill`` (DALI's default, 128).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

Magnitudes = Callable[[int, int, int], np.ndarray]  # (bins, height, width) -> magnitude per bin

_RESAMPLE = Image.NEAREST  # torchvision's default for these ops


def _shear_x(im: Image.Image, m: float, fill: int) -> Image.Image:
    return im.transform(im.size, Image.AFFINE, (1, m, 0, 0, 1, 0), _RESAMPLE, fillcolor=(fill,) * 3)


def _shear_y(im: Image.Image, m: float, fill: int) -> Image.Image:
    return im.transform(im.size, Image.AFFINE, (1, 0, 0, m, 1, 0), _RESAMPLE, fillcolor=(fill,) * 3)


def _translate_x(im: Image.Image, m: float, fill: int) -> Image.Image:
    return im.transform(im.size, Image.AFFINE, (1, 0, -int(m), 0, 1, 0), _RESAMPLE, fillcolor=(fill,) * 3)


def _translate_y(im: Image.Image, m: float, fill: int) -> Image.Image:
    return im.transform(im.size, Image.AFFINE, (1, 0, 0, 0, 1, -int(m)), _RESAMPLE, fillcolor=(fill,) * 3)


def _rotate(im: Image.Image, m: float, fill: int) -> Image.Image:
    return im.rotate(m, _RESAMPLE, fillcolor=(fill,) * 3)


def _enhance(kind: type) -> Callable[[Image.Image, float, int], Image.Image]:
    return lambda im, m, fill: kind(im).enhance(1.0 + m)


OPS: dict[str, Callable[[Image.Image, float, int], Image.Image]] = {
    "Identity": lambda im, m, fill: im,
    "ShearX": _shear_x,
    "ShearY": _shear_y,
    "TranslateX": _translate_x,
    "TranslateY": _translate_y,
    "Rotate": _rotate,
    "Brightness": _enhance(ImageEnhance.Brightness),
    "Color": _enhance(ImageEnhance.Color),
    "Contrast": _enhance(ImageEnhance.Contrast),
    "Sharpness": _enhance(ImageEnhance.Sharpness),
    "Posterize": lambda im, m, fill: ImageOps.posterize(im, int(m)),
    "Solarize": lambda im, m, fill: ImageOps.solarize(im, m),
    "AutoContrast": lambda im, m, fill: ImageOps.autocontrast(im),
    "Equalize": lambda im, m, fill: ImageOps.equalize(im),
    "Invert": lambda im, m, fill: ImageOps.invert(im),
}


def _space(
    shear: float, translate: Callable[[int, int], tuple[float, float]], rotate: float, enhance: float, bits: int
):
    """An augmentation space: op -> (magnitudes(bins, h, w) or None for none, signed)."""

    def lin(top: float) -> Magnitudes:
        return lambda bins, h, w: np.linspace(0.0, top, bins)

    return {
        "Identity": (None, False),
        "ShearX": (lin(shear), True),
        "ShearY": (lin(shear), True),
        "TranslateX": (lambda bins, h, w: np.linspace(0.0, translate(h, w)[1], bins), True),
        "TranslateY": (lambda bins, h, w: np.linspace(0.0, translate(h, w)[0], bins), True),
        "Rotate": (lin(rotate), True),
        "Brightness": (lin(enhance), True),
        "Color": (lin(enhance), True),
        "Contrast": (lin(enhance), True),
        "Sharpness": (lin(enhance), True),
        "Posterize": (lambda bins, h, w: 8 - np.round(np.arange(bins) / ((bins - 1) / bits)).astype(int), False),
        "Solarize": (lambda bins, h, w: np.linspace(255.0, 0.0, bins), False),
        "AutoContrast": (None, False),
        "Equalize": (None, False),
    }


# torchvision's tables: RandAugment and AutoAugment translate by up to 150/331 of the side, TrivialAugmentWide by 32 px.
RAND_SPACE = _space(0.3, lambda h, w: (150.0 / 331.0 * h, 150.0 / 331.0 * w), 30.0, 0.9, 4)
WIDE_SPACE = _space(0.99, lambda h, w: (32.0, 32.0), 135.0, 0.99, 6)
AUTO_SPACE = {**RAND_SPACE, "Invert": (None, False)}

IMAGENET_POLICY = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
    (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
    (("Color", 0.4, 0), ("Equalize", 0.6, None)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
)
AUTO_BINS = 10  # AutoAugment's policy magnitudes index 10 bins


def _apply(im: Image.Image, space: dict, name: str, bin_: int | None, bins: int, rng: np.random.Generator, fill: int):
    table, signed = space[name]
    magnitude = 0.0 if table is None or bin_ is None else float(table(bins, im.height, im.width)[bin_])
    if signed and rng.random() < 0.5:
        magnitude = -magnitude
    return OPS[name](im, magnitude, fill)


def rand_augment(im: Image.Image, rng: np.random.Generator, n: int, m: int, bins: int = 31, fill: int = 128):
    """RandAugment (Cubuk et al., 2020): ``n`` ops drawn uniformly, each at magnitude bin ``m`` of ``bins``."""
    names = list(RAND_SPACE)
    for _ in range(n):
        im = _apply(im, RAND_SPACE, names[int(rng.integers(len(names)))], m, bins, rng, fill)
    return im


def trivial_augment_wide(im: Image.Image, rng: np.random.Generator, bins: int = 31, fill: int = 128):
    """TrivialAugmentWide (Müller & Hutter, 2021): one op, at a magnitude bin drawn uniformly."""
    names = list(WIDE_SPACE)
    name = names[int(rng.integers(len(names)))]
    bin_ = int(rng.integers(bins)) if WIDE_SPACE[name][0] is not None else None
    return _apply(im, WIDE_SPACE, name, bin_, bins, rng, fill)


def auto_augment_imagenet(im: Image.Image, rng: np.random.Generator, fill: int = 128):
    """AutoAugment's ImageNet policy (Cubuk et al., 2019): one sub-policy of two ops, each with its probability."""
    for name, p, bin_ in IMAGENET_POLICY[int(rng.integers(len(IMAGENET_POLICY)))]:
        if rng.random() <= p:
            im = _apply(im, AUTO_SPACE, name, bin_, AUTO_BINS, rng, fill)
    return im


def apply_policy(image: np.ndarray, recipe, rng: np.random.Generator) -> np.ndarray:
    """``recipe.auto_augment`` on one uint8 HWC RGB image; the image itself when it is None."""
    if recipe.auto_augment is None:
        return image
    im = Image.fromarray(image)
    if recipe.auto_augment == "randaugment":
        im = rand_augment(im, rng, recipe.num_ops, recipe.magnitude, recipe.num_magnitude_bins, recipe.fill)
    elif recipe.auto_augment == "trivialaugment":
        im = trivial_augment_wide(im, rng, recipe.num_magnitude_bins, recipe.fill)
    else:
        im = auto_augment_imagenet(im, rng, recipe.fill)
    return np.asarray(im, dtype=np.uint8)


__all__ = ["apply_policy", "rand_augment", "trivial_augment_wide", "auto_augment_imagenet"]
