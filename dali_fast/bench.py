"""`dali-fast bench`: each loader side by side in one run, on the same data and the same work."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .data.base import read_checked
from .data.open import open_dataset
from .data.synthetic import default_dataset
from .loaders.dataloader import shutdown_workers
from .loaders.factory import BACKENDS, make_loader
from .loaders.workers import _as_is, worker_init
from .system import atomic_write, available_cpus
from .train.trainer import Trainer
from .transforms.decode import Decoder
from .transforms.mix import MixupCutmix
from .transforms.recipe import Recipe, resolve_recipe

log = logging.getLogger(__name__)

LIMIT = "limit"  # the row of the machine's decode-only ceiling


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": available_cpus(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import nvidia.dali

        info["dali"] = nvidia.dali.__version__
    except ImportError:
        info["dali"] = None
    return info


def _progress(desc: str, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", leave=False, disable=not enabled)


class _Row:
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
        self.epochs_run = 0

    def epoch(self) -> None:
        epoch, loader = self.epochs_run, self.loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        phase = self.name if epoch > 0 else f"{self.name}-warmup"
        bar = _progress(f"{self.name} epoch {epoch}{' (warm-up)' if epoch == 0 else ''}", self.images, self.progress)
        t0, n = time.perf_counter(), 0
        with self.monitor.phase(phase):
            for batch in loader:
                done = self.consume(batch)
                n += done
                bar.update(done)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        bar.close()
        if epoch > 0:
            self.times.append(time.perf_counter() - t0)
            self.counts.append(n)
        self.epochs_run += 1

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
        return {
            "loader": self.kind,
            "augment": self.augment,
            "img_per_s": sum(self.counts) / sum(self.times),
            "epoch_s": sum(self.times) / len(self.times),
            "epoch_times": self.times,
            "images_per_epoch": self.counts[0],
            "util_kind": util["kind"],
            "util_mean": util["mean"],
            "util_p50": util["p50"],
            "util_p95": util["p95"],
            # The monitor's reading (GPU: this process's memory as NVML sees it, DALI's pool and outputs
            # included; CPU: resident memory), not torch's allocator statistics, which leave DALI out.
            "peak_mem_bytes": util["peak_mem"],
            **extra,
        }


def loader_row(
    kind: str,
    folder: Path | None,
    packed: Path,
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
) -> _Row:
    """A loader's row: loading (+ a training step unless model='none'), ``recipe`` per image, ``mix``
    (MixupCutmix settings) on each batch on the device it arrives on, inside the timed loop."""
    from .loaders.controller import BatchSizeController

    # The baseline reads the image files, as a plain script does; the others read the packed set.
    reader = open_dataset(folder if kind == "baseline" and folder is not None else packed)
    ctrl = BatchSizeController(max(8, batch_size // 4), batch_size * 4) if controller and kind != "baseline" else None
    # Same number of decode processes for the two DataLoader-based rows (DALI uses as many threads).
    workers = available_cpus()
    iterator_only = {"cache_bytes": cache_bytes, "controller": ctrl} if kind != "baseline" else {}
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
    mixer = MixupCutmix(**mix, num_classes=len(reader.classes)) if mix else None
    trainer = Trainer(model, len(reader.classes), mix=mixer) if model != "none" else None
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
    return _Row(
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


def bench_loader(kind: str, folder: Path | None, packed: Path, *, epochs: int, **kw: Any) -> dict[str, Any]:
    """Warm-up epoch, then ``epochs`` timed epochs of one loader (`loader_row`'s arguments), then closed."""
    return _run_alone(loader_row(kind, folder, packed, **kw), epochs)


def _run_alone(row: _Row, epochs: int) -> dict[str, Any]:
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


def limit_row(reader: Any, *, workers: int, batch_size: int, monitor: Any, progress: bool) -> _Row:
    """The machine's ceiling on this data: reading and decoding every record whole (no crop) in
    ``workers`` processes, what a loader would reach if decoding were all it did. Loaders read as a
    share of it."""
    from torch.utils.data import DataLoader

    order = list(range(len(reader)))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    kw: dict[str, Any] = {"persistent_workers": True, "worker_init_fn": worker_init} if workers else {}
    loader = DataLoader(_DecodeOnly(reader), batch_sampler=batches, num_workers=workers, collate_fn=_as_is, **kw)
    extra = {"workers": workers, "cache": None, "batch_decisions": []}
    return _Row(LIMIT, LIMIT, loader, len(reader), int, monitor=monitor, progress=progress, extra=extra)


def decode_limit(reader: Any, *, epochs: int, **kw: Any) -> dict[str, Any]:
    """`limit_row` for a warm-up epoch and ``epochs`` timed ones."""
    return _run_alone(limit_row(reader, **kw), epochs)


def _fmt_mem(b: Any) -> str:
    return f"{b / 2**30:.2f} GiB" if isinstance(b, int | float) else "n/a"


def label(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """A row's name: the loader, with its augmentation when the rows differ in it or it is not 'none'."""
    if row["loader"] == LIMIT:
        return f"limit: decode only, {row['workers']} processes"
    augments = {r.get("augment", "none") for r in rows if r["loader"] != LIMIT}
    aug = row.get("augment", "none")
    return row["loader"] if augments == {"none"} else f"{row['loader']} + {aug}"


def _baseline_for(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> float | None:
    """The baseline's img/s with the same augmentation (else None): each recipe against its own yardstick."""
    return next(
        (
            r["img_per_s"]
            for r in rows
            if r["loader"] == "baseline" and "error" not in r and r.get("augment", "none") == row.get("augment", "none")
        ),
        None,
    )


def markdown_table(rows: Sequence[dict[str, Any]], limit: dict[str, Any] | None = None) -> str:
    """The rows side by side, and with ``limit`` (the decode-only ceiling) its row and each row's share of it."""
    kind = next((r["util_kind"] for r in rows if "util_kind" in r), "cpu")
    head = (
        f"| loader | img/s | epoch s | {'GPU' if kind == 'gpu' else 'CPU'} util % | peak mem | cache hit | x baseline |"
    )
    lines = [
        head + (" of limit |" if limit else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if limit else ""),
    ]
    shown = [*rows, limit] if limit else list(rows)
    for r in shown:
        if "error" in r:
            lines.append(f"| {label(r, rows)} | failed: {r['error']} | | | | | |" + (" |" if limit else ""))
            continue
        util = f"{r['util_mean']:.0f}" if isinstance(r["util_mean"], float) else "n/a"
        cache = f"{r['cache']['hit_rate']:.0%}" if r.get("cache") else "-"
        base = _baseline_for(r, rows)  # the limit row: against the baseline without augmentation
        ratio = f"{r['img_per_s'] / base:.2f}x" if base else "-"
        line = (
            f"| {label(r, rows)} | {r['img_per_s']:.0f} | {r['epoch_s']:.2f} | {util} | {_fmt_mem(r['peak_mem_bytes'])} "
            f"| {cache} | {ratio} |"
        )
        if limit:
            line += f" {r['img_per_s'] / limit['img_per_s']:.0%} |" if "error" not in limit else " - |"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str, limit: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = [label(r, rows) for r in ok]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(ok)), 4))
    kinds = [r["loader"] for r in ok]
    colors = ["#999999" if n == "baseline" else "#76b900" if n == "dali" else "#ee4c2c" for n in kinds]
    bars = a1.bar(names, [r["img_per_s"] for r in ok], color=colors)
    a1.bar_label(bars, fmt="%.0f")
    if limit and "error" not in limit:
        a1.axhline(limit["img_per_s"], color="#555555", linestyle="--", linewidth=1)
        a1.annotate(f"limit: decode only {limit['img_per_s']:.0f}", (0, limit["img_per_s"]), va="bottom", fontsize=8)
    a1.set_ylabel("images / s")
    a1.set_title("throughput")
    kind = ok[0]["util_kind"] if ok else "cpu"
    util = [r["util_mean"] if isinstance(r["util_mean"], float) else 0.0 for r in ok]
    bars = a2.bar(names, util, color=colors)
    a2.bar_label(bars, fmt="%.0f%%")
    a2.set_ylim(0, 110)
    a2.set_ylabel(f"{'GPU' if kind == 'gpu' else 'CPU'} utilization %")
    a2.set_title(f"{'GPU' if kind == 'gpu' else 'CPU (all cores)'} utilization")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def one_line(error: BaseException) -> str:
    """An error as one line; for a DataLoader worker's error, the worker's own last line, not the wrapper's."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    if len(lines) > 1 and "Original Traceback" in str(error):
        return lines[-1]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def run_bench(
    dataset: str | None = None,
    *,
    images: int = 2000,
    loaders: Sequence[str] = BACKENDS,
    epochs: int = 2,
    batch_size: int = 64,
    image_size: int = 224,
    model: str = "none",
    cache_bytes: int = 0,
    controller: bool = False,
    out: str | os.PathLike = "bench-results",
    progress: bool = True,
    on_error: str = "raise",
    recipe: Recipe | None = None,
    augments: Sequence[str | None] | None = None,
    mix: dict[str, float] | None = None,
    limit: bool = True,
    alternate: bool = False,
    emit: Callable[[str], None] = log.info,
) -> dict[str, Any]:
    """Benchmark ``loaders`` side by side; writes results.json and bench.png into ``out``.

    Each of ``augments`` (automatic augmentations, None or 'none' for none; default: the recipe's own)
    is one row per loader, ``recipe`` otherwise, so each recipe's cost shows beside the others. With
    ``limit``, the machine's decode-only ceiling on the same data and processes comes first
    (`limit_row`), and each row reads as a share of it. With ``alternate``, every row is started and
    warmed up, then the rows take turns, one timed epoch each, ``epochs`` times: a machine whose load
    changes during the run then slows every row alike (all loaders stay alive meanwhile, so peak memory
    is that of them all)."""
    from .train.monitor import UtilizationMonitor

    for k in loaders:
        if k not in BACKENDS:
            raise ValueError(f"loader {k!r}: choose from {', '.join(BACKENDS)}")
    if epochs < 1 or batch_size < 1 or image_size < 1:
        raise ValueError("epochs, batch size and image size must be >= 1")
    recipe = resolve_recipe(recipe, image_size=image_size)
    if mix:
        MixupCutmix(**mix)  # settings checked before any work
    variants = [
        recipe.with_(auto_augment=None if a in (None, "none") else a)
        for a in (augments if augments else [recipe.auto_augment])
    ]
    if dataset is None:
        folder, packed = default_dataset(images, progress=progress)
    else:
        reader = open_dataset(dataset)
        folder = Path(dataset) if type(reader).__name__ == "ImageFolderReader" else None
        packed = Path(dataset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs: list[tuple[str, Recipe | None]] = [(LIMIT, None)] if limit else []
    specs += [(k, v) for v in variants for k in loaders]
    results: dict[int, dict[str, Any]] = {}
    live: dict[int, _Row] = {}

    def augment_of(variant: Recipe | None) -> str:
        return "none" if variant is None else variant.auto_augment or "none"

    def failed(k: int, e: BaseException) -> None:
        kind, variant = specs[k]
        why = one_line(e)
        log.error("%s failed: %s", "the limit row" if kind == LIMIT else kind, why)
        results[k] = {"loader": kind, "augment": augment_of(variant), "error": why}
        if kind == LIMIT:
            results[k]["workers"] = available_cpus()
        row = live.pop(k, None)
        if row is not None:
            row.close()

    def make_row(kind: str, variant: Recipe | None, monitor: Any) -> _Row:
        if kind == LIMIT:
            source = open_dataset(folder if folder is not None else packed)
            return limit_row(
                source, workers=available_cpus(), batch_size=batch_size, monitor=monitor, progress=progress
            )
        return loader_row(
            kind,
            folder,
            packed,
            batch_size=batch_size,
            image_size=image_size,
            model=model,
            cache_bytes=cache_bytes,
            controller=controller,
            monitor=monitor,
            progress=progress,
            on_error=on_error,
            recipe=variant,
            mix=mix,
            name=kind if len(variants) == 1 else f"{kind} + {augment_of(variant)}",
        )

    errors = (ImportError, RuntimeError, ValueError, OSError)
    with UtilizationMonitor() as mon:
        try:
            for k, (kind, variant) in enumerate(specs):
                what = "the decode-only limit" if kind == LIMIT else kind
                what += "" if kind == LIMIT or len(variants) == 1 else f" + {augment_of(variant)}"
                emit(f"{'starting' if alternate else 'benchmarking'} {what} ...")
                try:
                    live[k] = make_row(kind, variant, mon)
                    if alternate:
                        live[k].epoch()  # its warm-up
                    else:
                        results[k] = _run_alone(live.pop(k), epochs)
                except errors as e:
                    failed(k, e)
            if alternate:
                emit(f"timing {len(live)} rows in turn, one epoch each, {epochs} times ...")
                for _ in range(epochs):
                    for k in list(live):
                        try:
                            live[k].epoch()
                        except errors as e:
                            failed(k, e)
                results.update({k: row.result() for k, row in live.items()})
        finally:
            for row in live.values():
                row.close()
    ordered = [results[k] for k in sorted(results)]
    ceiling = next((r for r in ordered if r["loader"] == LIMIT), None)
    rows = [r for r in ordered if r["loader"] != LIMIT]
    for r in rows:
        base = _baseline_for(r, rows)
        if base and "error" not in r:
            r["x_baseline"] = r["img_per_s"] / base
        if ceiling and "error" not in ceiling and "error" not in r:
            r["of_limit"] = r["img_per_s"] / ceiling["img_per_s"]
    info = machine_info()
    result = {
        "settings": {
            "dataset": str(dataset or packed),
            "images": len(open_dataset(packed)),
            "loaders": list(loaders),
            "epochs": epochs,
            "batch_size": batch_size,
            "image_size": image_size,
            "model": model,
            "cache_bytes": cache_bytes,
            "controller": controller,
            "recipes": [v.describe() for v in variants],
            "mix": mix,
            "alternate": alternate,
        },
        "machine": info,
        "rows": rows,
        "limit": ceiling,
        "table": markdown_table(rows, ceiling),
    }
    atomic_write(out / "results.json", lambda f: f.write(json.dumps(result, indent=1, default=str).encode()))
    where = info["gpu"] or f"{info['cpu_count']} CPU cores, no GPU"
    plot(rows, out / "bench.png", f"model={model}, {image_size}px, batch {batch_size} — {where}", ceiling)
    return result
