"""The plain baseline, as PyTorch users write it today: the reference row of every comparison.

A `torch.utils.data.DataLoader` over a Dataset that opens each file with Pillow and applies the
recipe (RandomResizedCrop, horizontal flip, automatic augmentation, normalization, random erasing)
per sample on the CPU (the same `Recipe` as the other loaders), with one worker per cpu. Kept honest:
no deliberate slowness, and no tricks the typical script does not have either (no draft-mode decode,
no GPU normalization).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler

from ..data.base import Reader, check_on_error, read_checked
from ..data.checks import pillow_reason
from ..data.targets import reader_targets
from ..machine import cpus_per_local_rank
from ..transforms.decode import open_image, to_rgb
from ..transforms.pillow import PillowTransform
from ..transforms.recipe import Recipe, resolve_recipe
from .bad_records import BadRecordError, bad_record_message
from .sampler import dist_rank_world

log = logging.getLogger(__name__)


class BaselineDataset(Dataset):
    """Per-sample Pillow decode + transforms, like torchvision's ImageFolder with the usual transforms.

    An index may come as ``(index, size)`` (`EpochSizes` sends them so for a recipe with a resolution
    schedule): the sample is then made at ``size`` px.
    """

    def __init__(
        self,
        reader: Reader,
        train: bool = True,
        image_size: int | None = None,
        on_error: str = "raise",
        recipe: Recipe | None = None,
    ) -> None:
        self.reader, self.train, self.on_error = reader, train, on_error
        self.recipe = resolve_recipe(recipe, image_size=image_size)
        self.image_size = self.recipe.image_size
        self._transform = PillowTransform(self.recipe.at_epoch(0, train), train)  # a schedule's first size
        self._sized: dict[int, PillowTransform] = {}  # per training size of a resolution schedule
        self._rng: np.random.Generator | None = None
        self._targets = reader_targets(reader)  # the target rows, where the target is not the class index

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int | tuple[int, int]) -> tuple[torch.Tensor, int | torch.Tensor] | None:
        """The sample (with its label, or its float32 target row for other targets: `data.targets`), or
        (``on_error='skip'``) None for a bad record, which `skip_bad` drops from the batch."""
        transform = self._transform
        if isinstance(i, tuple):
            i, size = i
            transform = self._sized.get(size) or self._sized.setdefault(
                size, PillowTransform(self.recipe.at_epoch(0, self.train).with_(image_size=size), self.train)
            )
        if self._rng is None:  # one generator per worker process, seeded by torch's worker seed
            self._rng = np.random.default_rng(torch.initial_seed() % 2**32)
        data, label, reason = read_checked(self.reader, i)
        im = None
        if reason is None:
            try:
                im = to_rgb(open_image(data))  # the shared rule: EXIF orientation, 16-bit scaled
                im.load()
            except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
                reason = pillow_reason(e)
        if im is None:
            if self.on_error == "skip":
                log.warning("skipping record %d (%s): %s", i, self.reader.source(i), reason)
                return None
            raise BadRecordError(bad_record_message(self.reader, i, reason or "unreadable"))
        if self._targets is not None:
            return transform(im, self._rng), torch.from_numpy(self._targets.rows([i])[0])
        return transform(im, self._rng), int(label)


class EpochSizes(Sampler):
    """Wraps a sampler for a recipe with a resolution schedule: yields ``(index, size)``, ``size`` being
    the epoch's training size, so workers that persist across epochs make each epoch's samples at its
    size. ``set_epoch(e)`` (as a DDP script calls on its sampler) selects the epoch, for the inner sampler too."""

    def __init__(self, sampler: Sampler, recipe: Recipe) -> None:
        self.inner, self.recipe, self.epoch = sampler, recipe, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    @property
    def image_size(self) -> int:
        return self.recipe.train_size(self.epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        size = self.image_size
        return ((int(i), size) for i in self.inner)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class RankShare(Sampler):
    """Rank ``rank``'s share of ``n`` samples in their order (every ``world``-th from ``rank``), nothing
    repeated: evaluation under DDP, where `DistributedSampler` pads with repeats (ranks then differ by one)."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.share = range(rank, n, world)

    def set_epoch(self, epoch: int) -> None:
        """The order is the same every epoch (as a DDP script calls it on any sampler)."""

    def __iter__(self) -> Iterator[int]:
        return iter(self.share)

    def __len__(self) -> int:
        return len(self.share)


def skip_bad(samples: list[tuple[torch.Tensor, int] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """DataLoader's default collate, without the samples `BaselineDataset` skipped (None)."""
    from torch.utils.data import default_collate

    good = [s for s in samples if s is not None]
    if not good:
        return torch.empty(0, 3, 0, 0), torch.empty(0, dtype=torch.int64)
    return default_collate(good)


TAKES = ("train", "image_size", "num_workers", "drop_last", "seed", "on_error", "recipe")  # make_baseline_loader's


def make_baseline_loader(
    reader: Reader,
    batch_size: int,
    *,
    train: bool = True,
    image_size: int | None = None,
    num_workers: int | None = None,
    drop_last: bool = False,
    seed: int = 0,
    on_error: str = "raise",
    recipe: Recipe | None = None,
) -> DataLoader:
    """DataLoader(shuffle=train, num_workers=cpus (per local rank), pin_memory when CUDA) over `BaselineDataset`.

    Under ``torch.distributed`` it shards with a `DistributedSampler`, as a DDP script does (evaluation
    without ``drop_last``: `RankShare`, which repeats no sample); call ``loader.sampler.set_epoch(epoch)``
    each epoch then. A training recipe with a resolution schedule wraps
    the sampler in `EpochSizes`: ``loader.sampler.set_epoch(epoch)`` then also sets the epoch's size.
    """
    check_on_error(on_error)
    if num_workers is None:
        num_workers = cpus_per_local_rank()
    recipe = resolve_recipe(recipe, image_size=image_size)
    # The workers get the recipe without its schedule (a user's function need not pickle); the sampler keeps it.
    dataset = BaselineDataset(reader, train=train, on_error=on_error, recipe=recipe.at_epoch(0, train))
    sampler = None
    rank, world = dist_rank_world()
    if world > 1 and (train or drop_last):
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=train, seed=seed, drop_last=drop_last
        )
    elif world > 1:
        sampler = RankShare(len(dataset), rank, world)
    shuffle: bool | None = train if sampler is None else None
    if train and recipe.resolution is not None:
        sampler = EpochSizes(sampler if sampler is not None else RandomSampler(dataset), recipe)
        shuffle = None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=drop_last,
        collate_fn=skip_bad if on_error == "skip" else None,
    )
