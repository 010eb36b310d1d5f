"""`dali-fast bench`: each loader side by side in one run, on the same data and the same work (the rows are
`bench_rows`), written as results.json, a table and bench.png."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.base import Reader
from ..data.open import open_dataset
from ..data.synthetic import default_dataset
from ..data.targets import target_spec
from ..files import atomic_write, check_writable_folder
from ..loaders.factory import BACKENDS
from ..machine import available_cpus
from ..text import plural
from ..transforms.mix import MixupCutmix
from ..transforms.recipe import Recipe, resolve_recipe
from . import report
from .bench_rows import LIMIT, Row, limit_row, loader_row, run_alone
from .ffcv_row import FFCV, ffcv_missing, ffcv_spec

BENCH_ROWS = (*BACKENDS, FFCV)  # what --loaders names: the backends, and FFCV's Loader where it is installed

log = logging.getLogger(__name__)


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
    header = ["loader", "img/s", "epoch s", f"{'GPU' if kind == 'gpu' else 'CPU'} util %", "peak mem", "cache hit"]
    header += ["x baseline", *(["of limit"] if limit else [])]
    ramp = any(len(r.get("img_per_s_by_size") or {}) > 1 for r in rows)
    header += ["img/s by size (px)"] if ramp else []
    cells = []
    for r in [*rows, limit] if limit else rows:
        if "error" in r:
            cells.append([label(r, rows), f"failed: {r['error']}", *[""] * (len(header) - 2)])
            continue
        cache = f"{r['cache']['hit_rate']:.0%}" if r.get("cache") else "-"
        base = _baseline_for(r, rows)  # the limit row: against the baseline without augmentation
        row = [label(r, rows), f"{r['img_per_s']:.0f}", f"{r['epoch_s']:.2f}", report.percent(r["util_mean"])]
        row += [report.gib(r["peak_mem_bytes"]), cache, report.ratio(r["img_per_s"] / base if base else None)]
        if limit:
            row.append(report.share(r["img_per_s"] / limit["img_per_s"]) if "error" not in limit else "-")
        if ramp:
            sizes = r.get("img_per_s_by_size") or {}
            row.append(", ".join(f"{s}: {v:.0f}" for s, v in sizes.items()) or "-")
        cells.append(row)
    return report.table(header, cells)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str, limit: dict[str, Any] | None = None) -> None:
    """Throughput (with the decode-only limit as a line) and utilization of each row that ran."""
    ok = [r for r in rows if "error" not in r]
    colors = ["#999999" if r["loader"] == "baseline" else "#76b900" if r["loader"] == "dali" else "#ee4c2c" for r in ok]
    line = None
    if limit and "error" not in limit:
        line = (limit["img_per_s"], f"limit: decode only {limit['img_per_s']:.0f}")
    throughput = report.Panel([r["img_per_s"] for r in ok], "throughput", "images / s", colors, line=line)
    names = [label(r, rows) for r in ok]
    report.bar_charts(
        path, names, [throughput, report.utilization_panel(ok, colors)], title, width=max(10, 1.6 * len(ok))
    )


def one_line(error: BaseException) -> str:
    """An error as one line; for a DataLoader worker's error, the worker's own last line, not the wrapper's."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    if len(lines) > 1 and "Original Traceback" in str(error):
        return lines[-1]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def run_bench(
    dataset: str | os.PathLike | Reader | None = None,
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
    open_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Benchmark ``loaders`` side by side; writes results.json and bench.png into ``out``.

    ``dataset`` is anything `open_dataset` opens (a path or a URL; ``open_options`` go to it), or a
    reader; None means the synthetic set of ``images``. It is opened once and every row reads that reader, except the baseline, which reads
    the image files of an ImageFolder as a plain script does (the synthetic set's folder, beside its pack).
    Each of ``augments`` (automatic augmentations, None or 'none' for none; default: the recipe's own)
    is one row per loader, ``recipe`` otherwise, so each recipe's cost shows beside the others. With
    ``limit``, the machine's decode-only ceiling on the same data and processes comes first
    (`limit_row`), and each row reads as a share of it. With ``alternate``, every row is started and
    warmed up, then the rows take turns, one timed epoch each, ``epochs`` times: a machine whose load
    changes during the run then slows every row alike (all loaders stay alive meanwhile, so peak memory
    is that of them all)."""
    variants = _variants(loaders, epochs, batch_size, image_size, recipe, augments, mix)
    out = Path(out)
    check_writable_folder(out, "--out")
    data = bench_data(dataset, images, progress, open_options)
    check_batch_fits(batch_size, len(data.reader), data.name)
    target = target_spec(data.reader)[0]
    if FFCV in loaders and target != "class":  # the .beton holds class labels: said before any row runs
        raise ValueError(f"the ffcv row reads class labels, not {target} targets; leave ffcv out of --loaders")
    out.mkdir(parents=True, exist_ok=True)
    specs: list[tuple[str, Recipe | None]] = [(LIMIT, None)] if limit else []
    specs += [(k, v) for v in variants for k in loaders]
    row_kw = {
        "batch_size": batch_size,
        "image_size": image_size,
        "model": model,
        "cache_bytes": cache_bytes,
        "controller": controller,
        "progress": progress,
        "on_error": on_error,
        "mix": mix,
    }

    def make_row(kind: str, variant: Recipe | None, monitor: Any) -> Row:
        if kind == LIMIT:
            return limit_row(
                data.files, workers=available_cpus(), batch_size=batch_size, monitor=monitor, progress=progress
            )
        name = kind if len(variants) == 1 else f"{kind} + {_augment_of(variant)}"
        reader = data.files if kind == "baseline" else data.reader
        return loader_row(kind, reader, recipe=variant, monitor=monitor, name=name, **row_kw)

    results = _run_rows(specs, make_row, epochs=epochs, alternate=alternate, several=len(variants) > 1, emit=emit)
    settings = {
        "dataset": data.name,
        "images": len(data.reader),
        "loaders": list(loaders),
        "epochs": epochs,
        **{k: v for k, v in row_kw.items() if k not in ("progress", "on_error", "mix")},
        "recipes": [v.describe() for v in variants],
        "mix": mix,
        "alternate": alternate,
    }
    return _write(results, settings, out)


def check_batch_fits(batch_size: int, images: int, where: str | os.PathLike) -> None:
    """A batch larger than the data set is one line: every epoch would be a single short batch."""
    if batch_size > images:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the {plural(images, 'image')} of {where}; "
            f"use --batch-size {images} or less, or more images"
        )


def _variants(
    loaders: Sequence[str],
    epochs: int,
    batch_size: int,
    image_size: int,
    recipe: Recipe | None,
    augments: Sequence[str | None] | None,
    mix: dict[str, float] | None,
) -> list[Recipe]:
    """The recipes the rows run (one per augmentation asked for), after a one-line error for any bad
    setting, before any work."""
    for k in loaders:
        if k not in BENCH_ROWS:
            raise ValueError(f"loader {k!r}: choose from {', '.join(BENCH_ROWS)}")
    if epochs < 1 or batch_size < 1 or image_size < 1:
        raise ValueError("epochs, batch size and image size must be >= 1")
    recipe = resolve_recipe(recipe, image_size=image_size)
    if mix:
        MixupCutmix(**mix)  # settings checked before any work
    variants = [
        recipe.with_(auto_augment=None if a in (None, "none") else a)
        for a in (augments if augments else [recipe.auto_augment])
    ]
    if FFCV in loaders:  # where FFCV is missing, or cannot do a setting, one line before any work
        missing = ffcv_missing()
        if missing is not None:
            raise ValueError(missing)
        for variant in variants:
            ffcv_spec(variant)
    return variants


def _write(results: dict[int, dict[str, Any]], settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """The result (rows compared, the limit, the table, the machine) written to results.json and bench.png."""
    rows, ceiling = _compared(results)
    info = report.machine_info()
    table = markdown_table(rows, ceiling)
    result = {"settings": settings, "machine": info, "rows": rows, "limit": ceiling, "table": table}
    atomic_write(out / "results.json", lambda f: f.write(json.dumps(result, indent=1, default=str).encode()))
    where = info["gpu"] or f"{info['cpu_count']} CPU cores, no GPU"
    title = f"model={settings['model']}, {settings['image_size']}px, batch {settings['batch_size']} — {where}"
    plot(rows, out / "bench.png", title, ceiling)
    return result


@dataclass(frozen=True)
class BenchData:
    """The data every row reads, opened once: ``reader`` (the loaders'), ``files`` (what the baseline and
    the limit row read: an ImageFolder's image files where there is one, else ``reader``) and ``name``."""

    reader: Reader
    files: Reader
    name: str


def bench_data(
    dataset: str | os.PathLike | Reader | None, images: int, progress: bool, open_options: dict | None = None
) -> BenchData:
    """``dataset`` opened once (`open_dataset` takes paths and URLs alike, and ``open_options``), or the
    synthetic set of ``images``: its pack for the loaders, its ImageFolder for the baseline."""
    if dataset is None:
        folder, packed = default_dataset(images, progress=progress)
        return BenchData(open_dataset(packed), open_dataset(folder), str(packed))
    reader = dataset if isinstance(dataset, Reader) else open_dataset(dataset, **(open_options or {}))
    name = os.fspath(dataset) if isinstance(dataset, str | os.PathLike) else repr(reader)
    return BenchData(reader, reader, name)


def _augment_of(variant: Recipe | None) -> str:
    return "none" if variant is None else variant.auto_augment or "none"


def _run_rows(
    specs: list[tuple[str, Recipe | None]],
    make_row: Callable[[str, Recipe | None, Any], Row],
    *,
    epochs: int,
    alternate: bool,
    several: bool,
    emit: Callable[[str], None],
) -> dict[int, dict[str, Any]]:
    """Each spec's result (or its error, in one line), by position: one row at a time, or all started
    and then timed in turn (``alternate``). A row that fails is named and closed; the others go on."""
    from ..train.monitor import UtilizationMonitor

    results: dict[int, dict[str, Any]] = {}
    live: dict[int, Row] = {}

    def failed(k: int, e: BaseException) -> None:
        kind, variant = specs[k]
        why = one_line(e)
        log.error("%s failed: %s", "the limit row" if kind == LIMIT else kind, why)
        results[k] = {"loader": kind, "augment": _augment_of(variant), "error": why}
        if kind == LIMIT:
            results[k]["workers"] = available_cpus()
        row = live.pop(k, None)
        if row is not None:
            row.close()

    errors = (ImportError, RuntimeError, ValueError, OSError)
    with UtilizationMonitor() as mon:
        try:
            for k, (kind, variant) in enumerate(specs):
                what = "the decode-only limit" if kind == LIMIT else kind
                what += "" if kind == LIMIT or not several else f" + {_augment_of(variant)}"
                emit(f"{'starting' if alternate else 'benchmarking'} {what} ...")
                try:
                    live[k] = make_row(kind, variant, mon)
                    if alternate:
                        live[k].epoch()  # its warm-up
                    else:
                        results[k] = run_alone(live.pop(k), epochs)
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
    return results


def _compared(results: dict[int, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(the loader rows in order, each with its ratio to its baseline and its share of the limit; the limit row)."""
    ordered = [results[k] for k in sorted(results)]
    ceiling = next((r for r in ordered if r["loader"] == LIMIT), None)
    rows = [r for r in ordered if r["loader"] != LIMIT]
    for r in rows:
        base = _baseline_for(r, rows)
        if base and "error" not in r:
            r["x_baseline"] = r["img_per_s"] / base
        if ceiling and "error" not in ceiling and "error" not in r:
            r["of_limit"] = r["img_per_s"] / ceiling["img_per_s"]
    return rows, ceiling
