"""The lines ``dali-fast train`` prints: the first (what is trained, on which sets, where, with which
augmentation) and one per epoch."""

from __future__ import annotations

import math
from typing import Any

from ..data.targets import target_spec
from ..text import plural
from .sets import describe


def intro_line(run: Any) -> str:
    """The first line: what is trained, on which sets (their images, and paths), where, with which augmentation
    (``run``: `run._Run`)."""
    config, ctx = run.config, run.ctx
    extras = [f"{k}={v}" for k, v in config.mix.items() if v]
    if run.recipe.auto_augment:
        extras.insert(0, f"augment={run.recipe.auto_augment}")
    if run.recipe.random_erasing:
        extras.append(f"random_erasing={run.recipe.random_erasing}")
    if run.recipe.resolution is not None:
        extras.append(f"progressive={run.recipe.resolution} (eval at {run.recipe.image_size} px)")
    kind, width = target_spec(run.train_set)
    targets = {"multihot": f", multi-hot targets of {width} classes", "float": f", float targets of {width} numbers"}
    return (
        f"training {config.model} on {describe(run.sets)}{targets.get(kind, '')}, "
        f"loader={config.loader}, device={run.trainer.device}"
        + (f", {ctx.world_size} ranks ({ctx.backend})" if ctx.distributed else "")
        + (f", {', '.join(extras)}" if extras else "")
    )


def epoch_line(row: dict[str, Any]) -> str:
    """One epoch's line: its losses and metric, speed, utilization, batch and image size, ranks, resume and
    the controller's decision."""
    util_s = f"{row['util_mean']:.0f}%" if isinstance(row["util_mean"], float) else "n/a"
    metric = f" acc {row['val_acc']:.1%}" if "val_acc" in row else ""
    metric += f" mAP {row['val_map']:.3f}" if "val_map" in row else ""
    line = (
        f"epoch {row['epoch']}: loss {row['train_loss']:.3f}, held-out loss {row['val_loss']:.3f}"
        f"{metric}, {row['img_per_s']:.0f} img/s, {row['util_kind']} util {util_s}, "
        f"batch {row['batch_size']}, {row['image_size']} px"
    )
    if row["ranks"] > 1:
        line += f" x {row['ranks']} ranks"
    skipped = row.get("skipped") or {}
    if any(skipped.values()):
        line += f", skipped {plural(skipped['train'], 'bad record')} in training, {skipped['held_out']} held out"
    if row["resumed"]:
        line += " (resumed mid-epoch)"
    if row["decision"] is not None:
        d = row["decision"]
        line += f" | controller: {d['reason']} → {d['decision']} to {d['next_batch_size']}"
    if not math.isfinite(row["train_loss"]):
        scale = " or scale the targets to about unit size" if row.get("target") == "float" else ""
        line += f" | the loss is not finite: lower --lr{scale}"
    return line
