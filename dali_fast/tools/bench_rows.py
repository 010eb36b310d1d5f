"""The rows of ``bench``: one loader (and its training step or mix) run an epoch at a time (`loader_row`),
and the machine's decode-only ceiling on the same data and processes (`limit_row`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..data.base import Reader, read_checked
from ..data.targets import target_spec
from ..loaders.dataloader import shutdown_workers
from ..loaders.factory import make_loader
from ..loaders.torch_worker import collate_as_is, worker_init
from ..machine import cpus_per_local_rank
from ..text import progress_bar
from ..train.trainer import Trainer
from ..transforms.decode import Decoder
from ..transforms.mix import MixupCutmix
from ..transforms.recipe import Recipe, resolve_recipe
from .ffcv_row import FFCV
from .spdl_row import SPDL, SPDLLoader
from .tree_memory import TreeMemory

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
        memory: TreeMemory | None = None,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.kind, self.name, self.loader, self.images, self.consume = kind, name, loader, images, consume
        self.monitor, self.progress, self.augment, self.extra = monitor, progress, augment, extra or {}
        self.memory = memory if memory is not None else TreeMemory()
        self.sync = sync  # under --ranks: every rank's step waits for the slowest (`bench_ranks`)
        self.own: set[int] = set()  # this row's worker processes (bench sets it after the warm-up)
        self.exclude: set[int] = set()  # processes of other rows alive beside this one, left out of its PSS
        self.batch_times: list[list[float]] = []  # each timed epoch's batch times, in order
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
        memory = self.memory.phase(self.name, self.exclude) if epoch > 0 else nullcontext()
        gpu = torch.cuda.is_available()
        steps: list[float] = []
        # the bar is cleared before an error is written
        with memory, bar, self.monitor.phase(phase):
            t0 = last = time.perf_counter()
            n = 0
            for batch in loader:
                done = self.consume(batch)
                if gpu:
                    torch.cuda.synchronize()  # a step ends when its batch is on the device
                if self.sync is not None:
                    self.sync()
                now = time.perf_counter()
                steps.append(now - last)
                last = now
                n += done
                bar.update(done)
            seconds = time.perf_counter() - t0
            if epoch > 0:
                self.memory.read_now()  # the epoch's end, after the clock stopped
        if epoch > 0:
            self.times.append(seconds)
            self.counts.append(n)
            self.sizes.append(size)
            self.batch_times.append(steps)
        else:  # warm-up and steady state apart: the timed epochs' figures leave the warm-up out
            self.warmup = {"seconds": seconds, "cache": self._cache()}
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
            "epoch_counts": self.counts,
            "epoch_sizes": self.sizes,
            "img_per_s_by_size": by_size(self.sizes, self.counts, self.times),
            "images_per_epoch": self.counts[0],
            "util_kind": util["kind"],
            "util_mean": util["mean"],
            "util_p50": util["p50"],
            "util_p95": util["p95"],
            **batch_tails(self.batch_times),
            # What the loader costs in host memory: the PSS of the main process and every worker under
            # it, sampled during the timed epochs (`tree_memory`); other live rows' workers left out.
            "pss_peak_bytes": self.memory.peak(self.name),
            # The monitor's reading: on a GPU this process's device memory as NVML sees it (DALI's pool
            # and outputs included, which torch's allocator statistics leave out); on the CPU the main
            # process's resident set alone, kept for reference.
            **(
                {"gpu_mem_peak_bytes": util["peak_mem"]}
                if util["kind"] == "gpu"
                else {"main_rss_peak_bytes": util["peak_mem"]}
            ),
            # Apart from img/s: the warm-up epoch (first reads, a cache filling, a pipeline build) and, for
            # DALI, the time spent building pipelines (graph and operators), which no timed epoch includes.
            "warmup_s": self.warmup.get("seconds"),
            "build_s": build,
            **extra,
        }


def batch_tails(batch_times: list[list[float]]) -> dict[str, Any]:
    """The steady-state batch time of the timed epochs: its median, its 99th percentile and their ratio.

    A batch's time runs from the end of the step before to the end of its own (the wait for the batch
    plus the step, and under ``--ranks`` the wait for the slowest rank). Each epoch's first batch is
    left out: it includes the epoch's start (workers refilling their queues); it is kept apart as
    ``first_batch_s``. With one batch an epoch there is nothing else, and the first batches are used.
    """
    steady = [t for epoch in batch_times for t in epoch[1:]]
    firsts = [epoch[0] for epoch in batch_times if epoch]
    picked = steady or firsts
    if not picked:
        return {"batch_p50_s": None, "batch_p99_s": None, "p99_over_p50": None, "batches_timed": 0}
    p50, p99 = (float(v) for v in np.percentile(picked, [50, 99]))
    return {
        "batch_p50_s": p50,
        "batch_p99_s": p99,
        "p99_over_p50": p99 / p50 if p50 > 0 else None,
        "batches_timed": len(picked),
        "first_batch_s": firsts,
        "batch_times": batch_times,
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
    # Same number of decode processes for the two DataLoader-based rows (DALI, FFCV and SPDL use as many
    # threads); under --ranks, each rank's share of the CPUs.
    workers = cpus_per_local_rank()
    iterator_only = {"cache_bytes": cache_bytes, "controller": ctrl} if kind != "baseline" else {}
    target, width = target_spec(reader)  # class labels, or the multi-hot / float rows the reader was opened with
    if kind == FFCV:  # FFCV's own Loader over its .beton of the same data, written once into the cache
        from .ffcv_row import FFCVLoader, write_beton

        ffcv_recipe = resolve_recipe(recipe, image_size=image_size)
        loader: Any = FFCVLoader(write_beton(reader, workers), batch_size, workers, ffcv_recipe)
    elif kind == SPDL:  # SPDL's pipeline of threads and its FFmpeg decoder over the same reader
        spdl_recipe = resolve_recipe(recipe, image_size=image_size)
        loader = SPDLLoader(reader, batch_size, workers, spdl_recipe, on_error=on_error)
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


def run_alone(row: Row, epochs: int, warm: bool = False) -> dict[str, Any]:
    """The row's warm-up (unless ``warm``: done already) and ``epochs`` timed epochs, then its result;
    the row is closed either way."""
    try:
        for _ in range(epochs if warm else epochs + 1):
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


def limit_row(
    reader: Reader,
    *,
    workers: int,
    batch_size: int,
    monitor: Any,
    progress: bool,
    indices: list[int] | None = None,
) -> Row:
    """The machine's ceiling on this data: reading and decoding every record whole (no crop) in
    ``workers`` processes, what a loader would reach if decoding were all it did. Loaders read as a
    share of it. ``indices``: the records to read (a rank's shard), default all."""
    from torch.utils.data import DataLoader

    order = list(range(len(reader))) if indices is None else indices
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    kw: dict[str, Any] = {"persistent_workers": True, "worker_init_fn": worker_init} if workers else {}
    loader = DataLoader(_DecodeOnly(reader), batch_sampler=batches, num_workers=workers, collate_fn=collate_as_is, **kw)
    extra = {"workers": workers, "cache": None, "batch_decisions": []}
    return Row(LIMIT, LIMIT, loader, len(order), int, monitor=monitor, progress=progress, extra=extra)
