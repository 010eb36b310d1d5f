"""`dali-fast bench --stages`: what each optimization buys, measured cumulatively, one stage per row.

Each row adds one thing to the row above, on the same data, in one run:

1. baseline        the plain DataLoader of `baseline.py` (per-sample Pillow decode and transforms)
2. + cache         the same, its data set read through an `LRUCache` (one per worker process: that is what
                   a DataLoader's workers get; each sample reports whether it was a hit)
3. + factory       `make_dataloader`: pinned memory, deeper prefetch, persistent workers
4. + device ops    `TorchIterator`: normalize and flip as one batched op on the device, the cache shared
                   by all workers in the main process, JPEG draft-mode decode
5. + DALI          `DALIIterator` (GPU `mixed` decoding on a GPU, DALI's CPU-only mode otherwise)
6. + controller    `BatchSizeController` sets the batch size between epochs (more epochs, so it settles)

Per row: img/s, epoch time, the projected time of a whole training run (``total_images x total_epochs /
img/s``), utilization, peak memory as a fraction of the device's (GPU) or of RAM (CPU), cache hit rate,
batch size and the ratio to row 1. A stage that cannot run here is listed with the reason.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .data.base import Reader
from .data.cache import CachedReader, LRUCache
from .data.open import open_dataset
from .data.synthetic import default_dataset
from .loaders.baseline import BaselineDataset, make_baseline_loader
from .loaders.dataloader import make_dataloader
from .loaders.factory import dali_status
from .system import atomic_write, available_cpus, read_proc_kib

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
)


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


def memory_capacity(kind: str) -> int | None:
    """Bytes of the memory a peak is a fraction of: the GPU's (``kind`` "gpu") or the machine's RAM."""
    if kind == "gpu":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    total_kib = read_proc_kib("/proc/meminfo", "MemTotal")
    return (total_kib or 0) * 1024 or None


def stage_peak_memory(monitor: Any, phases: list[str]) -> int | None:
    """A stage's peak memory as ``bench`` reads it: the monitor's per-process reading over the stage's
    phases (on a GPU, NVML's figure for this process: DALI's pool and outputs included, which torch's
    allocator statistics leave out; on a CPU, this process's resident memory)."""
    peaks = [monitor.summary(p)["peak_mem"] for p in phases]
    peaks = [int(p) for p in peaks if isinstance(p, int | float)]
    return max(peaks) if peaks else None


def fmt_duration(seconds: float) -> str:
    """Hours under two days, days from there (the article's unit for a whole run)."""
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def run_stages(
    dataset: str | Path | None = None,
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
    out: str | Path = "bench-results",
    progress: bool = True,
    emit: Callable[[str], None] = log.info,
) -> dict[str, Any]:
    """Measure the six stages cumulatively; writes stages.json and stages.png into ``out``."""
    from .bench import machine_info
    from .train.monitor import UtilizationMonitor
    from .train.trainer import Trainer

    for name, value in (("total_epochs", total_epochs), ("total_images", total_images), ("epochs", epochs)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be a whole number of 1 or more")
    if batch_size < 1 or image_size < 1:
        raise ValueError("--batch-size and --image-size must be 1 or more")
    if dataset is None:
        folder, packed = default_dataset(images, progress=progress)
    else:
        folder = packed = Path(dataset)
    folder_reader, packed_reader = open_dataset(folder), open_dataset(packed)
    n = len(packed_reader)
    data_bytes = sum(len(packed_reader[i][0]) for i in range(n))
    if cache_bytes is None:
        cache_bytes = data_bytes // 2  # smaller than the data, as in real use: the hit rate is honest
    controller_epochs = controller_epochs or max(epochs, 3)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    workers = available_cpus()
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    dali_ok, dali_why = dali_status()
    rows: list[dict[str, Any]] = []
    settings: list[str] = []

    def make(stage: str) -> tuple[Any, Any]:
        from .loaders.controller import BatchSizeController
        from .loaders.torch_iterator import TorchIterator

        if stage == "baseline":
            return make_baseline_loader(folder_reader, batch_size, image_size=image_size, num_workers=workers), None
        if stage == "+ cache":
            ds = _CacheReportingDataset(folder_reader, cache_bytes, image_size)
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
            ds = _CacheReportingDataset(folder_reader, cache_bytes, image_size)
            loader = make_dataloader(
                ds, batch_size, shuffle=True, num_workers=workers, prefetch_factor=4, collate_fn=_collate_with_hits
            )
            return loader, None
        common = dict(image_size=image_size, cache_bytes=cache_bytes, seed=0)
        if stage == "+ device ops":
            return TorchIterator(packed_reader, batch_size, num_workers=workers, **common), None
        from .loaders.dali_iterator import DALIIterator

        if stage == "+ DALI":
            return DALIIterator(packed_reader, batch_size, **common), None
        ctrl = BatchSizeController(max(8, batch_size // 4), batch_size * 4)
        return DALIIterator(packed_reader, batch_size, controller=ctrl, **common), ctrl

    with UtilizationMonitor() as mon:
        for stage in STAGES:
            settings = [*settings, stage.adds]
            row: dict[str, Any] = {"stage": stage.name, "adds": stage.adds, "settings": list(settings)}
            rows.append(row)
            if stage.name in ("+ DALI", "+ controller") and not dali_ok:
                row["skipped"] = f"DALI cannot run here: {dali_why}"
                emit(f"stage {stage.name}: skipped ({row['skipped']})")
                continue
            emit(f"stage {stage.name}: {stage.adds} ...")
            loader, ctrl = make(stage.name)
            trainer = Trainer(model, len(packed_reader.classes)) if model != "none" else None
            run_epochs = controller_epochs if ctrl is not None else epochs
            times, counts, hits, batch_sizes = [], [], 0, []
            for epoch in range(run_epochs + 1):
                if hasattr(loader, "set_epoch"):
                    loader.set_epoch(epoch)
                batch_sizes.append(getattr(loader, "batch_size", batch_size))
                phase = f"{stage.name}#{epoch}"
                t0, seen = time.perf_counter(), 0
                with mon.phase(phase):
                    for batch in loader:
                        images, labels = batch[0], batch[1]
                        if len(batch) > 2 and epoch > 0:
                            hits += int(batch[2])
                        if trainer is not None:
                            trainer.step(images, labels, ctrl)
                        elif kind == "gpu":
                            images = images.to("cuda", non_blocking=True)
                        seen += len(labels)
                    if kind == "gpu":
                        torch.cuda.synchronize()
                if epoch > 0:  # epoch 0 warms up (and fills the cache)
                    times.append(time.perf_counter() - t0)
                    counts.append(seen)
                elif getattr(loader, "cache", None) is not None:
                    loader.cache.reset_stats()  # the hit rate of the timed epochs only
            if hasattr(loader, "close"):
                loader.close()
            timed = [f"{stage.name}#{e}" for e in range(1, run_epochs + 1)]
            util = [mon.summary(p)["mean"] for p in timed]
            util = [u for u in util if isinstance(u, float)]
            if ctrl is not None:  # the settled size: the last epoch's, and its speed
                times, counts = times[-1:], counts[-1:]
            stats = loader.cache_stats() if hasattr(loader, "cache_stats") else None
            hit_rate = (
                stats["hit_rate"] if stats else (hits / sum(counts) if stage.name in ("+ cache", "+ factory") else None)
            )
            peak = stage_peak_memory(mon, timed)
            capacity = memory_capacity(mon.kind)
            img_s = sum(counts) / sum(times)
            row.update(
                {
                    "img_per_s": img_s,
                    "epoch_s": sum(times) / len(times),
                    "projected_s": total_images * total_epochs / img_s,
                    "util_kind": mon.kind,
                    "util_mean": sum(util) / len(util) if util else None,
                    "peak_mem_bytes": peak,
                    "peak_mem_fraction": (peak / capacity) if peak and capacity else None,
                    "cache_hit_rate": hit_rate,
                    "batch_size": batch_sizes[-1] if ctrl is None else ctrl.batch_size,
                    "batch_sizes": batch_sizes,
                    "epochs_timed": len(times),
                }
            )
            if ctrl is not None:
                row["batch_decisions"] = ctrl.history
    base = rows[0].get("img_per_s")
    for r in rows:
        if "img_per_s" in r and base:
            r["x_baseline"] = r["img_per_s"] / base
    result = {
        "settings": {
            "dataset": str(dataset or packed),
            "images": n,
            "data_bytes": data_bytes,
            "cache_bytes": cache_bytes,
            "epochs": epochs,
            "controller_epochs": controller_epochs,
            "batch_size": batch_size,
            "image_size": image_size,
            "model": model,
            "total_epochs": total_epochs,
            "total_images": total_images,
        },
        "machine": machine_info(),
        "rows": rows,
        "table": stages_table(rows, total_images, total_epochs),
    }
    atomic_write(out / "stages.json", lambda f: f.write(json.dumps(result, indent=1, default=str).encode()))
    plot_stages(rows, out / "stages.png", f"model={model}, {image_size}px, batch {batch_size}")
    return result


def stages_table(rows: list[dict[str, Any]], total_images: int, total_epochs: int) -> str:
    kind = next((r["util_kind"] for r in rows if "util_kind" in r), "cpu")
    mem = "GPU mem" if kind == "gpu" else "RAM"
    lines = [
        f"| stage | img/s | epoch s | projected run ({total_epochs} epochs x {total_images:,} images) "
        f"| {'GPU' if kind == 'gpu' else 'CPU'} util % | peak {mem} | cache hit | batch | x row 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['stage']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        util = f"{r['util_mean']:.0f}" if r["util_mean"] is not None else "n/a"
        peak = f"{r['peak_mem_fraction']:.0%}" if r["peak_mem_fraction"] is not None else "n/a"
        hit = f"{r['cache_hit_rate']:.0%}" if r["cache_hit_rate"] is not None else "-"
        ratio = f"{r['x_baseline']:.2f}x" if "x_baseline" in r else "-"
        lines.append(
            f"| {r['stage']} | {r['img_per_s']:.0f} | {r['epoch_s']:.2f} | {fmt_duration(r['projected_s'])} | {util} "
            f"| {peak} | {hit} | {r['batch_size']} | {ratio} |"
        )
    return "\n".join(lines)


def plot_stages(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "img_per_s" in r]
    names = [r["stage"] for r in ok]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    bars = a1.bar(names, [r["projected_s"] / 3600 for r in ok], color="#76b900")
    a1.bar_label(bars, labels=[fmt_duration(r["projected_s"]) for r in ok])
    a1.set_ylabel("projected training time (hours)")
    a1.set_title("time of the whole run")
    util = [r["util_mean"] or 0.0 for r in ok]
    bars = a2.bar(names, util, color="#999999")
    a2.bar_label(bars, fmt="%.0f%%")
    a2.set_ylim(0, 110)
    a2.set_title(f"{'GPU' if ok and ok[0]['util_kind'] == 'gpu' else 'CPU'} utilization")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=25)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
