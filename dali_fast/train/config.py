"""`TrainConfig`: the settings of a training run (the flags of ``dali-fast train``), checked in one place
before any work."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..data.base import Reader, StreamingReader, check_on_error, provides, read_record
from ..files import check_writable_file, check_writable_folder
from ..loaders.factory import BACKENDS
from ..transforms.decode import stored_size
from ..transforms.mix import MixupCutmix
from ..transforms.recipe import Recipe, resolve_recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """The settings of a run (the flags of ``dali-fast train``).

    ``drop_last`` (the default, as is usual for training) leaves out each epoch's incomplete last batch, so
    BatchNorm never meets a one-sample batch. ``recipe`` is the per-image transform (its ``image_size`` must
    agree with ``image_size``; with a ``resolution`` schedule, the training loader follows it epoch by epoch
    and ``image_size`` is the evaluation size); ``mixup``/``cutmix`` (Beta alphas, 0: off) mix each batch and train on soft
    targets, smoothed by ``label_smoothing``. ``val`` is the set to evaluate on (a path or URL, or a reader):
    the training set is then read whole; without it, about ``holdout`` of the training data is held out
    (whole shards or row groups of a streamed set, so that both sides still stream). ``checkpoint`` (a folder) is written every
    ``checkpoint_every`` steps and at each epoch's end; ``record_indices`` (a file) gets each batch's
    sample indices; ``out`` (a folder) gets train.json.
    """

    loader: str = "dali"
    epochs: int = 5
    model: str = "resnet18"
    batch_size: int = 64
    image_size: int = 224
    lr: float = 0.05
    amp: bool = True
    controller: bool = False
    holdout: float = 0.2
    val: Any = None  # a path or URL (str, os.PathLike), or a reader
    seed: int = 0
    num_workers: int | None = None
    drop_last: bool = True
    checkpoint: str | Path | None = None
    checkpoint_every: int = 500
    resume: bool = False
    record_indices: str | Path | None = None
    out: str | Path | None = None
    on_error: str = "raise"
    recipe: Recipe | None = None
    mixup: float = 0.0
    cutmix: float = 0.0
    label_smoothing: float = 0.0

    @property
    def mix(self) -> dict[str, float]:
        """The batch-mixing settings, as `MixupCutmix` takes them."""
        return {"alpha_mixup": self.mixup, "alpha_cutmix": self.cutmix, "label_smoothing": self.label_smoothing}

    def checked(self) -> TrainConfig:
        """These settings with the recipe resolved and the paths as paths, or a one-line error naming what
        is wrong; where results go is checked writable before any work, not found unwritable at the end."""
        recipe = resolve_recipe(self.recipe, image_size=self.image_size)
        MixupCutmix(**self.mix)
        if self.mixup > 0 and not recipe.normalize:
            raise ValueError("mixup blends images: it needs normalized float images, not a recipe with mean=None")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={self.checkpoint_every}: must be >= 1 step")
        if self.resume and self.checkpoint is None:
            raise ValueError("resume needs a checkpoint folder: pass --checkpoint DIR with --resume")
        if self.checkpoint_every != TrainConfig.checkpoint_every and self.checkpoint is None:
            raise ValueError("--checkpoint-every needs a checkpoint folder: pass --checkpoint DIR with it")
        if self.num_workers is not None and self.loader == "dali":  # said, not refused: scripts pass it to every loader
            log.warning(
                "--num-workers %d: the DataLoader's worker processes (--loader torch or baseline); --loader dali "
                "decodes in its own threads, one per CPU",
                self.num_workers,
            )
        if self.loader not in BACKENDS:
            raise ValueError(f"loader {self.loader!r}: choose one of {', '.join(BACKENDS)}")
        check_on_error(self.on_error)
        if self.controller and self.loader == "baseline":
            raise ValueError("--controller needs --loader dali or torch (the plain DataLoader's batch size is fixed)")
        if self.record_indices is not None and self.loader == "baseline":
            raise ValueError(
                "--record-indices needs --loader dali or torch (the plain DataLoader does not expose indices)"
            )
        paths = {k: None if v is None else Path(v) for k, v in self._paths().items()}
        for name, what in (("out", "--out"), ("checkpoint", "--checkpoint")):
            if paths[name] is not None:
                check_writable_folder(paths[name], what)
        if paths["record_indices"] is not None:  # the file of rank 0 (the others' are beside it)
            text = str(paths["record_indices"])
            check_writable_file(text.format(rank=0) if "{rank}" in text else text, "--record-indices")
        return replace(self, recipe=recipe, **paths)

    def _paths(self) -> dict[str, str | Path | None]:
        return {"checkpoint": self.checkpoint, "out": self.out, "record_indices": self.record_indices}


SIZE_SAMPLE = 64  # records whose headers are read to say how large the data set's images are


def warn_if_sizes_exceed_images(recipe: Recipe, reader: Reader, epochs: int) -> None:
    """Warn once when a resolution schedule trains, in ``epochs`` epochs, at a size larger than most
    images: the shorter side of most of `SIZE_SAMPLE` records spread over ``reader`` (their headers only).
    Such crops are all upscaled: time spent on no new detail. Streamed (remote) data is not sampled: a
    read out of order would fetch a shard."""
    if recipe.resolution is None or epochs < 1 or (provides(reader, StreamingReader) and reader.streaming):  # type: ignore[attr-defined]
        return
    size, epoch = max((recipe.train_size(e), e) for e in range(epochs))
    at = np.unique(np.linspace(0, len(reader) - 1, min(SIZE_SAMPLE, len(reader))).astype(np.int64))
    sides = []
    for i in at.tolist():
        data, _, reason = read_record(reader, i)
        found = stored_size(data) if reason is None else None
        if found is not None:
            sides.append(min(found))
    smaller = sum(side < size for side in sides)
    if not sides or 2 * smaller <= len(sides):
        return
    typical = int(np.median(sides))
    log.warning(
        "the resolution schedule %s trains at %d px (epoch %d), more than the shorter side of %d of %d images "
        "sampled (median %d px): their crops are all upscaled, which costs time and adds no detail; end the "
        "schedule at %d px or less",
        recipe.resolution,
        size,
        epoch,
        smaller,
        len(sides),
        typical,
        typical,
    )
