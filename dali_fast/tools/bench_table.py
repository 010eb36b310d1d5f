"""What ``bench`` shows of its rows: the markdown table (img/s, the batch time's tails, the process tree's
memory, the ratios) and the chart (a panel each for throughput, tails, memory and utilization)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..text import plural
from . import report
from .bench_rows import LIMIT


def label(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """A row's name: the loader, with its augmentation when the rows differ in it or it is not 'none'."""
    if row["loader"] == LIMIT:
        ranks = row.get("ranks", 1)
        return f"limit: decode only, {plural(row['workers'], 'process', 'processes')}" + (
            f" x {ranks} ranks" if ranks > 1 else ""
        )
    augments = {r.get("augment", "none") for r in rows if r["loader"] != LIMIT}
    aug = row.get("augment", "none")
    return row["loader"] if augments == {"none"} else f"{row['loader']} + {aug}"


def baseline_for(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> float | None:
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
    """The rows side by side, and with ``limit`` (the decode-only ceiling) its row and each row's share of it.

    Besides img/s: the steady-state batch time's median and 99th percentile and their ratio (the tail a
    DDP step waits for), and the peak PSS of the loader's whole process tree (main process and workers;
    per rank under ``--ranks``), with the GPU's memory beside it on a GPU."""
    kind = next((r["util_kind"] for r in rows if "util_kind" in r), "cpu")
    per_rank = any(r.get("ranks", 1) > 1 for r in rows)
    header = ["loader", "img/s", "epoch s", "batch p50 ms", "batch p99 ms", "p99/p50"]
    header += [
        f"{'GPU' if kind == 'gpu' else 'CPU'} util %",
        f"peak PSS, main + workers{' (per rank)' if per_rank else ''}",
    ]
    header += ["GPU mem"] if kind == "gpu" else []
    header += ["cache hit", "x baseline", *(["of limit"] if limit else [])]
    ramp = any(len(r.get("img_per_s_by_size") or {}) > 1 for r in rows)
    header += ["img/s by size (px)"] if ramp else []
    cells = []
    for r in [*rows, limit] if limit else rows:
        if "error" in r:
            cells.append([label(r, rows), f"failed: {r['error']}", *[""] * (len(header) - 2)])
            continue
        cache = f"{r['cache']['hit_rate']:.0%}" if r.get("cache") else "-"
        base = baseline_for(r, rows)  # the limit row: against the baseline without augmentation
        row = [label(r, rows), f"{r['img_per_s']:.0f}", f"{r['epoch_s']:.2f}"]
        row += [report.ms(r.get("batch_p50_s")), report.ms(r.get("batch_p99_s")), report.times(r.get("p99_over_p50"))]
        row += [report.percent(r["util_mean"]), report.mib(r.get("pss_peak_bytes"))]
        row += [report.gib(r.get("gpu_mem_peak_bytes"))] if kind == "gpu" else []
        row += [cache, report.ratio(r["img_per_s"] / base if base else None)]
        if limit:
            row.append(report.share(r["img_per_s"] / limit["img_per_s"]) if "error" not in limit else "-")
        if ramp:
            sizes = r.get("img_per_s_by_size") or {}
            row.append(", ".join(f"{s}: {v:.0f}" for s, v in sizes.items()) or "-")
        cells.append(row)
    return report.table(header, cells)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str, limit: dict[str, Any] | None = None) -> None:
    """Throughput (with the decode-only limit as a line), the batch time's p50 and p99, the process
    tree's peak PSS and the utilization of each row that ran, a panel each."""
    ok = [r for r in rows if "error" not in r]
    colors = ["#999999" if r["loader"] == "baseline" else "#76b900" if r["loader"] == "dali" else "#ee4c2c" for r in ok]
    line = None
    if limit and "error" not in limit:
        line = (limit["img_per_s"], f"limit: decode only {limit['img_per_s']:.0f}")
    throughput = report.Panel([r["img_per_s"] for r in ok], "throughput", "images / s", colors, line=line)
    tails = report.tails_panel(ok, colors)
    memory = report.Panel(
        [(r.get("pss_peak_bytes") or 0) / 2**20 for r in ok], "peak PSS, main + workers", "MiB", colors
    )
    names = [label(r, rows) for r in ok]
    panels = [throughput, tails, memory, report.utilization_panel(ok, colors)]
    report.bar_charts(path, names, panels, title, width=max(16, 3.2 * len(ok)), rotate=20 if len(ok) > 3 else 0)
