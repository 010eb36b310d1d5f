"""`dali-fast stages`: what each optimization buys, measured cumulatively, one stage per row.

Each row adds one thing to the row above, on the same data, in one run:

1. baseline        the plain DataLoader of `baseline.py` (per-sample Pillow decode and transforms)
2. + cache         the same, its data set read through an `LRUCache` (one per worker process: that is what
                   a DataLoader's workers get; each sample reports whether it was a hit)
3. + factory       `make_dataloader`: pinned memory, deeper prefetch, persistent workers
4. + device ops    `TorchIterator`: normalize and flip as one batched op on the device, the cache shared
                   by all workers in the main process, JPEG draft-mode decode
5. + DALI          `DALIIterator` (GPU `mixed` decoding on a GPU, DALI's CPU-only mode otherwise)
6. + controller    `BatchSizeController` sets the batch size between epochs (more epochs, so it settles)
7. + progressive resizing   ``--progressive`` (default: FFCV's ramp scaled to the run, ``default_ramp``);
                   each size is timed, the projected run adds the epochs at their sizes' speeds

Per row: img/s, epoch time, the projected run (``total_images x total_epochs / img/s``), utilization, peak
memory (share of the GPU's or of RAM), cache hit rate, batch size, ratio to row 1; a stage that cannot run
here is listed with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.base import Reader
from ..data.cache import CachedReader, LRUCache
from ..files import atomic_write, check_writable_folder
from ..loaders.baseline import BaselineDataset, make_baseline_loader
from ..loaders.dataloader import make_dataloader
from ..loaders.factory import dali_status
from ..machine import available_cpus, memory_capacity
from ..transforms.recipe import Progressive, Recipe
from . import report
from .bench import bench_data, check_batch_fits

log = logging.getLogger(__name__)

IMAGENET_IMAGES = 1_281_167


@dataclass(frozen=True)
class Stage:
    name: str
    adds: str  # what this row adds to the one above


STAGES = (
    Stage("baseline", "plain DataLoader (baseline.py)"),
    Stage("+ cache", "LRU cache in front of the reader"),
    Stage("+ factory", "optimized DataLoader factory: pinned memory, prefetch, persistent workers"),
    Stage("+ device ops", "normalize/flip on the device (TorchIterator), one shared cache"),
    Stage("+ DALI", "DALI decoding (DALIIterator)"),
    Stage("+ controller", "memory-aware batch size (BatchSizeController)"),
    Stage("+ progressive resizing", "low resolution early, full late (a resolution schedule)"),
)
PROGRESSIVE = "+ progressive resizing"


def default_ramp(image_size: int, total_epochs: int) -> Progressive:
    """FFCV's ImageNet ramp scaled to a run: from 5/7 of the size (160 px for 224) to the size, ramped over
    the epochs FFCV ramps over in its 88-epoch run (65 to 76), in steps of 32 px (of 8 below 64 px)."""
    step = 32 if image_size >= 64 else 8
    start = max(step, min(image_size, round(image_size * 5 / 7 / step) * step))
    return Progressive(start, image_size, round(total_epochs * 65 / 88), round(total_epochs * 76 / 88), step=step)


class _CacheReportingDataset(BaselineDataset):
    """The baseline's per-sample transforms over a reader with an LRU cache; each sample says if it hit."""

    def __init__(self, reader: Reader, cache_bytes: int, image_size: int) -> None:
        super().__init__(CachedReader(reader, LRUCache(cache_bytes)), train=True, image_size=image_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:  # type: ignore[override]
        cache = self.reader.cache  # type: ignore[attr-defined]
        before = cache.hits
        x, label = super().__getitem__(i)  # type: ignore[misc]
        return x, label, int(cache.hits > before)


def _collate_with_hits(samples: list[tuple[torch.Tensor, int, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    images = torch.stack([s[0] for s in samples])
    labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    return images, labels, sum(s[2] for s in samples)


def stage_peak_memory(monitor: Any, phases: list[str]) -> int | None:
    """A stage's peak memory as ``bench`` reads it: the monitor's per-process reading over the stage's
    phases (on a GPU, NVML's figure for this process: DALI's pool and outputs included, which torch's
    allocator statistics leave out; on a CPU, this process's resident memory)."""
    peaks = [monitor.summary(p)["peak_mem"] for p in phases]
    peaks = [int(p) for p in peaks if isinstance(p, int | float)]
    return max(peaks) if peaks else None


@dataclass
class _Bench:
    """What every stage runs on: the same data (``files``, what the DataLoader rows read; ``reader``, what the
    iterators read: see `bench.BenchData`), batch, image size, cache budget and processes."""

    files: Reader
    reader: Reader
    batch_size: int
    image_size: int
    cache_bytes: int
    workers: int
    gpu: bool


def run_stages(
    dataset: str | os.PathLike | Reader | None = None,
    *,
    images: int = 2000,
    epochs: int = 2,
    batch_size: int = 64,
    image_size: int = 224,
    model: str = "none",
    cache_bytes: int | None = None,
    total_epochs: int = 90,
    total_images: int = IMAGENET_IMAGES,
    controller_epochs: int | None = None,
    progressive: Progressive | None = None,
    out: str | Path = "bench-results",
    progress: bool = True,
    emit: Callable[[str], None] = log.info,
    open_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure the stages cumulatively; writes stages.json and stages.png into ``out``. ``dataset`` is what
    `bench` takes (opened once, with ``open_options``); ``progressive`` is the last row's schedule (default: `default_ramp` of
    ``image_size`` over ``total_epochs``)."""
    from ..train.monitor import UtilizationMonitor
    from ..train.trainer import Trainer

    for name, value in (("total_epochs", total_epochs), ("total_images", total_images), ("epochs", epochs)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be a whole number of 1 or more")
    if batch_size < 1 or image_size < 1:
        raise ValueError("--batch-size and --image-size must be 1 or more")
    if cache_bytes is not None and cache_bytes < 1:
        raise ValueError(f"--cache-bytes {cache_bytes}: the cache rows need a budget; leave it out for half the data")
    check_writable_folder(out, "--out")
    data = bench_data(dataset, images, progress, open_options)
    ramp = progressive if progressive is not None else default_ramp(image_size, total_epochs)
    bench = _Bench(data.files, data.reader, batch_size, image_size, 0, available_cpus(), False)
    n = len(bench.reader)
    check_batch_fits(batch_size, n, data.name)
    data_bytes = sum(len(bench.reader[i][0]) for i in range(n))
    # Smaller than the data, as in real use, unless given: the hit rate is honest.
    bench.cache_bytes = data_bytes // 2 if cache_bytes is None else cache_bytes
    bench.gpu = torch.cuda.is_available()
    controller_epochs = controller_epochs or max(epochs, 3)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dali_ok, dali_why = dali_status()
    rows: list[dict[str, Any]] = []
    with UtilizationMonitor() as mon:
        for stage in STAGES:
            row: dict[str, Any] = {
                "stage": stage.name,
                "adds": stage.adds,
                "settings": [s.adds for s in STAGES][: len(rows) + 1],
            }
            rows.append(row)
            if stage.name == PROGRESSIVE:
                row["adds"] = f"{stage.adds}: {ramp} (START:END:FROM_EPOCH:TO_EPOCH), eval at {image_size} px"
                row["settings"][-1] = row["adds"]
            if stage.name in ("+ DALI", "+ controller", PROGRESSIVE) and not dali_ok:
                row["skipped"] = f"DALI cannot run here: {dali_why}"
                emit(f"stage {stage.name}: skipped ({row['skipped']})")
                continue
            emit(f"stage {stage.name}: {stage.adds} ...")
            loader, ctrl = _stage_loader(stage.name, bench, ramp)
            trainer = Trainer(model, len(bench.reader.classes)) if model != "none" else None
            if stage.name == PROGRESSIVE:
                measured = _measure_sizes(stage.name, loader, ctrl, trainer, mon, epochs, bench, ramp, total_epochs)
                row.update(_figures_sizes(stage.name, loader, ctrl, mon, measured, ramp, total_images, total_epochs))
                continue
            measured = _measure(stage.name, loader, ctrl, trainer, mon, controller_epochs if ctrl else epochs, bench)
            row.update(_figures(stage.name, loader, ctrl, mon, measured, total_images * total_epochs))
    settings = {
        "dataset": data.name,
        "images": n,
        "data_bytes": data_bytes,
        "cache_bytes": bench.cache_bytes,
        "epochs": epochs,
        "controller_epochs": controller_epochs,
        "batch_size": batch_size,
        "image_size": image_size,
        "model": model,
        "total_epochs": total_epochs,
        "total_images": total_images,
        "progressive": str(ramp),
    }
    return _write(rows, settings, out)


def _write(rows: list[dict[str, Any]], settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """Each row's ratio to row 1, and the result (rows, table, machine) written to stages.json and stages.png."""
    base = rows[0].get("img_per_s")
    for r in rows:
        if "img_per_s" in r and base:
            r["x_baseline"] = r["img_per_s"] / base
    table = report.stages_table(rows, settings["total_images"], settings["total_epochs"])
    result = {"settings": settings, "machine": report.machine_info(), "rows": rows, "table": table}
    atomic_write(out / "stages.json", lambda f: f.write(json.dumps(result, indent=1, default=str).encode()))
    title = f"model={settings['model']}, {settings['image_size']}px, batch {settings['batch_size']}"
    report.plot_stages(rows, out / "stages.png", title)
    return result


def _stage_loader(stage: str, bench: _Bench, ramp: Progressive | None = None) -> tuple[Any, Any]:
    """(the loader of ``stage``, its BatchSizeController or None); ``ramp``: the progressive row's schedule."""
    from ..loaders.controller import BatchSizeController
    from ..loaders.torch_iterator import TorchIterator

    batch_size, workers = bench.batch_size, bench.workers
    if stage == "baseline":
        return make_baseline_loader(bench.files, batch_size, image_size=bench.image_size, num_workers=workers), None
    if stage == "+ cache":
        ds = _CacheReportingDataset(bench.files, bench.cache_bytes, bench.image_size)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
            collate_fn=_collate_with_hits,
        )
        return loader, None
    if stage == "+ factory":
        ds = _CacheReportingDataset(bench.files, bench.cache_bytes, bench.image_size)
        loader = make_dataloader(
            ds, batch_size, shuffle=True, num_workers=workers, prefetch_factor=4, collate_fn=_collate_with_hits
        )
        return loader, None
    common = {"image_size": bench.image_size, "cache_bytes": bench.cache_bytes, "seed": 0}
    if stage == "+ device ops":
        return TorchIterator(bench.reader, batch_size, num_workers=workers, **common), None
    from ..loaders.dali_iterator import DALIIterator

    if stage == "+ DALI":
        return DALIIterator(bench.reader, batch_size, **common), None
    ctrl = BatchSizeController(max(8, batch_size // 4), batch_size * 4)
    if stage == PROGRESSIVE:
        common["recipe"] = Recipe(image_size=common.pop("image_size"), resolution=ramp)
    return DALIIterator(bench.reader, batch_size, controller=ctrl, **common), ctrl


def _consume(images: torch.Tensor, labels: torch.Tensor, trainer: Any, ctrl: Any, bench: _Bench) -> None:
    """One batch's work in a timed epoch: a training step, or on a GPU the copy to the device a step makes."""
    if trainer is not None:
        trainer.step(images, labels, ctrl)
    elif bench.gpu:
        images.to("cuda", non_blocking=True)


def _measure_sizes(
    stage: str,
    loader: Any,
    ctrl: Any,
    trainer: Any,
    mon: Any,
    epochs: int,
    bench: _Bench,
    ramp: Progressive,
    total_epochs: int,
) -> dict[str, Any]:
    """Each size the run trains at, in the run's order: the first epoch at that size warms up (the new
    pipeline, the cache), then ``epochs`` timed passes of it; per size, its img/s."""
    first: dict[int, int] = {}
    for e in range(total_epochs):
        first.setdefault(ramp(e), e)
    sizes: dict[int, dict[str, Any]] = {}
    for size, epoch in first.items():
        times, counts = [], []
        for k in range(epochs + 1):
            loader.set_epoch(epoch)
            t0, seen = time.perf_counter(), 0
            with mon.phase(f"{stage}#{size}#{k}"):
                for images, labels in loader:
                    _consume(images, labels, trainer, ctrl, bench)
                    seen += len(labels)
                if bench.gpu:
                    torch.cuda.synchronize()
            if k > 0:
                times.append(time.perf_counter() - t0)
                counts.append(seen)
        sizes[size] = {"img_per_s": sum(counts) / sum(times), "times": times, "batch_size": loader.batch_size}
    loader.close()
    return {"sizes": sizes, "epochs": epochs}


def _figures_sizes(
    stage: str,
    loader: Any,
    ctrl: Any,
    mon: Any,
    measured: dict[str, Any],
    ramp: Progressive,
    total_images: int,
    total_epochs: int,
) -> dict[str, Any]:
    """The progressive row: the projected run adds each epoch at its size's speed; its img/s is the run's
    average (images over the projected time), so the ratio to row 1 is the time the schedule saves."""
    sizes = measured["sizes"]
    projected = sum(total_images / sizes[ramp(e)]["img_per_s"] for e in range(total_epochs))
    timed = [f"{stage}#{s}#{k}" for s in sizes for k in range(1, measured["epochs"] + 1)]
    util = [u for u in (mon.summary(p)["mean"] for p in timed) if isinstance(u, float)]
    peak = stage_peak_memory(mon, timed)
    capacity = memory_capacity(mon.kind)
    times = [t for s in sizes.values() for t in s["times"]]
    stats = loader.cache_stats() if hasattr(loader, "cache_stats") else None
    return {
        "img_per_s": total_images * total_epochs / projected,
        "epoch_s": sum(times) / len(times),
        "projected_s": projected,
        "img_per_s_by_size": {s: v["img_per_s"] for s, v in sizes.items()},
        "epochs_by_size": {s: sum(1 for e in range(total_epochs) if ramp(e) == s) for s in sizes},
        "util_kind": mon.kind,
        "util_mean": sum(util) / len(util) if util else None,
        "peak_mem_bytes": peak,
        "peak_mem_fraction": (peak / capacity) if peak and capacity else None,
        "cache_hit_rate": stats["hit_rate"] if stats else None,
        "batch_size": ctrl.batch_size,
        "batch_sizes": [v["batch_size"] for v in sizes.values()],
        "batch_decisions": ctrl.history,
        "epochs_timed": len(times),
    }


def _measure(stage: str, loader: Any, ctrl: Any, trainer: Any, mon: Any, epochs: int, bench: _Bench) -> dict[str, Any]:
    """A warm-up epoch (which also fills the cache), then ``epochs`` timed ones, each a monitor phase:
    their times, images, cache hits (for the DataLoader rows, as their samples report them) and batch sizes."""
    times, counts, hits, batch_sizes = [], [], 0, []
    for epoch in range(epochs + 1):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batch_sizes.append(getattr(loader, "batch_size", bench.batch_size))
        t0, seen = time.perf_counter(), 0
        with mon.phase(f"{stage}#{epoch}"):
            for batch in loader:
                images, labels = batch[0], batch[1]
                if len(batch) > 2 and epoch > 0:
                    hits += int(batch[2])
                _consume(images, labels, trainer, ctrl, bench)
                seen += len(labels)
            if bench.gpu:
                torch.cuda.synchronize()
        if epoch > 0:  # epoch 0 warms up (and fills the cache)
            times.append(time.perf_counter() - t0)
            counts.append(seen)
        elif getattr(loader, "cache", None) is not None:
            loader.cache.reset_stats()  # the hit rate of the timed epochs only
    if hasattr(loader, "close"):
        loader.close()
    return {"times": times, "counts": counts, "hits": hits, "batch_sizes": batch_sizes, "epochs": epochs}


def _figures(stage: str, loader: Any, ctrl: Any, mon: Any, measured: dict[str, Any], run_images: int) -> dict[str, Any]:
    """A stage's row: speed, the projected run (``run_images`` at its speed), utilization, peak memory,
    cache hit rate, batch size (a controller's settled one: its last epoch, and that epoch's speed)."""
    times, counts = measured["times"], measured["counts"]
    timed = [f"{stage}#{e}" for e in range(1, measured["epochs"] + 1)]
    util = [u for u in (mon.summary(p)["mean"] for p in timed) if isinstance(u, float)]
    if ctrl is not None:
        times, counts = times[-1:], counts[-1:]
    stats = loader.cache_stats() if hasattr(loader, "cache_stats") else None
    hit_rate = (
        stats["hit_rate"] if stats else (measured["hits"] / sum(counts) if stage in ("+ cache", "+ factory") else None)
    )
    peak = stage_peak_memory(mon, timed)
    capacity = memory_capacity(mon.kind)
    img_s = sum(counts) / sum(times)
    figures = {
        "img_per_s": img_s,
        "epoch_s": sum(times) / len(times),
        "projected_s": run_images / img_s,
        "util_kind": mon.kind,
        "util_mean": sum(util) / len(util) if util else None,
        "peak_mem_bytes": peak,
        "peak_mem_fraction": (peak / capacity) if peak and capacity else None,
        "cache_hit_rate": hit_rate,
        "batch_size": measured["batch_sizes"][-1] if ctrl is None else ctrl.batch_size,
        "batch_sizes": measured["batch_sizes"],
        "epochs_timed": len(times),
    }
    if ctrl is not None:
        figures["batch_decisions"] = ctrl.history
    return figures
