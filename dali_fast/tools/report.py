"""What ``bench`` and ``stages`` write and print: markdown tables, bar charts side by side, the
figures formatted one way, and the machine a result was measured on."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..machine import available_cpus
from ..text import plural


def machine_info() -> dict[str, Any]:
    """Python, the platform, the CPUs this process may use, torch and its CUDA, the GPU and DALI's version."""
    import torch

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


def where(machine: dict[str, Any]) -> str:
    """What the result ran on, in words: the GPU, else the CPU cores and DALI's CPU-only mode."""
    return machine["gpu"] or f"{machine['cpu_count']} CPU cores, no GPU (DALI CPU-only mode)"


def bench_summary(result: dict[str, Any], out: Path) -> str:
    """What ``dali-fast bench`` prints: the settings and the machine, the table, the controller's
    decisions, and where the results went."""
    s = result["settings"]
    lines = [
        f"\n{plural(s['images'], 'image')}, {plural(s['epochs'], 'timed epoch')} after a warm-up, batch "
        f"{s['batch_size']}, {s['image_size']}px, model={s['model']} on {where(result['machine'])}"
        + (
            f", {s['ranks']} ranks (batch per rank; each step as long as the slowest rank's)"
            if s.get("ranks", 1) > 1
            else ""
        )
        + "\n",
        result["table"],
        "",
    ]
    for row in result["rows"]:  # what img/s leaves out: the warm-up epoch, the pipeline builds, the cache filling
        if row.get("warmup_s") is None:
            continue
        apart = [f"warm-up epoch {row['warmup_s']:.2f} s"]
        if row.get("build_s"):
            apart.append(f"pipeline builds {row['build_s']:.2f} s")
        if row.get("cache_warmup"):
            apart.append(f"cache hit {row['cache_warmup']['hit_rate']:.0%} while filling")
        lines.append(
            f"  {row['loader']}{'' if row.get('augment', 'none') == 'none' else ' + ' + row['augment']}: "
            f"{', '.join(apart)} (not in img/s)"
        )
    for row in result["rows"]:
        for d in row.get("batch_decisions", []):
            lines.append(
                f"  {row['loader']} epoch {d['epoch']}: {d['reason']} → batch {d['batch_size']} → {d['next_batch_size']}"
            )
    lines.append(f"\nwrote {out / 'results.json'} and {out / 'bench.png'}")
    return "\n".join(lines)


def stages_summary(result: dict[str, Any], out: Path) -> str:
    """What ``dali-fast stages`` prints: the data, the cache and the settings, the table, and where
    the results went."""
    s = result["settings"]
    head = (
        f"\n{plural(s['images'], 'image')} ({s['data_bytes'] / 2**20:.0f} MiB), cache {s['cache_bytes'] / 2**20:.0f} MiB, "
        f"{plural(s['epochs'], 'timed epoch')} after a warm-up ({s['controller_epochs']} for the controller), batch "
        f"{s['batch_size']}, {s['image_size']}px, model={s['model']} on {where(result['machine'])}\n"
    )
    notes = [
        f"\n{r['stage']}: {s.get('progressive')} (START:END:FROM_EPOCH:TO_EPOCH); img/s at each size: "
        + ", ".join(f"{size} px {v:.0f}" for size, v in r["img_per_s_by_size"].items())
        + f"; its img/s is the whole run's average over {s['total_epochs']} epochs"
        for r in result.get("rows", [])
        if r.get("img_per_s_by_size")
    ]
    return "\n".join([head, result["table"], *notes, f"\nwrote {out / 'stages.json'} and {out / 'stages.png'}"])


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A markdown table: the first ``left`` columns aligned left, the others (figures) right; an empty cell
    stays narrow (``| |``)."""

    def line(cells: Sequence[str]) -> str:
        return "|" + "".join(f" {c} |" if c else " |" for c in cells)

    align = "|" + "".join("---|" if k < left else "---:|" for k in range(len(header)))
    return "\n".join([line(header), align, *(line(r) for r in rows)])


def percent(value: Any) -> str:
    """A utilization (0-100) as a whole number, or "n/a" when none was read."""
    return f"{value:.0f}" if isinstance(value, float) else "n/a"


def gib(value: Any) -> str:
    """Bytes in GiB, or "n/a"."""
    return f"{value / 2**30:.2f} GiB" if isinstance(value, int | float) else "n/a"


def mib(value: Any) -> str:
    """Bytes in MiB, or "n/a"."""
    return f"{value / 2**20:.0f} MiB" if isinstance(value, int | float) else "n/a"


def ms(seconds: Any) -> str:
    """Seconds as milliseconds, one decimal ("12.3"), or "n/a"."""
    return f"{seconds * 1000:.1f}" if isinstance(seconds, int | float) else "n/a"


def times(value: Any) -> str:
    """A ratio of two times ("1.85"), or "n/a"."""
    return f"{value:.2f}" if isinstance(value, int | float) else "n/a"


def ratio(value: float | None) -> str:
    """A ratio to the baseline ("1.23x"), or "-" without one."""
    return f"{value:.2f}x" if value else "-"


def share(value: float | None) -> str:
    """A fraction as a whole percentage ("85%"), or "-"."""
    return f"{value:.0%}" if value is not None else "-"


@dataclass
class Panel:
    """One bar chart of a figure: a value per bar, its colours, the labels on the bars (``labels``, else
    ``fmt`` of the values), the axis, and optionally a dashed line at ``line`` with its caption."""

    values: Sequence[float]
    title: str
    ylabel: str = ""
    colors: Sequence[str] | str = "#76b900"
    labels: Sequence[str] | None = None
    fmt: str = "%.0f"
    ylim: tuple[float, float] | None = None
    line: tuple[float, str] | None = None
    second: tuple[Sequence[float], str, str] | None = None  # a second bar per name: (values, its name, the first's)


def tails_panel(rows: Sequence[dict[str, Any]], colors: Sequence[str] | str) -> Panel:
    """The steady-state batch time of each row: p50 (solid) beside p99 (hatched), in milliseconds."""
    p50 = [(r.get("batch_p50_s") or 0.0) * 1000 for r in rows]
    p99 = [(r.get("batch_p99_s") or 0.0) * 1000 for r in rows]
    return Panel(p50, "batch time (steady state)", "ms per batch", colors, fmt="%.0f", second=(p99, "p99", "p50"))


def utilization_panel(rows: Sequence[dict[str, Any]], colors: Sequence[str] | str) -> Panel:
    """The mean utilization of each row (GPU, or this process tree's CPU over all cores)."""
    kind = rows[0]["util_kind"] if rows else "cpu"
    util = [r["util_mean"] if isinstance(r["util_mean"], float) else 0.0 for r in rows]
    title = f"{'GPU' if kind == 'gpu' else 'CPU (all cores)'} utilization"
    return Panel(util, title, f"{'GPU' if kind == 'gpu' else 'CPU'} utilization %", colors, fmt="%.0f%%", ylim=(0, 110))


def bar_charts(
    path: Path, names: Sequence[str], panels: Sequence[Panel], title: str, *, width: float, rotate: int = 0
) -> None:
    """``panels`` side by side over the same bars (``names``), written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt, names, panels, title, width=width, rotate=rotate)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(plt: Any, names: Sequence[str], panels: Sequence[Panel], title: str, *, width: float, rotate: int = 0) -> Any:
    """The figure of `bar_charts`. A dashed line's caption goes under the panel's title, where no bar or
    value label can be (on the axes it covered the value of a bar as tall as the line), and the axis
    leaves room above the tallest bar or line for the values."""
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.4))
    for ax, panel in zip(axes, panels, strict=True):
        x = range(len(names))
        step = 0.4 if panel.second is not None else 0.8
        shift = -step / 2 if panel.second is not None else 0.0
        bars = ax.bar([i + shift for i in x], panel.values, width=step, color=panel.colors)
        if panel.labels is not None:
            ax.bar_label(bars, labels=list(panel.labels), fontsize=8)
        else:
            ax.bar_label(bars, fmt=panel.fmt, fontsize=8)
        top = max([0.0, *panel.values])
        if panel.second is not None:
            values = panel.second[0]
            more = ax.bar([i + step / 2 for i in x], values, width=step, color=panel.colors, hatch="//", alpha=0.55)
            ax.bar_label(more, fmt=panel.fmt, fontsize=8)
            top = max([top, *values])
        ax.set_xticks(list(x), list(names))
        caption = panel.title
        if panel.second is not None:  # said in the title, not in a legend that could cover a bar
            caption += f"\n(solid: {panel.second[2]}, hatched: {panel.second[1]})"
        if panel.line is not None:
            ax.axhline(panel.line[0], color="#555555", linestyle="--", linewidth=1)
            caption += f"\n(dashed: {panel.line[1]})"
            top = max(top, panel.line[0])
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        elif top > 0:
            ax.set_ylim(0, top * (1.3 if panel.second is not None else 1.15))
        if panel.ylabel:
            ax.set_ylabel(panel.ylabel)
        ax.set_title(caption, fontsize=10)
        if rotate:
            ax.tick_params(axis="x", labelrotation=rotate)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def fmt_duration(seconds: float) -> str:
    """Hours under two days, days from there (the article's unit for a whole run)."""
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def stages_table(rows: list[dict[str, Any]], total_images: int, total_epochs: int) -> str:
    kind = next((r["util_kind"] for r in rows if "util_kind" in r), "cpu")
    mem = "GPU mem" if kind == "gpu" else "RAM"
    header = ["stage", "img/s", "epoch s", f"projected run ({total_epochs} epochs x {total_images:,} images)"]
    header += [f"{'GPU' if kind == 'gpu' else 'CPU'} util %", f"peak {mem}", "cache hit", "batch", "x row 1"]
    cells = []
    for r in rows:
        if "skipped" in r:
            cells.append([r["stage"], f"skipped: {r['skipped']}", *[""] * (len(header) - 2)])
            continue
        peak = share(r["peak_mem_fraction"]) if r["peak_mem_fraction"] is not None else "n/a"
        cells.append(
            [
                r["stage"],
                f"{r['img_per_s']:.0f}",
                f"{r['epoch_s']:.2f}",
                fmt_duration(r["projected_s"]),
                percent(r["util_mean"]),
                peak,
                share(r["cache_hit_rate"]),
                str(r["batch_size"]),
                ratio(r.get("x_baseline")),
            ]
        )
    return table(header, cells)


def plot_stages(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """The projected time of the whole run, and the utilization, of each stage that ran."""
    ok = [r for r in rows if "img_per_s" in r]
    hours = Panel(
        [r["projected_s"] / 3600 for r in ok],
        "time of the whole run",
        "projected training time (hours)",
        labels=[fmt_duration(r["projected_s"]) for r in ok],
    )
    panels = [hours, utilization_panel(ok, "#999999")]
    bar_charts(path, [r["stage"] for r in ok], panels, title, width=11, rotate=25)
