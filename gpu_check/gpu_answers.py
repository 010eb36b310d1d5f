"""The answers summary.md ends with, read from the figures the steps wrote (``<step>.json`` in the work
folder): DALIIterator over the best plain-DALI row, each model over its resident ceiling, the JPEG engine's
use, the ``hw_decoder_load`` that wins on p99 batch time, corruption found or not, and the crop-window
probe's verdict on this GPU. A figure a step did not leave is answered "n/a (...)"."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROW = re.compile(r"^ceiling\.(dali|plain_dali_whole|plain_dali_roi)_(\d+)_threads(?:_load_([\d.]+))?\.img_per_s$")


def load_figures(work: Path) -> dict[str, Any]:
    """Every step's figures, merged (a step that did not run, or died before writing, adds none)."""
    figures: dict[str, Any] = {}
    for step in ("decode", "odd", "ceiling", "models"):
        path = work / f"{step}.json"
        if path.is_file():
            figures.update(json.loads(path.read_text()))
    return figures


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def rows(f: dict[str, Any]) -> list[dict[str, Any]]:
    """The ceiling step's rows with a rate: kind ("dali", "plain_dali_whole", "plain_dali_roi"), threads,
    load (None: the loader's default), img/s and batch p99."""
    out = []
    for key, value in f.items():
        m, rate = ROW.match(key), _num(value)
        if m and rate is not None:
            prefix = key.removesuffix(".img_per_s")
            load = float(m.group(3)) if m.group(3) else None
            out.append(
                {
                    "kind": m.group(1),
                    "threads": int(m.group(2)),
                    "load": load,
                    "rate": rate,
                    "key": prefix,
                    "p99": _num(f.get(f"{prefix}.batch_ms_p99")),
                }  # fmt: skip
            )
    return out


KINDS = {"dali": "DALIIterator", "plain_dali_whole": "whole-image", "plain_dali_roi": "crop-window"}
DEFAULT_LOAD = "0.99 (the loader's default)"


def _name(row: dict[str, Any]) -> str:
    load = row["load"] if row["load"] is not None else DEFAULT_LOAD
    return f"{KINDS[row['kind']]} at {row['threads']} threads, hw_decoder_load {load}"


def answers(f: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    found = rows(f)
    top = max((r["threads"] for r in found), default=None)
    dali = [r for r in found if r["kind"] == "dali" and r["threads"] == top]
    plain = [r for r in found if r["kind"] != "dali" and r["threads"] == top]
    if dali and plain:
        mine, best = max(dali, key=lambda r: r["rate"]), max(plain, key=lambda r: r["rate"])
        out["dali_vs_best_plain_dali"] = (
            f"{mine['rate'] / best['rate']:.2f} (DALIIterator {mine['rate']:,.0f} img/s, {_name(mine)}; best plain "
            f"DALI {best['rate']:,.0f} img/s, {_name(best)}; goal 0.9 or more)"
        )
    else:
        out["dali_vs_best_plain_dali"] = "n/a (the ceiling step left no DALIIterator and plain-DALI rows)"
    for model in ("resnet18", "resnet50"):
        ratio = _num(f.get(f"models.{model}.dali_vs_ceiling"))
        rate, ceiling = f.get(f"models.{model}.dali_img_per_s"), f.get(f"models.{model}.ceiling_img_per_s")
        out[f"{model}_vs_resident_ceiling"] = (
            f"{ratio:.2f} ({rate} img/s fed by DALIIterator; {ceiling} img/s from a batch resident on the GPU)"
            if ratio is not None
            else f"n/a (the models step left no {model} figures)"
        )
    busy = f.get("ceiling.jpeg_engine_busy", "n/a (no ceiling step figures)")
    use = [f"{r['key'].removeprefix('ceiling.')}: {f.get(r['key'] + '.jpeg_util_mean')}" for r in dali]
    share = f.get("ceiling.engine_eligible_share", "n/a")
    out["engine_use"] = f"busy: {busy}; JPEG engine mean % per DALIIterator row: {', '.join(use) or 'n/a'}"
    out["engine_use"] += f"; share of the data the engine takes: {share}"
    loaded = [r for r in dali if r["p99"] is not None]
    if len(loaded) >= 2:
        win = min(loaded, key=lambda r: r["p99"])
        rest = ", ".join(f"{r['load'] or DEFAULT_LOAD}: {r['p99']:.1f} ms" for r in loaded)
        out["load_winning_on_p99"] = (
            f"{win['load'] or DEFAULT_LOAD} (DALIIterator batch p99 by hw_decoder_load: {rest})"
        )
    else:
        out["load_winning_on_p99"] = "n/a (fewer than two DALIIterator rows at different loads)"
    corrupt = f.get("decode.corrupt_images")
    worst = f.get("decode.loader_eval_gpu_vs_cpu.worst_image", "n/a")
    images = f.get("decode.loader_eval_gpu_vs_cpu.images", "n/a")
    if corrupt is None:
        out["corruption"] = "n/a (the decode step left no GPU-vs-CPU comparison)"
    elif isinstance(corrupt, str):
        out["corruption"] = corrupt
    else:
        verdict = "FOUND" if corrupt else "none found"
        out["corruption"] = f"{verdict}: {corrupt} of {images} images off the CPU's; worst: {worst}"
    probe = f.get("doctor.decoder_probe.crop_window", "n/a (no doctor figures)")
    roi = [
        f"{k.removeprefix('ceiling.').removesuffix('.img_per_s')}: {v}{' img/s' if _num(v) else ''}"
        for k, v in f.items()
        if k.startswith("ceiling.plain_dali_roi") and k.endswith(".img_per_s")
    ]
    out["crop_window_probe"] = f"{probe} (doctor's child); plain-DALI crop-window rows: {', '.join(roi) or 'n/a'}"
    return out
