"""``bench``'s SPDL row: the same data, crop, flip, normalize, batch and size through SPDL's own pipeline
(`spdl.pipeline.PipelineBuilder`, threads) and its decoder (FFmpeg, with the crop, resize and flip as
one filter graph per image), where SPDL and FFmpeg's libraries are installed.

Each image's crop box and flip come from the draws every other loader uses (`crop_draws`, a pure
function of seed, epoch and index), on the size FFmpeg reports; FFmpeg then crops, scales (bilinear)
and mirrors in one filter graph, and a last stage stacks the batch and normalizes it. EXIF orientation
is not applied (FFmpeg does not read it): the row compares loaders on photos without it.
"""

from __future__ import annotations

import importlib.util
import io
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..data.base import Reader, read_checked
from ..loaders.sampler import dist_rank_world
from ..transforms.draws import SampleDraws, crop_draws
from ..transforms.recipe import Recipe
from ..transforms.resize import random_resized_crop_box
from .ffcv_row import check_crop_flip_only

log = logging.getLogger(__name__)

SPDL = "spdl"
FFMPEG_LIBS = "libavcodec59 libavformat59 libavfilter8 libavdevice59 libavutil57 libswscale6 libswresample4"
SPDL_HINT = (
    "the spdl row needs SPDL and FFmpeg's libraries: pip install spdl, and on Debian "
    f"apt-get install {FFMPEG_LIBS}; or leave spdl out of --loaders"
)


def spdl_missing() -> str | None:
    """None when SPDL imports and decodes a JPEG here (its FFmpeg libraries load), else the one line that
    says how to get it."""
    try:
        found = importlib.util.find_spec("spdl") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    if not found:
        return SPDL_HINT
    try:
        import spdl.io
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, "JPEG")
        spdl.io.load_image(buf.getvalue())
    except Exception as e:  # noqa: BLE001 - any failure to load FFmpeg's libraries means "not usable here"
        log.debug("spdl does not decode here: %s", e)
        return f"{SPDL_HINT} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def spdl_filter(box: tuple[int, int, int, int], size: int, flip: bool) -> str:
    """FFmpeg's filter graph for one image: crop ``box`` (left, top, w, h), scale to ``size`` square
    (bilinear), mirror when ``flip``, RGB out."""
    left, top, w, h = box
    graph = f"crop={w}:{h}:{left}:{top},scale={size}:{size}:flags=bilinear"
    return graph + (",hflip" if flip else "") + ",format=rgb24"


def check_recipe(recipe: Recipe) -> None:
    """A one-line ValueError for settings the row has no SPDL operation for (`ffcv_row.check_crop_flip_only`)."""
    check_crop_flip_only(recipe, "spdl")


class _Bad:
    """A record SPDL could not read or decode, carried to the consumer, which raises or counts it."""

    def __init__(self, index: int, why: str) -> None:
        self.index, self.why = index, why


class SPDLLoader:
    """SPDL's pipeline over ``reader`` as a bench row sees a loader: ``set_epoch``, iterate an epoch of
    ``(images, labels)`` (normalized float NCHW, or uint8 where the recipe says), ``len``, ``close``.

    The epoch's order is a seeded shuffle; under ``torch.distributed`` (or given ``rank``/``world_size``)
    each rank takes every ``world_size``-th sample of it, padded by repeats so every rank yields the same
    number of batches, as DDP needs. A bad record raises a ValueError naming it (``on_error="raise"``) or
    is skipped, counted in ``skipped`` and logged once (``"skip"``).

    Args:
        reader: the data set (`open_dataset`).
        batch_size: images per batch.
        threads: SPDL's thread pool and the decode stage's concurrency.
        recipe: the training recipe (crop scale and ratio, flip, mean and std, size, dtype).
        seed: the order's and the draws' seed.
        on_error: "raise" or "skip".
        rank: this rank (default: torch.distributed's, else 0).
        world_size: the number of ranks (default: torch.distributed's, else 1).
    """

    def __init__(
        self,
        reader: Reader,
        batch_size: int,
        threads: int,
        recipe: Recipe,
        *,
        seed: int = 0,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        check_recipe(recipe)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        self.reader, self.batch_size, self.threads, self.recipe = reader, batch_size, max(1, threads), recipe
        self.seed, self.on_error, self.epoch, self.skipped = seed, on_error, 0, 0
        self.rank, self.world_size = dist_rank_world(rank, world_size)
        normalize = recipe.normalize
        self._mean = torch.tensor(recipe.mean_255).view(1, 3, 1, 1) if normalize else None
        self._std = torch.tensor(recipe.std_255).view(1, 3, 1, 1) if normalize else None
        self._pipeline: Any = None
        # SPDL logs every stage's statistics at INFO when a pipeline stops (a dozen lines an epoch, in
        # bench's output); its warnings and errors still show.
        spdl_log = logging.getLogger("spdl")
        if spdl_log.getEffectiveLevel() < logging.WARNING:
            spdl_log.setLevel(logging.WARNING)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """This rank's samples of the current epoch, in order."""
        n = len(self.reader)
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        padded = -(-n // self.world_size) * self.world_size
        perm = np.concatenate([perm, perm[: padded - n]])
        return perm[self.rank :: self.world_size].tolist()

    def __len__(self) -> int:
        return -(-len(self.order()) // self.batch_size)

    def _decode(self, item: tuple[int, list[float]]) -> tuple[int, np.ndarray, int] | _Bad:
        import spdl.io

        index, uniforms = item
        data, label, reason = read_checked(self.reader, index)
        if reason is not None:
            return _Bad(index, reason)
        try:
            packets = spdl.io.demux_image(data.tobytes() if isinstance(data, np.ndarray) else bytes(data))
            rng = SampleDraws(uniforms)
            box = random_resized_crop_box(rng, packets.width, packets.height, self.recipe.scale, self.recipe.ratio)
            flip = bool(rng.random() < self.recipe.hflip)
            frames = spdl.io.decode_packets(packets, filter_desc=spdl_filter(box, self.recipe.image_size, flip))
            return index, spdl.io.to_numpy(spdl.io.convert_frames(frames)), int(label)
        except Exception as e:  # noqa: BLE001 - any decoder failure is this record's, named by the consumer
            return _Bad(index, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _collate(self, items: list[tuple[int, np.ndarray, int] | _Bad]) -> tuple[torch.Tensor, torch.Tensor] | _Bad:
        bad = [x for x in items if isinstance(x, _Bad)]
        if bad and self.on_error == "raise":
            return bad[0]
        good = [x for x in items if not isinstance(x, _Bad)]
        self.skipped += len(bad)
        if bad and self.skipped == len(bad):
            log.warning("spdl row: skipping bad records (the first: %s: %s)", self._name(bad[0].index), bad[0].why)
        images = torch.from_numpy(np.stack([x[1] for x in good])).permute(0, 3, 1, 2)
        labels = torch.tensor([x[2] for x in good], dtype=torch.int64)
        if self._mean is not None:
            images = ((images.float() - self._mean) / self._std).to(self.recipe.out_dtype)
        return images.contiguous(memory_format=self.recipe.memory_format), labels

    def _name(self, index: int) -> str:
        return f"record {index} ({self.reader.source(index)})"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from spdl.pipeline import PipelineBuilder

        order = self.order()
        draws = crop_draws(self.seed, self.epoch, order) if order else []
        self.close()
        self._pipeline = (
            PipelineBuilder()
            .add_source(list(zip(order, draws, strict=True)))
            .pipe(self._decode, concurrency=self.threads, output_order="input")
            .aggregate(self.batch_size)
            .pipe(self._collate)
            .add_sink(3)
            .build(num_threads=self.threads, max_failures=0)
        )
        with self._pipeline.auto_stop():
            for batch in self._pipeline.get_iterator(timeout=300):
                if isinstance(batch, _Bad):
                    raise ValueError(f"{self._name(batch.index)}: {batch.why}; the spdl row reads it with FFmpeg")
                if len(batch[1]):
                    yield batch
        self._pipeline = None

    def close(self) -> None:
        self._pipeline = None  # its threads end with the epoch (auto_stop)
