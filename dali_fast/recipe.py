"""Training recipes: the per-image transforms both loaders apply (`Recipe`), and mixup/cutmix on a batch.

`Recipe` is one frozen object that `DALIIterator`, `TorchIterator`, the baseline `DataLoader`,
`make_loader`, ``bench`` and ``train`` all read, so every backend crops, augments and normalizes the
same way. The default ``Recipe()`` is the classic ResNet recipe (random-resized-crop 0.08–1, flip,
ImageNet mean/std; eval: resize to 1/0.875 of the size, centre crop)::

    deit = Recipe(interpolation="bicubic", auto_augment="randaugment", magnitude=9, random_erasing=0.25)
    loader = DALIIterator(open_dataset("train"), 256, recipe=deit)

Per image, in order: crop and resize to ``image_size`` → automatic augmentation (train) → flip →
normalize (or stay uint8) → random erasing (train, on the normalized image, filled with 0).

`MixupCutmix` works on any ``(images, labels)`` batch, from our loaders or a plain DataLoader, on the
batch's own device, and is reproducible from a seed (one generator, on the CPU, draws every choice)::

    mix = MixupCutmix(alpha_mixup=0.8, alpha_cutmix=1.0, label_smoothing=0.1, num_classes=1000, seed=0)
    for images, labels in loader:
        images, targets = mix(images, labels)      # targets: (N, num_classes), rows sum to 1
        loss = soft_target_cross_entropy(model(images), targets)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

AUTO_AUGMENTS = ("randaugment", "trivialaugment", "autoaugment")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "lanczos")
IMAGENET_MEAN_01 = (0.485, 0.456, 0.406)
IMAGENET_STD_01 = (0.229, 0.224, 0.225)
OUT_DTYPES = (torch.float32, torch.float16, torch.uint8)
MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last)
# Salts of the per-sample generators: the crop and flip use (seed, epoch, index); these draw apart from
# them, so turning an augmentation on leaves the crops and flips of the default recipe as they were.
AUGMENT_SALT, ERASING_SALT = 1, 2


def _pair(name: str, value: Any, low: float, high: float | None = None) -> tuple[float, float]:
    """A (min, max) pair with low <(=) min <= max (<= high), else a one-line ValueError."""
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: give two numbers (min, max)") from None
    top = "" if high is None else f" <= {high:g}"
    if not (math.isfinite(a) and math.isfinite(b) and low < a <= b and (high is None or b <= high)):
        raise ValueError(f"{name}={value!r}: need {low:g} < min <= max{top}")
    return a, b


@dataclass(frozen=True)
class Recipe:
    """The per-image transform of a loader, shared by every backend.

    Train: random-resized-crop of ``scale`` (share of the area) and ``ratio`` (width/height), resized to
    ``image_size`` with ``interpolation``; ``auto_augment`` (``None``, ``"randaugment"`` with ``num_ops``
    and ``magnitude`` out of ``num_magnitude_bins``, ``"trivialaugment"`` (TrivialAugmentWide) or
    ``"autoaugment"`` (the ImageNet policy)), geometric ops filling with ``fill``; horizontal flip with
    probability ``hflip``; normalization by ``mean``/``std`` (0–1 scale, per RGB channel); random erasing
    with probability ``random_erasing`` of a box of ``erasing_scale`` of the area and ``erasing_ratio``
    aspect (torchvision's `RandomErasing` rule), filled with 0.
    Eval: resize the shorter side to ``eval_resize_size`` (default ``round(image_size /
    eval_crop_fraction)``), centre crop ``image_size``; no augmentation.
    ``mean=None, std=None`` gives uint8 output that the model normalizes itself. ``dtype`` defaults
    to float32 (uint8 without mean/std); ``memory_format=torch.channels_last`` gives NCHW views of NHWC.
    """

    image_size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_crop_fraction: float = 0.875
    eval_resize_size: int | None = None
    interpolation: str = "bilinear"
    hflip: float = 0.5
    auto_augment: str | None = None
    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    fill: int = 128
    random_erasing: float = 0.0
    erasing_scale: tuple[float, float] = (0.02, 1 / 3)
    erasing_ratio: tuple[float, float] = (0.3, 3.3)
    mean: tuple[float, ...] | None = IMAGENET_MEAN_01
    std: tuple[float, ...] | None = IMAGENET_STD_01
    dtype: torch.dtype | None = None
    memory_format: torch.memory_format = field(default=torch.contiguous_format)

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")

        def probability(name: str, value: Any) -> None:
            if not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r}: must be a probability in [0, 1]")

        positive_int("image_size", self.image_size)
        object.__setattr__(self, "scale", _pair("scale", self.scale, 0, 1))
        object.__setattr__(self, "ratio", _pair("ratio", self.ratio, 0))
        if not isinstance(self.eval_crop_fraction, int | float) or not 0 < self.eval_crop_fraction <= 1:
            raise ValueError(f"eval_crop_fraction={self.eval_crop_fraction!r}: must be in (0, 1]")
        if self.eval_resize_size is not None:
            positive_int("eval_resize_size", self.eval_resize_size)
            if self.eval_resize_size < self.image_size:
                raise ValueError(
                    f"eval_resize_size={self.eval_resize_size} is smaller than image_size={self.image_size}: "
                    "the centre crop would not fit"
                )
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation={self.interpolation!r}: use one of {', '.join(INTERPOLATIONS)}")
        probability("hflip", self.hflip)
        if self.auto_augment is not None and self.auto_augment not in AUTO_AUGMENTS:
            raise ValueError(f"auto_augment={self.auto_augment!r}: use None, {', '.join(map(repr, AUTO_AUGMENTS))}")
        positive_int("num_ops", self.num_ops)
        positive_int("num_magnitude_bins", self.num_magnitude_bins)
        if (
            isinstance(self.magnitude, bool)
            or not isinstance(self.magnitude, int | np.integer)
            or not (0 <= self.magnitude < self.num_magnitude_bins)
        ):
            raise ValueError(f"magnitude={self.magnitude!r}: must be an integer in [0, num_magnitude_bins - 1]")
        if isinstance(self.fill, bool) or not isinstance(self.fill, int | np.integer) or not 0 <= self.fill <= 255:
            raise ValueError(f"fill={self.fill!r}: must be an integer in [0, 255]")
        probability("random_erasing", self.random_erasing)
        object.__setattr__(self, "erasing_scale", _pair("erasing_scale", self.erasing_scale, 0, 1))
        object.__setattr__(self, "erasing_ratio", _pair("erasing_ratio", self.erasing_ratio, 0))
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std: give both (0-1 scale, one per channel) or neither (uint8 output)")
        if self.mean is not None:
            mean, std = tuple(float(m) for m in self.mean), tuple(float(s) for s in self.std)
            if len(mean) != len(std) or len(mean) != 3:
                raise ValueError(f"mean has {len(mean)} values and std {len(std)}: give one per RGB channel (3 each)")
            if not all(math.isfinite(m) for m in mean) or not all(math.isfinite(s) and s > 0 for s in std):
                raise ValueError(f"mean={self.mean!r}, std={self.std!r}: need finite means and std > 0")
            object.__setattr__(self, "mean", mean)
            object.__setattr__(self, "std", std)
        if self.dtype is not None and self.dtype not in OUT_DTYPES:
            raise ValueError(f"dtype={self.dtype}: use torch.float32, torch.float16 or torch.uint8")
        if self.dtype == torch.uint8 and self.mean is not None:
            raise ValueError("dtype=torch.uint8 holds unnormalized pixels: pass mean=None, std=None with it")
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"memory_format={self.memory_format}: use torch.contiguous_format or torch.channels_last")

    # ------------------------------------------------------------------ what the backends read
    @property
    def out_dtype(self) -> torch.dtype:
        """The output dtype: ``dtype``, else float32 when normalizing and uint8 when not."""
        if self.dtype is not None:
            return self.dtype
        return torch.float32 if self.mean is not None else torch.uint8

    @property
    def normalize(self) -> bool:
        return self.mean is not None

    @property
    def mean_255(self) -> tuple[float, ...]:
        """The mean on the 0–255 scale of decoded pixels (0 when not normalizing)."""
        return tuple(m * 255 for m in self.mean) if self.mean is not None else (0.0, 0.0, 0.0)

    @property
    def std_255(self) -> tuple[float, ...]:
        return tuple(s * 255 for s in self.std) if self.std is not None else (1.0, 1.0, 1.0)

    @property
    def resize_shorter(self) -> int:
        """Eval: the shorter side before the centre crop."""
        if self.eval_resize_size is not None:
            return int(self.eval_resize_size)
        return round(self.image_size / self.eval_crop_fraction)

    def with_(self, **changes: Any) -> Recipe:
        """A copy with ``changes`` (checked like a new recipe)."""
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """The recipe as plain JSON-able values (for results, logs and checkpoint configs)."""
        out = asdict(self)
        out["dtype"] = str(self.out_dtype).replace("torch.", "")
        out["memory_format"] = "channels_last" if self.memory_format == torch.channels_last else "contiguous"
        for k in ("scale", "ratio", "erasing_scale", "erasing_ratio", "mean", "std"):
            if out[k] is not None:
                out[k] = list(out[k])
        return out


def resolve_recipe(
    recipe: Recipe | None,
    *,
    image_size: int | None = None,
    dtype: torch.dtype | None = None,
    memory_format: torch.memory_format | None = None,
) -> Recipe:
    """The loader's recipe: ``recipe`` (or the default), with the loader's own ``image_size``/``dtype``/
    ``memory_format`` arguments; giving one both ways with different values is a one-line ValueError."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"recipe={recipe!r}: pass a dali_fast.Recipe (or None for the default)")
    base = recipe if recipe is not None else Recipe()
    changes: dict[str, Any] = {}
    for name, value in (("image_size", image_size), ("dtype", dtype), ("memory_format", memory_format)):
        if value is None:
            continue
        current = base.out_dtype if name == "dtype" else getattr(base, name)
        if recipe is not None and value != current:
            raise ValueError(f"{name}={value} disagrees with the recipe's {name}={current}; set it in the recipe only")
        changes[name] = value
    return replace(base, **changes) if changes else base


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


class MixupCutmix:
    """Batch-level mixup (Zhang et al., 2018) and cutmix (Yun et al., 2019) with label smoothing.

    With probability ``prob`` a batch is mixed with its own reversal (sample i with sample N-1-i): by
    cutmix with probability ``switch_prob`` when both are on, else by mixup. Mixup blends the images with
    weight lam ~ Beta(alpha_mixup, alpha_mixup); cutmix pastes a box of area (1 - lam) x H x W, lam ~
    Beta(alpha_cutmix, alpha_cutmix), clipped to the image, and then sets lam to the area actually kept.
    Targets are ``lam * onehot(y) + (1 - lam) * onehot(y_reversed)``, smoothed by ``label_smoothing``.
    ``last`` records the last batch's choice: ``{"mode": "mixup"|"cutmix"|"none", "lam": ..., "box": ...}``.
    """

    def __init__(
        self,
        alpha_mixup: float = 0.8,
        alpha_cutmix: float = 1.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
        seed: int = 0,
    ) -> None:
        for name, value in (("alpha_mixup", alpha_mixup), ("alpha_cutmix", alpha_cutmix)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value}: must be >= 0 (0 turns it off)")
        for name, value in (("prob", prob), ("switch_prob", switch_prob), ("label_smoothing", label_smoothing)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}={value}: must be in [0, 1]")
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes={num_classes!r}: must be a positive integer")
        self.alpha_mixup, self.alpha_cutmix = float(alpha_mixup), float(alpha_cutmix)
        self.prob, self.switch_prob = float(prob), float(switch_prob)
        self.label_smoothing, self.num_classes = float(label_smoothing), num_classes
        self.rng = np.random.default_rng(seed)
        self.last: dict = {}

    def targets(self, labels: torch.Tensor, lam: float) -> torch.Tensor:
        """Soft targets for a batch mixed with its reversal at weight ``lam``, smoothed."""
        off = self.label_smoothing / self.num_classes
        on = 1.0 - self.label_smoothing + off
        onehot = torch.full((len(labels), self.num_classes), off, device=labels.device)
        onehot.scatter_(1, labels.view(-1, 1).long(), on)
        return lam * onehot + (1.0 - lam) * onehot.flip(0)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix a batch; returns (images, soft targets). Labels on the CPU are checked against
        ``num_classes`` here; labels on a GPU are not (reading them would stop the GPU every step):
        check them once where they come from (``dali-fast train`` checks the data set's labels)."""
        if labels.device.type == "cpu" and len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels outside 0..{self.num_classes - 1}: set num_classes to the data set's classes")
        use_mixup, use_cutmix = self.alpha_mixup > 0, self.alpha_cutmix > 0
        if not (use_mixup or use_cutmix) or self.rng.random() >= self.prob:
            self.last = {"mode": "none", "lam": 1.0, "box": None}
            return images, self.targets(labels, 1.0)
        cutmix = use_cutmix and (not use_mixup or self.rng.random() < self.switch_prob)
        if not cutmix:
            if not images.is_floating_point():
                raise ValueError("mixup blends images: pass float images (normalize first)")
            lam = float(self.rng.beta(self.alpha_mixup, self.alpha_mixup))
            mixed = images.mul(lam).add_(images.flip(0), alpha=1.0 - lam)
            self.last = {"mode": "mixup", "lam": lam, "box": None}
            return mixed, self.targets(labels, lam)
        h, w = images.shape[-2], images.shape[-1]
        lam = float(self.rng.beta(self.alpha_cutmix, self.alpha_cutmix))
        cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
        cy, cx = int(self.rng.integers(h)), int(self.rng.integers(w))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
        mixed = images.clone()
        mixed[..., y0:y1, x0:x1] = images.flip(0)[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually kept
        self.last = {"mode": "cutmix", "lam": lam, "box": (y0, y1, x0, x1)}
        return mixed, self.targets(labels, lam)


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against soft targets (rows summing to 1), averaged over the batch."""
    return torch.sum(-targets * torch.log_softmax(logits.float(), dim=-1), dim=-1).mean()
