"""Per-sample random draws, each a pure function of (seed, epoch, index): the same whatever batch, worker,
backend or resume draws it. `sample_uniforms` is a counter-based generator whose batch draws are a few
array operations. The random-erasing boxes (torchvision's `RandomErasing` rule) are drawn from it, for a
batch (`erasing_boxes`, DALI's source) or one sample (`sample_erasing_box`, TorchIterator's workers), with
the same result; so are TorchIterator's crop and flip (`crop_draws`, used through `SampleDraws`).
`sample_rng` seeds a numpy generator for one sample's choices (its automatic-augmentation policy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .recipe import CROP_SALT, ERASING_SALT, Recipe


def erasing_box(rng: np.random.Generator, height: int, width: int, recipe: Recipe) -> tuple[int, int, int, int]:
    """(top, left, h, w) of the random-erasing box of one image, or (0, 0, 0, 0) for none.

    torchvision's `RandomErasing` rule: with probability ``recipe.random_erasing``, up to 10 tries of a
    box of area ``erasing_scale`` x H x W and aspect ``erasing_ratio`` (log-uniform), rounded to whole
    pixels; the first that fits strictly inside the image is taken, else nothing is erased.
    """
    if recipe.random_erasing <= 0 or rng.random() >= recipe.random_erasing:
        return 0, 0, 0, 0
    area = height * width
    log_ratio = (math.log(recipe.erasing_ratio[0]), math.log(recipe.erasing_ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*recipe.erasing_scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        h = round(math.sqrt(target * aspect))
        w = round(math.sqrt(target / aspect))
        if 0 < h < height and 0 < w < width:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    return 0, 0, 0, 0


ERASING_TRIES = 10  # torchvision's RandomErasing tries this many boxes before it gives up


def erasing_boxes(recipe: Recipe, seed: int, epoch: int, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """The random-erasing boxes of samples ``indices`` in ``epoch``, drawn for the whole batch at once:
    an int64 array of rows (top, left, h, w) on the ``image_size`` square output, zeros for no box.

    The rule of `erasing_box` (torchvision's): with probability ``random_erasing``, the first of up to
    ten boxes of area ``erasing_scale`` and log-uniform aspect ``erasing_ratio`` that fits strictly
    inside, at a uniform position. Its random numbers come from `sample_uniforms`, so a sample's box is
    a pure function of (seed, epoch, index): the same whatever batch it is drawn in, and the same in
    every backend (DALI's source draws a batch; TorchIterator's workers draw one sample's with
    `sample_erasing_box`). A batch is a few array operations; a few samples take a plain-Python path
    that does the same arithmetic in the same order (bit-identical results, a test holds them to it).
    """
    index = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(index) < 4:  # numpy's per-call cost would dominate
        return np.array([_erasing_box_of(recipe, seed, epoch, i) for i in index.tolist()], np.int64).reshape(-1, 4)
    S, tries = recipe.image_size, ERASING_TRIES
    u = sample_uniforms(seed, epoch, index, ERASING_SALT, 3 + 2 * tries)  # apply, top, left, scales, ratios
    boxes = np.zeros((len(index), 4), dtype=np.int64)
    low, high = recipe.erasing_scale
    rows = np.flatnonzero(u[:, 0] < recipe.random_erasing)  # the samples that get a box, if one fits
    for t in range(tries):  # each try only for the samples whose earlier tries did not fit
        if not len(rows):
            break
        target = S * S * (low + (high - low) * u[rows, 3 + t])
        aspect = np.array([math.exp(x) for x in _log_aspects(recipe, u[rows, 3 + tries + t]).tolist()])
        h = np.rint(np.sqrt(target * aspect)).astype(np.int64)  # rint: halves to even, as Python's round()
        w = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        fit = (h > 0) & (h < S) & (w > 0) & (w < S)
        done, h, w = rows[fit], h[fit], w[fit]
        boxes[done, 0] = np.floor(u[done, 1] * (S - h + 1))
        boxes[done, 1] = np.floor(u[done, 2] * (S - w + 1))
        boxes[done, 2], boxes[done, 3] = h, w
        rows = rows[~fit]
    return boxes


def _log_aspects(recipe: Recipe, u: Any) -> Any:
    """Log-uniform aspects from uniforms ``u`` (a float or an array), by `erasing_ratio`."""
    log_low, log_high = math.log(recipe.erasing_ratio[0]), math.log(recipe.erasing_ratio[1])
    return log_low + (log_high - log_low) * u


def _erasing_box_of(recipe: Recipe, seed: int, epoch: int, index: int) -> tuple[int, int, int, int]:
    """One sample's box: `erasing_boxes`' arithmetic, in the same order, on Python floats."""
    S, tries = recipe.image_size, ERASING_TRIES
    if not sample_uniforms(seed, epoch, index, ERASING_SALT, 1)[0] < recipe.random_erasing:
        return 0, 0, 0, 0  # the first draw alone decides that there is no box
    u = sample_uniforms(seed, epoch, index, ERASING_SALT, 3 + 2 * tries)
    low, high = recipe.erasing_scale
    for t in range(tries):
        target = S * S * (low + (high - low) * u[3 + t])
        aspect = math.exp(_log_aspects(recipe, u[3 + tries + t]))
        h, w = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < h < S and 0 < w < S:
            return math.floor(u[1] * (S - h + 1)), math.floor(u[2] * (S - w + 1)), h, w
    return 0, 0, 0, 0


def sample_erasing_box(recipe: Recipe, seed: int, epoch: int, index: int) -> tuple[int, int, int, int]:
    """Sample ``index``'s erasing box in ``epoch``: one row of `erasing_boxes`."""
    top, left, h, w = erasing_boxes(recipe, seed, epoch, [index])[0].tolist()
    return top, left, h, w


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / the golden ratio


def _mix64(z: Any) -> Any:
    """SplitMix64's finalizer, a bijective scramble of 64-bit words: on a Python int, or on a uint64
    array (whose arithmetic wraps by itself), with the same result."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
    return z ^ (z >> 31)


def sample_uniforms(
    seed: int, epoch: int, indices: int | np.ndarray, salt: int, count: int
) -> list[float] | np.ndarray:
    """``count`` uniform floats in [0, 1) per sample: a counter-based generator (SplitMix64 over the key
    (seed, epoch, salt), the index and the draw number), so each sample's draws are the same whatever
    else is drawn with it, and a batch's are a few array operations. ``indices``: an int64 array (gives
    an array (len(indices), count)) or one int (gives a list). ``salt`` separates independent uses."""
    key = _mix64(_mix64((seed & 0xFFFFFFFF) << 32 | (epoch & 0xFFFFFFFF)) ^ (salt * _GOLDEN & _M64))
    if isinstance(indices, int):
        stream = _mix64(key ^ _mix64(indices * _GOLDEN & _M64))
        return [(_mix64(stream + j * _GOLDEN & _M64) >> 11) * 2.0**-53 for j in range(1, count + 1)]
    index = np.asarray(indices, dtype=np.int64).astype(np.uint64)
    stream = _mix64(np.uint64(key) ^ _mix64(index * np.uint64(_GOLDEN)))
    draws = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    bits = _mix64(stream[:, None] + draws[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_rng(seed: int, epoch: int, index: int, salt: int | None = None) -> np.random.Generator:
    """The generator of one sample's random choices in one epoch (``salt`` separates independent draws)."""
    key = [seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, index & 0xFFFFFFFFFFFF]
    return np.random.default_rng(key if salt is None else [*key, salt])


CROP_DRAWS = 2 * 10 + 2 + 1  # a random-resized crop's ten tries (scale, aspect), its position, and the flip


def crop_draws(seed: int, epoch: int, indices: Sequence[int] | np.ndarray) -> list[list[float]]:
    """The uniforms of each sample's crop and flip in ``epoch`` (`CROP_DRAWS` per sample), for a batch at
    once: one row per index, each a pure function of (seed, epoch, index). Use a row through `SampleDraws`."""
    index = np.asarray(indices, dtype=np.int64).reshape(-1)
    return sample_uniforms(seed, epoch, index, CROP_SALT, CROP_DRAWS).tolist()  # type: ignore[union-attr]


class SampleDraws:
    """One sample's uniforms in [0, 1), taken in turn by the calls the crop and flip make of a numpy
    `Generator` (``uniform``, ``integers``, ``random``): the crop box's rule unchanged, and a few
    microseconds per sample where seeding a generator cost about 45 (measured in the decode workers).
    Raises IndexError when more are asked for than it holds."""

    __slots__ = ("_u", "_k")

    def __init__(self, uniforms: Sequence[float]) -> None:
        self._u, self._k = uniforms, 0

    def random(self) -> float:
        """The next uniform in [0, 1)."""
        value = self._u[self._k]
        self._k += 1
        return value

    def uniform(self, low: float, high: float) -> float:
        """Uniform in [low, high)."""
        return low + (high - low) * self.random()

    def integers(self, low: int, high: int) -> int:
        """Uniform integer in [low, high)."""
        return low + min(int(self.random() * (high - low)), high - low - 1)
