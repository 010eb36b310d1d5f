"""`TorchIterator`: the same API and rules as `DALIIterator` in pure PyTorch (+ Pillow).

Workers decode and crop with Pillow (JPEG draft mode decodes at 1/2, 1/4 or 1/8 scale when the
crop is much larger than the output, like DALI's region-of-interest decode) and return uint8
batches; the main process moves them to the GPU (pinned memory, a side stream that overlaps the
next copy with the current step) and normalizes and flips the whole batch in one op there.
Each sample's augmentation is drawn from (seed, epoch, index), so it does not depend on the
number of workers, the batch size or a resume.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .autoaugment import apply_policy
from .decode import open_image, oriented_size, to_rgb
from .iterator import LoaderBase, cuda_usable, local_device_index
from .pipeline import IMAGENET_MEAN, IMAGENET_STD, BadRecordError, bad_record_message
from .recipe import AUGMENT_SALT, Recipe, sample_erasing_box, sample_rng
from .records import Reader, pillow_reason, read_checked
from .system import cpus_per_local_rank

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- DataLoader factory


def default_num_workers() -> int:
    """min(8, cpus - 1) of this rank's share of the cpus, but at least 1 where there are 2+; 0 on one."""
    cpus = cpus_per_local_rank()
    return 0 if cpus < 2 else max(1, min(8, cpus - 1))


def create_optimized_dataloader(
    dataset: Dataset,
    batch_size: int | None,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = 2,
    persistent_workers: bool | None = None,
    sampler: Sampler | None = None,
    batch_sampler: Sampler | None = None,
    shuffle: bool = False,
    drop_last: bool = False,
    collate_fn: Callable | None = None,
    worker_init_fn: Callable | None = None,
) -> DataLoader:
    """A `DataLoader` with sensible defaults, and clear errors for bad combinations.

    ``num_workers=None`` picks min(8, cpus - 1) (at least 1 on 2+ cpus); ``pin_memory`` defaults
    to CUDA being usable; ``persistent_workers`` defaults to ``num_workers > 0``.
    """
    if num_workers is None:
        num_workers = default_num_workers()
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: must be >= 0 (0 loads in the main process)")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1 (or None with a batch_sampler)")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(f"prefetch_factor={prefetch_factor}: must be >= 1")
    if num_workers == 0 and prefetch_factor not in (None, 2):
        raise ValueError(
            f"prefetch_factor={prefetch_factor} needs worker processes; set num_workers > 0 or prefetch_factor=None"
        )
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers > 0")
    if batch_sampler is not None and (sampler is not None or shuffle or drop_last or batch_size not in (None, 1)):
        raise ValueError("batch_sampler excludes batch_size, shuffle, sampler and drop_last; pass batch_size=None")
    if sampler is not None and shuffle:
        raise ValueError("sampler and shuffle=True exclude each other; the sampler decides the order")
    if pin_memory is None:
        pin_memory = cuda_usable()
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    kw: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "collate_fn": collate_fn,
        "worker_init_fn": worker_init_fn,
    }
    if num_workers > 0:
        kw["prefetch_factor"] = prefetch_factor
        kw["persistent_workers"] = persistent_workers
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **kw)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=shuffle, drop_last=drop_last, **kw)


def shutdown_workers(loader: DataLoader | None) -> None:
    """Shut a DataLoader's persistent worker pool down now. Left to the garbage collector, a pool whose
    pass ended in an error was seen to wait 5 s per worker for them to exit."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()  # noqa: SLF001 - DataLoader's own clean-up of a persistent pool
        loader._iterator = None  # noqa: SLF001


# ----------------------------------------------------------------------------- Pillow transforms


def random_resized_crop_box(
    rng: np.random.Generator, width: int, height: int, scale=Recipe.scale, ratio=Recipe.ratio
) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a random-resized-crop window (the usual 10-attempt algorithm)."""
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


PIL_RESAMPLE = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "nearest": "NEAREST", "lanczos": "LANCZOS"}


def decode_crop(data: bytes | np.ndarray, *, train: bool, recipe: Recipe, rng: np.random.Generator) -> np.ndarray:
    """Decode, crop and resize one image with Pillow (by `decode.to_rgb`'s rule): uint8 (S, S, 3) RGB."""
    from PIL import Image

    im = open_image(data)
    width, height = oriented_size(im)
    S = recipe.image_size
    resample = getattr(Image, PIL_RESAMPLE[recipe.interpolation])
    if train:
        left, top, w, h = random_resized_crop_box(rng, width, height, recipe.scale, recipe.ratio)
        need = (max(1, math.ceil(width * S / w)), max(1, math.ceil(height * S / h)))
    else:
        short = recipe.resize_shorter
        scale = short / min(width, height)
        need = (max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale)))
    if im.format == "JPEG":
        # Decode at 1/2, 1/4 or 1/8 scale only where the result still has twice the output's
        # resolution: much faster, and the final resize hides the difference.
        stored = need if im.size == (width, height) else (need[1], need[0])
        im.draft("RGB", (2 * stored[0], 2 * stored[1]))
    im = to_rgb(im)
    fx, fy = im.size[0] / width, im.size[1] / height
    if train:
        box = (left * fx, top * fy, (left + w) * fx, (top + h) * fy)
        im = im.resize((S, S), resample, box=box)
    else:
        rw, rh = max(S, round(width * scale)), max(S, round(height * scale))
        im = im.resize((rw, rh), resample)
        x0, y0 = (rw - S + 1) // 2, (rh - S + 1) // 2  # round half up, as DALI's centre crop does
        im = im.crop((x0, y0, x0 + S, y0 + S))
    return np.asarray(im, dtype=np.uint8)


class _DecodeDataset(Dataset):
    """Runs in the workers: a key (index, epoch[, encoded bytes]) → decoded, augmented crop or a failure.

    Per sample: crop and flip from (seed, epoch, index); the automatic augmentation and the erasing box
    from their own salted generators, the box exactly as `DALIIterator`'s source draws it.
    """

    def __init__(self, reader: Reader, train: bool, recipe: Recipe, seed: int) -> None:
        self.reader = reader
        self.train = train
        self.recipe = recipe
        self.seed = seed

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: tuple) -> tuple:
        index, epoch = key[0], key[1]
        if len(key) > 2:
            data, label, reason = key[2], key[3], key[4]  # read (and checked) in the main process
        else:
            data, label, reason = read_checked(self.reader, index)
        if reason is None:
            rng = sample_rng(self.seed, epoch, index)
            try:
                image = decode_crop(data, train=self.train, recipe=self.recipe, rng=rng)
            except Exception as e:  # noqa: BLE001 - Pillow raises many types; the record is reported
                reason = pillow_reason(e)
            else:
                if not self.train:
                    return index, label, image, False, None, None
                flip = bool(rng.random() < self.recipe.hflip)
                image = apply_policy(image, self.recipe, sample_rng(self.seed, epoch, index, AUGMENT_SALT))
                box = None
                if self.recipe.random_erasing > 0:
                    box = sample_erasing_box(self.recipe, self.seed, epoch, index)
                return index, label, image, flip, None, box
        return index, label, None, False, reason, None


def _collate(samples: list[tuple]) -> dict[str, Any]:
    good = [s for s in samples if s[4] is None]
    bad = [(s[0], s[4]) for s in samples if s[4] is not None]
    if good:
        images = torch.from_numpy(np.stack([s[2] for s in good]))
    else:
        images = torch.empty(0, dtype=torch.uint8)
    boxes = None
    if good and good[0][5] is not None:
        boxes = torch.tensor([s[5] for s in good], dtype=torch.int64)
    return {
        "images": images,
        "labels": torch.tensor([s[1] for s in good], dtype=torch.int64),
        "flips": torch.tensor([s[3] for s in good], dtype=torch.bool),
        "boxes": boxes,
        "consumed": len(samples),
        "bad": bad,
    }


class _PlanSampler(Sampler):
    """Yields the current epoch's planned batches as lists of keys; re-armed before each epoch."""

    def __init__(self) -> None:
        self.keys: list[list[tuple]] = []

    def __iter__(self) -> Iterator[list[tuple]]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


@functools.lru_cache(maxsize=16)
def _normalization(
    device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean`` and 1/``std`` as (1, 3, 1, 1) float32 tensors on ``device``, made once per device and recipe."""
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    inv_std = 1.0 / torch.tensor(std, device=device).view(1, 3, 1, 1)
    return mean_t, inv_std


def erase_boxes(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Fill each sample's (top, left, h, w) box of NCHW ``x`` with 0, in place, without a host sync."""
    boxes = boxes.to(x.device, non_blocking=True)
    rows = torch.arange(x.shape[-2], device=x.device).view(1, -1, 1)
    cols = torch.arange(x.shape[-1], device=x.device).view(1, 1, -1)
    top, left, h, w = (boxes[:, k].view(-1, 1, 1) for k in range(4))
    inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
    return x.masked_fill_(inside.unsqueeze(1), 0)


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
    """
    flips = flips.to(images.device, non_blocking=True)
    images = torch.where(flips.view(-1, 1, 1, 1), images.flip(2), images)  # mirror on uint8: 4x less memory
    if mean is None or std is None:
        x = images.permute(0, 3, 1, 2).to(dtype, memory_format=memory_format)
    else:
        x = images.permute(0, 3, 1, 2).to(torch.float32, memory_format=memory_format)
        mean_t, inv_std = _normalization(x.device, tuple(mean), tuple(std))
        x.sub_(mean_t).mul_(inv_std)
        x = x if dtype == torch.float32 else x.to(dtype)
    return x if boxes is None else erase_boxes(x, boxes)


def _finish(b: dict[str, Any], recipe: Recipe, dtype: torch.dtype, memory_format: torch.memory_format) -> torch.Tensor:
    """A collated batch's images, flipped, normalized and erased as ``recipe`` says."""
    mean, std = (recipe.mean_255, recipe.std_255) if recipe.normalize else (None, None)
    return normalize_flip(b["images"], b["flips"], dtype, memory_format, mean, std, b["boxes"])


class _Collate:
    """Stacks a batch; on CPU also normalizes it in the worker (on GPU that happens after the copy)."""

    def __init__(
        self,
        normalize_dtype: torch.dtype | None,
        memory_format: torch.memory_format = torch.contiguous_format,
        recipe: Recipe | None = None,
    ) -> None:
        self.normalize_dtype = normalize_dtype
        self.memory_format = memory_format
        self.recipe = recipe or Recipe()

    def __call__(self, samples: list[tuple]) -> dict[str, Any]:
        b = _collate(samples)
        if self.normalize_dtype is not None and len(b["labels"]):
            b["images"] = _finish(b, self.recipe, self.normalize_dtype, self.memory_format)
            b["normalized"] = True
        return b


class TorchIterator(LoaderBase):
    """`DALIIterator`'s API and rules in pure PyTorch: the fallback, and the yardstick.

    Extra arguments: ``num_workers`` (decode processes; None picks min(8, cpus - 1)). The sample
    order is identical to `DALIIterator` for the same (seed, epoch, rank). With ``cache_bytes``
    the LRU cache lives in the main process (shared by all workers, exact statistics): it reads
    encoded bytes through the cache and hands them to the workers with the indices.
    """

    backend = "torch"

    def __init__(self, dataset: Reader, batch_size: int, *, num_workers: int | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size, **kwargs)
        self.num_workers = default_num_workers() if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers={num_workers}: must be >= 0")
        self.device = torch.device("cuda", local_device_index()) if self.gpu else torch.device("cpu")
        self._plan = _PlanSampler()
        # With a cache, the keys carry the bytes (read through it in this process); workers never
        # touch the cache, so it needs no copy per worker and is never pickled.
        self._decode = _DecodeDataset(dataset, self.train, self.recipe, self.seed)
        self._loader: DataLoader | None = None

    def _dataloader(self) -> DataLoader:
        if self._loader is None:
            self._loader = create_optimized_dataloader(
                self._decode,
                None,
                batch_sampler=self._plan,
                num_workers=self.num_workers,
                pin_memory=self.gpu,
                prefetch_factor=self.prefetch if self.num_workers else None,
                collate_fn=_Collate(None if self.gpu else self.dtype, self.memory_format, self.recipe),
            )
        return self._loader

    def _keys(self, plan: Sequence[np.ndarray]) -> list[list[tuple]]:
        epoch = self.order.epoch
        if self.cache is None:
            return [[(int(i), epoch) for i in batch] for batch in plan]
        # Shared cache: the main process reads the bytes (lazily, one batch at a time).
        return _LazyCachedKeys(self.dataset, plan, epoch)  # type: ignore[return-value]

    def _run(self, plan: list[np.ndarray], start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        if not plan:
            return
        try:
            yield from self._run_workers(plan)
        except (RuntimeError, ConnectionError, EOFError) as e:
            # A worker killed (OOM killer, SIGKILL) surfaces as DataLoader's RuntimeError, or first as a
            # broken pipe to it: either way the persistent pool is broken for good.
            if isinstance(e, RuntimeError) and "DataLoader worker" not in str(e):
                raise
            why = str(e).split("\n")[0] or type(e).__name__
            log.warning("a decode worker died (%s); a new worker pool starts with the next pass", why)
            self._discard_workers()
            raise RuntimeError(
                f"a DataLoader worker died during this pass ({why}); the next pass starts a new one"
            ) from e

    def close(self) -> None:
        """Shut the decode workers down now (a later pass starts new ones)."""
        self._discard_workers()

    def _discard_workers(self) -> None:
        """Shut the worker pool down; the next pass starts a new one."""
        loader, self._loader = self._loader, None
        shutdown_workers(loader)

    def _run_workers(self, plan: list[np.ndarray]) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        self._plan.keys = self._keys(plan)
        batches = iter(self._dataloader())
        stream = torch.cuda.Stream(self.device) if self.gpu else None

        def to_device(b: dict[str, Any]) -> dict[str, Any]:
            if stream is None:
                return b
            with torch.cuda.stream(stream):
                for k in ("images", "labels", "flips", "boxes"):
                    if b[k] is not None:
                        b[k] = b[k].to(self.device, non_blocking=True)
            return b

        carry = 0  # planned samples of batches that were all bad, accounted with the next batch

        def next_batch() -> dict[str, Any] | None:
            nonlocal carry
            for b in batches:
                self._handle_bad(b["bad"])
                if len(b["labels"]) == 0:
                    carry += b["consumed"]
                    continue
                b["consumed"] += carry
                carry = 0
                return to_device(b)
            return None

        nxt = next_batch()
        while nxt is not None:
            cur = nxt
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
                for k in ("images", "labels", "flips", "boxes"):
                    if cur[k] is not None:
                        cur[k].record_stream(torch.cuda.current_stream(self.device))
            nxt = next_batch()  # the next copy overlaps this step
            if cur.get("normalized"):
                images = cur["images"]
            else:
                images = _finish(cur, self.recipe, self.dtype, self.memory_format)
            yield images, cur["labels"], cur["consumed"]

    def _handle_bad(self, bad: list[tuple[int, str]]) -> None:
        for index, reason in bad:
            if self.on_error == "raise":
                raise BadRecordError(bad_record_message(self.dataset, index, reason))
            self._skips.add(index, self.dataset.source(index), reason)


class _LazyCachedKeys:
    """Batches of keys carrying encoded bytes read through the main process's cache, made on demand."""

    def __init__(self, reader: Reader, plan: Sequence[np.ndarray], epoch: int) -> None:
        self.reader, self.plan, self.epoch = reader, plan, epoch

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[tuple]]:
        for batch in self.plan:
            keys = []
            for i in batch.tolist():
                data, label, reason = read_checked(self.reader, i)
                keys.append((i, self.epoch, None if data is None else np.asarray(data), label, reason))
            yield keys


# ----------------------------------------------------------------------------- backend choice


def dali_status() -> tuple[bool, str]:
    """(usable, why): whether NVIDIA DALI imports and can build a pipeline here."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "use the fallback"
        return False, f"nvidia.dali does not import ({type(e).__name__}: {e})"
    return True, "nvidia.dali imports"


_said: set[str] = set()


def _say_once(level: int, message: str) -> None:
    """Log the backend choice once per process (train makes a training and an evaluation loader)."""
    if message not in _said:
        _said.add(message)
        log.log(level, message)


def make_loader(dataset: Reader, batch_size: int, *, backend: str = "auto", **kw: Any) -> LoaderBase:
    """`DALIIterator` when DALI works here (``backend='auto'``), else `TorchIterator`; logs which and why."""
    if backend not in ("auto", "dali", "torch"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'dali' or 'torch'")
    if backend in ("auto", "dali"):
        ok, why = dali_status()
        if ok:
            from .iterator import DALIIterator

            kw.pop("num_workers", None)
            _say_once(logging.INFO, f"loader: DALI ({why})")
            return DALIIterator(dataset, batch_size, **kw)
        if backend == "dali":
            raise ImportError(f"backend='dali' but {why}; pip install nvidia-dali-cuda120 or use backend='auto'")
        _say_once(logging.WARNING, f"loader: falling back to TorchIterator: {why}")
    else:
        _say_once(logging.INFO, "loader: TorchIterator (asked for backend='torch')")
    return TorchIterator(dataset, batch_size, **kw)
