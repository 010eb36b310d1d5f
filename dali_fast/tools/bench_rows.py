"""The rows of ``bench``: one loader (and its training step or mix) run an epoch at a time (`loader_row`),
and the machine's decode-only ceiling on the same data and processes (`limit_row`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from ..data.base import Reader, read_checked
from ..data.targets import target_spec
from ..loaders.dataloader import shutdown_workers
from ..loaders.factory import make_loader
from ..loaders.torch_worker import collate_as_is, worker_init
from ..machine import available_cpus
from ..text import progress_bar
from ..train.trainer import Trainer
from ..transforms.decode import Decoder
from ..transforms.mix import MixupCutmix
from ..transforms.recipe import Recipe, resolve_recipe
from .ffcv_row import FFCV

log = logging.getLogger(__name__)

LIMIT = "limit"  # the row of the machine's decode-only ceiling


def _progress(desc: str, total: int, enabled: bool):
    return progress_bar(total, desc, "img", enabled=enabled, leave=False)


class Row:
    """One row of the table, run an epoch at a time: epoch 0 warms up, the others are timed.

    ``consume`` turns one batch into the number of images it delivered (a loader row runs its training
    step or mix there); ``close`` releases the loader's workers or pipeline, failed or not."""

    def __init__(
        self,
        kind: str,
        name: str,
        loader: Any,
        images: int,
        consume: Callable[[Any], int],
        *,
        monitor: Any,
        progress: bool,
        augment: str = "none",
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.kind, self.name, self.loader, self.images, self.consume = kind, name, loader, images, consume
        self.monitor, self.progress, self.augment, self.extra = monitor, progress, augment, extra or {}
        self.times: list[float] = []
        self.counts: list[int] = []
        self.sizes: list[int | None] = []  # each timed epoch's image size (a resolution schedule's)
        self.epochs_run = 0
        self.warmup: dict[str, Any] = {}  # the warm-up epoch's own figures: its time, build and cache

    def epoch(self) -> None:
        epoch, loader = self.epochs_run, self.loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)  # the plain DataLoader: its sampler carries a resolution schedule
        size = getattr(loader, "image_size", None) or getattr(getattr(loader, "sampler", None), "image_size", None)
        phase = self.name if epoch > 0 else f"{self.name}-warmup"
        bar = _progress(f"{self.name} epoch {epoch}{' (warm-up)' if epoch == 0 else ''}", self.images, self.progress)
        t0, n = time.perf_counter(), 0
        with bar, self.monitor.phase(phase):  # the bar is cleared before an error is written
            for batch in loader:
                done = self.consume(batch)
                n += done
                bar.update(done)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if epoch > 0:
            self.times.append(time.perf_counter() - t0)
            self.counts.append(n)
            self.sizes.append(size)
        else:  # warm-up and steady state apart: the timed epochs' figures leave the warm-up out
            self.warmup = {"seconds": time.perf_counter() - t0, "cache": self._cache()}
        self.epochs_run += 1

    def _cache(self) -> dict[str, float] | None:
        cache = self.extra.get("cache")
        return cache() if callable(cache) else cache

    def close(self) -> None:
        loader, self.loader = self.loader, None
        if loader is None:
            return
        if hasattr(loader, "close"):
            loader.close()
        else:
            shutdown_workers(loader)

    def result(self) -> dict[str, Any]:
        util = self.monitor.summary(self.name)
        extra = {k: (v() if callable(v) else v) for k, v in self.extra.items()}
        warm_cache = self.warmup.get("cache")
        extra["cache_warmup"] = warm_cache
        extra["cache"] = steady_cache(extra.get("cache"), warm_cache)
        build = getattr(self.loader, "build_seconds", None)
        return {
            "loader": self.kind,
            "augment": self.augment,
            "img_per_s": sum(self.counts) / sum(self.times),
            "epoch_s": sum(self.times) / len(self.times),
            "epoch_times": self.times,
            "epoch_sizes": self.sizes,
            "img_per_s_by_size": by_size(self.sizes, self.counts, self.times),
            "images_per_epoch": self.counts[0],
            "util_kind": util["kind"],
            "util_mean": util["mean"],
            "util_p50": util["p50"],
            "util_p95": util["p95"],
            # The monitor's reading (GPU: this process's memory as NVML sees it, DALI's pool and outputs
            # included; CPU: resident memory), not torch's allocator statistics, which leave DALI out.
            "peak_mem_bytes": util["peak_mem"],
            # Apart from img/s: the warm-up epoch (first reads, a cache filling, a pipeline build) and, for
            # DALI, the time spent building pipelines (graph and operators), which no timed epoch includes.
            "warmup_s": self.warmup.get("seconds"),
            "build_s": build,
            **extra,
        }


def steady_cache(now: dict[str, float] | None, warm: dict[str, float] | None) -> dict[str, float] | None:
    """The cache's figures of the timed epochs alone: ``now`` less what the warm-up (``warm``) counted."""
    if now is None or warm is None:
        return now
    hits, misses = now["hits"] - warm["hits"], now["misses"] - warm["misses"]
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "evictions": now["evictions"] - warm["evictions"],
        "bytes": now["bytes"],
    }


def by_size(sizes: list[int | None], counts: list[int], times: list[float]) -> dict[int, float]:
    """img/s of the timed epochs at each image size (a resolution schedule's), smallest size first."""
    out: dict[int, float] = {}
    for size in sorted({s for s in sizes if s is not None}):
        picked = [k for k, s in enumerate(sizes) if s == size]
        out[size] = sum(counts[k] for k in picked) / sum(times[k] for k in picked)
    return out


def loader_row(
    kind: str,
    reader: Reader,
    *,
    batch_size: int,
    image_size: int,
    model: str,
    cache_bytes: int,
    controller: bool,
    monitor: Any,
    progress: bool,
    on_error: str = "raise",
    recipe: Recipe | None = None,
    mix: dict[str, float] | None = None,
    name: str | None = None,
) -> Row:
    """A loader's row over ``reader``: loading (+ a training step unless model='none'), ``recipe`` per
    image, ``mix`` (MixupCutmix settings) on each batch on the device it arrives on, inside the timed loop."""
    from ..loaders.controller import BatchSizeController

    ctrl = BatchSizeController(max(8, batch_size // 4), batch_size * 4) if controller and kind != "baseline" else None
    # Same number of decode processes for the two DataLoader-based rows (DALI uses as many threads).
    workers = available_cpus()
    iterator_only = {"cache_bytes": cache_bytes, "controller": ctrl} if kind != "baseline" else {}
    target, width = target_spec(reader)  # class labels, or the multi-hot / float rows the reader was opened with
    if kind == FFCV:  # FFCV's own Loader over its .beton of the same data, written once into the cache
        from .ffcv_row import FFCVLoader, write_beton

        ffcv_recipe = resolve_recipe(recipe, image_size=image_size)
        loader: Any = FFCVLoader(write_beton(reader, workers), batch_size, workers, ffcv_recipe)
    else:
        loader = make_loader(
            reader,
            batch_size,
            backend=kind,
            train=True,
            image_size=image_size,
            num_workers=workers,
            on_error=on_error,
            recipe=recipe,
            **iterator_only,
        )
    mixer = MixupCutmix(**mix, num_classes=width, target=target) if mix else None
    trainer = Trainer(model, width, mix=mixer, target=target) if model != "none" else None
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()

    def consume(batch: Any) -> int:
        images, labels = batch
        if trainer is not None:
            trainer.step(images, labels, ctrl)
        else:
            if gpu:
                images = images.to("cuda", non_blocking=True)
            if mixer is not None:
                images, _ = mixer(images, labels.to(images.device))
        return len(labels)

    augment = (recipe.auto_augment if recipe is not None else None) or "none"
    extra = {
        "cache": lambda: loader.cache_stats() if hasattr(loader, "cache_stats") else None,
        "batch_decisions": lambda: ctrl.history if ctrl is not None else [],
    }
    return Row(
        kind,
        name or kind,
        loader,
        len(reader),
        consume,
        monitor=monitor,
        progress=progress,
        augment=augment,
        extra=extra,
    )


def run_alone(row: Row, epochs: int) -> dict[str, Any]:
    try:
        for _ in range(epochs + 1):
            row.epoch()
        return row.result()
    finally:
        # Worker pools and a DALI pipeline kept between epochs end with their row, failed or not.
        row.close()


class _DecodeOnly(Dataset):
    """The limit row's work: read and decode each record of a batch whole (no crop, no resize), with
    the decoder `TorchIterator` uses (libjpeg-turbo for plain JPEGs, Pillow for the rest)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self._decoder: Decoder | None = None

    def __len__(self) -> int:
        return len(self.reader)

    def __getitems__(self, indices: list[int]) -> int:
        if self._decoder is None:
            self._decoder = Decoder()
        done = 0
        for i in indices:
            data, _, reason = read_checked(self.reader, i)
            if reason is None:
                try:
                    self._decoder.open(data).decode()
                except Exception:  # noqa: BLE001 - a bad record is no image: it only costs its failed decode
                    continue
                done += 1
        return done


def limit_row(reader: Reader, *, workers: int, batch_size: int, monitor: Any, progress: bool) -> Row:
    """The machine's ceiling on this data: reading and decoding every record whole (no crop) in
    ``workers`` processes, what a loader would reach if decoding were all it did. Loaders read as a
    share of it."""
    from torch.utils.data import DataLoader

    order = list(range(len(reader)))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    kw: dict[str, Any] = {"persistent_workers": True, "worker_init_fn": worker_init} if workers else {}
    loader = DataLoader(_DecodeOnly(reader), batch_sampler=batches, num_workers=workers, collate_fn=collate_as_is, **kw)
    extra = {"workers": workers, "cache": None, "batch_decisions": []}
    return Row(LIMIT, LIMIT, loader, len(reader), int, monitor=monitor, progress=progress, extra=extra)
