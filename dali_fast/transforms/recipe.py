"""Training recipes: the per-image transform every loader applies (`Recipe`), and its constants.

`Recipe` is one frozen object that `DALIIterator`, `TorchIterator`, the baseline `DataLoader`,
`make_loader`, ``bench`` and ``train`` all read, so every backend crops, augments and normalizes the
same way. The default ``Recipe()`` is the classic ResNet recipe (random-resized-crop 0.08–1, flip,
ImageNet mean/std; eval: resize to 1/0.875 of the size, centre crop)::

    deit = Recipe(interpolation="bicubic", auto_augment="randaugment", magnitude=9, random_erasing=0.25)
    loader = DALIIterator(open_dataset("train"), 256, recipe=deit)

Per image, in order: crop and resize to ``image_size`` → automatic augmentation (train) → flip →
normalize (or stay uint8) → random erasing (train; the box holds the mean pixel, see `Recipe.erasing_fill`).

Progressive resizing: ``resolution`` (a `Progressive` ramp, or any function from epoch to size) sets the
training size epoch by epoch, low early and full late, as FFCV's ImageNet recipe does; ``image_size`` stays
the evaluation size::

    ffcv = Recipe(image_size=256, resolution=Progressive(160, 192, start_epoch=65, end_epoch=76))

Batch-level mixup and cutmix are `mix.MixupCutmix`; the per-sample random draws are `draws`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
# The erased box of unnormalized output: ImageNet's mean pixel, 0-255 scale, rounded (124, 116, 104).
ERASING_FILL_255 = tuple(float(round(m * 255)) for m in IMAGENET_MEAN_01)
# Salts of the per-sample generators: the crop and flip use (seed, epoch, index); these draw apart from
# them, so turning an augmentation on leaves the crops and flips of the default recipe as they were.
AUGMENT_SALT, ERASING_SALT, CROP_SALT = 1, 2, 3


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


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return int(value)


@dataclass(frozen=True)
class Progressive:
    """FFCV's resolution ramp: ``start`` px up to epoch ``start_epoch``, ``end`` px from epoch ``end_epoch`` on,
    and in between the straight line from one to the other rounded to a multiple of ``step`` px (kept
    within [start, end]). FFCV's ImageNet recipe: ``Progressive(160, 192, start_epoch=65, end_epoch=76)``.

    Called with an epoch, it gives that epoch's training size: ``Progressive(160, 224, 0, 4)(2) == 192``.
    A ramp may also go down (``start > end``).

    Args:
        start: the size in px up to ``start_epoch``.
        end: the size in px from ``end_epoch`` on.
        start_epoch: the last epoch at ``start``.
        end_epoch: the first epoch at ``end``.
        step: sizes in between are multiples of this many px.
    """

    start: int
    end: int
    start_epoch: int
    end_epoch: int
    step: int = 32

    def __post_init__(self) -> None:
        for name in ("start", "end", "step"):
            object.__setattr__(self, name, _size(name, getattr(self, name)))
        for name in ("start_epoch", "end_epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
            object.__setattr__(self, name, int(value))
        if self.end_epoch < self.start_epoch:
            raise ValueError(
                f"end_epoch={self.end_epoch} is before start_epoch={self.start_epoch}: the ramp ends after it starts"
            )

    def __call__(self, epoch: int) -> int:
        if epoch <= self.start_epoch:
            return self.start
        if epoch >= self.end_epoch:
            return self.end
        t = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        size = int(np.round((self.start + t * (self.end - self.start)) / self.step)) * self.step
        return min(max(size, min(self.start, self.end)), max(self.start, self.end))

    def __str__(self) -> str:
        return f"{self.start}:{self.end}:{self.start_epoch}:{self.end_epoch}" + (
            f":{self.step}" if self.step != 32 else ""
        )

    @classmethod
    def parse(cls, text: str) -> Progressive:
        """``START:END:FROM_EPOCH:TO_EPOCH[:STEP]`` (the CLI's ``--progressive``), e.g. ``160:192:65:76``."""
        parts = text.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (4, 5):
            raise ValueError(
                f"--progressive {text!r}: give START:END:FROM_EPOCH:TO_EPOCH[:STEP] in px and epochs, e.g. 160:192:65:76"
            )
        return cls(*numbers)


def describe_resolution(resolution: Any) -> Any:
    """A schedule as plain values (checkpoints compare them to refuse a resume with another schedule):
    a `Progressive` as its fields, a function by its qualified name."""
    if resolution is None:
        return None
    if isinstance(resolution, Progressive):
        return {"progressive": str(resolution)}
    name = getattr(resolution, "__qualname__", None) or type(resolution).__qualname__
    return {"function": f"{getattr(resolution, '__module__', '?')}.{name}"}


@dataclass(frozen=True)
class Recipe:
    """The per-image transform of a loader, shared by every backend.

    Train: random-resized-crop of ``scale`` (share of the area) and ``ratio`` (width/height), resized to
    ``image_size`` with ``interpolation``; ``auto_augment`` (``None``, ``"randaugment"`` with ``num_ops``
    and ``magnitude`` out of ``num_magnitude_bins``, ``"trivialaugment"`` (TrivialAugmentWide) or
    ``"autoaugment"`` (the ImageNet policy)), geometric ops filling with ``fill``; horizontal flip with
    probability ``hflip``; normalization by ``mean``/``std`` (0–1 scale, per RGB channel; values on the
    0–255 scale are refused); random erasing
    with probability ``random_erasing`` of a box of ``erasing_scale`` of the area and ``erasing_ratio``
    aspect (torchvision's `RandomErasing` rule), filled with the mean pixel (`erasing_fill`).
    Eval: resize the shorter side to ``eval_resize_size`` (default ``round(image_size /
    eval_crop_fraction)``), centre crop ``image_size``; no augmentation.
    ``resolution`` (a `Progressive`, or any function from epoch to a size in px) makes the training size
    follow the epoch (progressive resizing); ``image_size`` is then the evaluation size only, as FFCV
    evaluates at a higher resolution than it trains. `at_epoch` gives an epoch's fixed-size recipe.
    ``mean=None, std=None`` gives uint8 output that the model normalizes itself. ``dtype`` defaults
    to float32 (uint8 without mean/std); ``dtype=torch.uint8`` with a mean and std gives uint8 output too,
    which the consumer normalizes on its device by the recipe's mean and std (`normalize_images`: a quarter
    of the bytes to copy, no normalizing on the CPU). ``memory_format=torch.channels_last`` gives NCHW
    views of NHWC.

    Attributes:
        image_size: the output's side in px (the evaluation size under a ``resolution`` schedule).
        scale: the random-resized crop's share of the image's area, (low, high).
        ratio: the crop's width/height, (low, high), drawn log-uniformly.
        eval_crop_fraction: evaluation's centre crop as a share of the resized side.
        eval_resize_size: evaluation's shorter side before the crop (None: from ``eval_crop_fraction``).
        interpolation: the resize filter: "bilinear" or another of `INTERPOLATIONS`.
        hflip: the probability of a horizontal flip.
        auto_augment: None, "randaugment", "trivialaugment" or "autoaugment".
        num_ops: RandAugment's operations per image.
        magnitude: RandAugment's magnitude, out of ``num_magnitude_bins``.
        num_magnitude_bins: the bins of the augmentations' magnitudes.
        fill: the pixel value geometric augmentations fill with.
        random_erasing: the probability of erasing a box.
        erasing_scale: the erased box's share of the area, (low, high).
        erasing_ratio: the erased box's aspect, (low, high).
        mean: per-channel mean on the 0-1 scale (None with ``std=None``: uint8 output, not normalized).
        std: per-channel standard deviation on the 0-1 scale.
        dtype: the output's dtype (None: float32, or uint8 without mean and std).
        memory_format: ``torch.contiguous_format`` or ``torch.channels_last``.
        resolution: the training size per epoch, a `Progressive` or a function of the epoch.
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
    resolution: Progressive | Callable[[int], int] | None = None

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
            if not all(0 <= m <= 1 for m in mean) or not all(s <= 1 for s in std):
                # DALI's and OpenCV's convention (123.675, ...) would give a nearly constant output here.
                raise ValueError(
                    f"mean={self.mean!r}, std={self.std!r}: Recipe takes them on the 0-1 scale (0 <= mean <= 1, "
                    f"0 < std <= 1; ImageNet's: mean={IMAGENET_MEAN_01}, std={IMAGENET_STD_01}); "
                    "divide values on the 0-255 scale by 255"
                )
            object.__setattr__(self, "mean", mean)
            object.__setattr__(self, "std", std)
        if self.dtype is not None and self.dtype not in OUT_DTYPES:
            raise ValueError(f"dtype={self.dtype}: use torch.float32, torch.float16 or torch.uint8")
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"memory_format={self.memory_format}: use torch.contiguous_format or torch.channels_last")
        if self.resolution is not None and not callable(self.resolution):
            raise ValueError(
                f"resolution={self.resolution!r}: pass a Progressive(start, end, start_epoch, end_epoch) "
                "or a function from epoch to size in px"
            )

    # ------------------------------------------------------------------ progressive resizing
    def train_size(self, epoch: int) -> int:
        """The training size of ``epoch``: the schedule's, else ``image_size``."""
        if self.resolution is None:
            return self.image_size
        size = self.resolution(int(epoch))
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(
                f"the resolution schedule gave {size!r} for epoch {epoch}: it must give a positive integer"
            )
        return int(size)

    def at_epoch(self, epoch: int, train: bool = True) -> Recipe:
        """The fixed-size recipe a loader applies in ``epoch``: the schedule's size when training, else
        ``image_size`` (evaluation keeps it). Without the schedule itself, so what goes to worker
        processes never carries the user's function."""
        if self.resolution is None:
            return self
        if not train:
            return replace(self, resolution=None)
        size = self.train_size(epoch)
        resize = self.eval_resize_size if self.eval_resize_size is None or self.eval_resize_size >= size else None
        return replace(self, image_size=size, eval_resize_size=resize, resolution=None)

    # ------------------------------------------------------------------ what the backends read
    @property
    def out_dtype(self) -> torch.dtype:
        """The output dtype: ``dtype``, else float32 when normalizing and uint8 when not."""
        if self.dtype is not None:
            return self.dtype
        return torch.float32 if self.mean is not None else torch.uint8

    @property
    def normalize(self) -> bool:
        """Whether the loader normalizes: a mean and std, and a float output. With ``dtype=torch.uint8`` the
        batch stays uint8 and ``mean``/``std`` are what the consumer normalizes by (`normalize_images`)."""
        return self.mean is not None and self.out_dtype != torch.uint8

    @property
    def mean_255(self) -> tuple[float, ...]:
        """The mean on the 0–255 scale of decoded pixels (0 when not normalizing)."""
        return tuple(m * 255 for m in self.mean) if self.mean is not None else (0.0, 0.0, 0.0)

    @property
    def std_255(self) -> tuple[float, ...]:
        return tuple(s * 255 for s in self.std) if self.std is not None else (1.0, 1.0, 1.0)

    @property
    def erasing_fill(self) -> tuple[float, float, float]:
        """What an erased box holds, per channel, in the output: the mean pixel in every backend and dtype.
        Normalized output: 0 (the recipe's mean normalizes to 0). Unnormalized output (uint8, or float with
        ``mean=None``): ImageNet's mean pixel on the 0–255 scale, rounded, `ERASING_FILL_255`, which the
        usual model-side normalization maps to about 0, where 0 (black) would be a dark box; uint8 output
        of a recipe with its own ``mean``: that mean pixel, rounded."""
        if self.normalize:
            return (0.0, 0.0, 0.0)
        if self.mean is None:
            return ERASING_FILL_255
        r, g, b = (float(round(m)) for m in self.mean_255)
        return (r, g, b)

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
        if self.resolution is None:
            del out["resolution"]  # as recipes were described before schedules existed
        else:
            out["resolution"] = describe_resolution(self.resolution)
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


IMAGENET_MEAN = Recipe().mean_255  # the default recipe's normalization, on the 0-255 scale of decoded pixels
IMAGENET_STD = Recipe().std_255


def describe_schedule(resolution: Any) -> str:
    """A saved resolution schedule (`describe_resolution`'s plain values), in words for a refusal."""
    if resolution is None:
        return "none (a fixed image_size)"
    return " ".join(str(v) for v in resolution.values()) if isinstance(resolution, dict) else repr(resolution)
