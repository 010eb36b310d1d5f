"""`dali-fast train`: a real training loop where the loader is swapped with one line.

Runs as one process, or as one process per GPU under ``torchrun`` with DDP (nccl on GPUs, gloo on CPUs).
With a checkpoint folder it saves model, optimizer, scaler, controller and loader state every K steps
(atomically); ``resume`` continues at the exact sample where the checkpoint was taken, mid-epoch included.

`run_train` is a few named phases over one small state object (`_Run`): the settings checked
(`config.TrainConfig.checked`), the run set up (`_start`), a checkpoint resumed (`_resume`), each epoch trained
and evaluated (`_epoch`), the result written (`_finish`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..data.base import Reader, check_labels, fingerprint
from ..data.targets import target_spec
from ..files import atomic_write
from ..loaders.base import LoaderBase
from ..loaders.controller import BatchSizeController
from ..loaders.factory import make_loader
from ..transforms.mix import MixupCutmix
from ..transforms.recipe import Recipe, describe_resolution
from .checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_VERSION,
    IndexRecorder,
    check_resume_classes,
    check_resume_config,
    load_checkpoint,
    plain,
    rank_state,
    resume_batch_size,
    save_checkpoint,
)
from .config import TrainConfig, warn_if_sizes_exceed_images
from .distributed import DistContext, broadcast, distributed_context, gather
from .lines import epoch_line, intro_line
from .monitor import UtilizationMonitor
from .sets import RunSets, check_val_labels, held_out_note, run_sets
from .trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class _Run:
    """A run between its phases: what they read (settings, process, data, model, loaders) and the progress
    they make (epoch, step, rows, and the part of an epoch a mid-epoch checkpoint cut)."""

    config: TrainConfig
    ctx: DistContext
    emit: Callable[[str], None]
    sets: RunSets  # what it trains on (train_set) and evaluates on (val_set)
    trainer: Trainer
    ctrl: BatchSizeController | None
    recipe: Recipe  # as the loaders apply it (channels_last on a GPU)
    train_loader: Any = None
    val_loader: Any = None
    settings: dict[str, Any] = field(default_factory=dict)  # what a resume must match (kept in the checkpoint)
    start_epoch: int = 0
    step: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    partial: dict[str, float] = field(default_factory=lambda: {"samples": 0, "loss_sum": 0.0})
    recorder: IndexRecorder | None = None

    @property
    def train_set(self) -> Reader:
        return self.sets.train

    @property
    def val_set(self) -> Reader:
        return self.sets.val

    @property
    def resumable(self) -> bool:
        """The training loader resumes mid-epoch (ours do; a plain DataLoader does not)."""
        return isinstance(self.train_loader, LoaderBase)

    @property
    def ckpt_path(self) -> Path | None:
        folder = self.config.checkpoint
        return Path(folder) / CHECKPOINT_FILE if folder is not None else None


def run_train(
    reader: Reader,
    config: TrainConfig | None = None,
    *,
    emit: Callable[[str], None] = log.info,
    **settings: Any,
) -> list[dict[str, Any]]:
    """Train on ``reader`` as ``config`` (default `TrainConfig()`, with ``settings`` — its fields by name —
    changed) says; returns one row per epoch. Under torchrun every rank runs this; only rank 0 emits lines
    and writes the checkpoint and ``out``."""
    config = replace(config or TrainConfig(), **settings).checked()
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(distributed_context())
        run = _start(reader, config, ctx, emit if ctx.is_main else _silent)
        if config.resume:
            _resume(run)
        if config.record_indices is not None:
            run.recorder = stack.enter_context(IndexRecorder(config.record_indices, ctx.rank, ctx.world_size))
        run.emit(intro_line(run))
        monitor = stack.enter_context(UtilizationMonitor(device_index=ctx.device_index))
        for epoch in range(run.start_epoch, config.epochs):
            row = _epoch(run, epoch, monitor)
            run.rows.append(row)
            run.emit(epoch_line(row))
            if run.ckpt_path is not None:
                _save(run, epoch, True, 0, 0.0)
        _finish(run)
        return run.rows


def _silent(_line: str) -> None:
    """What ranks other than 0 emit: nothing (only rank 0 talks)."""


def _start(reader: Reader, config: TrainConfig, ctx: DistContext, emit: Callable[[str], None]) -> _Run:
    """The data split and checked, the model, the controller and the loaders: a run ready for epoch 0."""
    torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    sets = run_sets(reader, config.val, config.holdout, config.seed)  # --val, or a share held out
    train_set = sets.train
    if ctx.is_main:
        warn_if_sizes_exceed_images(config.recipe, reader, config.epochs)  # type: ignore[arg-type]
    per_rank = len(train_set) // ctx.world_size
    if config.drop_last and config.batch_size > per_rank:
        raise ValueError(
            f"--batch-size {config.batch_size} is larger than the {per_rank} training images of each of "
            f"{ctx.world_size} rank(s) ({len(train_set)}{held_out_note(sets, config.holdout)}): every batch would "
            f"be dropped; use --batch-size {max(1, per_rank)} or less, or more images"
        )
    kind, width = target_spec(reader)  # class labels, or multi-hot / float rows (checked at open)
    if kind == "class" and config.on_error == "raise":  # once, on the CPU, before any step; "skip" skips them
        check_labels(reader, width)  # as bad records
    check_val_labels(sets, config.on_error)
    mix = None
    if config.mixup > 0 or config.cutmix > 0:  # the same choices on every rank would mix alike: seed by rank
        mix = MixupCutmix(**config.mix, num_classes=width, seed=config.seed * 1000 + ctx.rank, target=kind)
    trainer = Trainer(
        config.model,
        width,
        lr=config.lr,
        amp=config.amp,
        dist_ctx=ctx,
        mix=mix,
        label_smoothing=config.label_smoothing if mix is None else 0.0,
        target=kind,
    )
    recipe = config.recipe
    assert recipe is not None  # resolved by TrainConfig.checked
    if trainer.device.type == "cuda":
        recipe = recipe.with_(memory_format=torch.channels_last)  # what the model wants, straight from the loader
    share = len(train_set) // ctx.world_size if config.drop_last else None  # a rank's whole batches at most
    run = _Run(config, ctx, emit, sets, trainer, _controller(config, trainer, share), recipe)
    kw = {
        "backend": config.loader,
        "image_size": config.image_size,
        "seed": config.seed,
        "num_workers": config.num_workers,
        "on_error": config.on_error,
        "recipe": recipe,
    }
    run.train_loader = make_loader(
        train_set, config.batch_size, train=True, controller=run.ctrl, drop_last=config.drop_last, **kw
    )
    run.val_loader = make_loader(sets.val, config.batch_size, train=False, **kw)
    run.settings = _settings(reader, run, mixing=mix is not None or bool(config.label_smoothing))
    if run.ckpt_path is not None and not run.resumable:
        emit(f"note: --loader {config.loader} cannot resume mid-epoch; checkpoints are written at epoch ends only")
    return run


def _controller(config: TrainConfig, trainer: Trainer, share: int | None) -> BatchSizeController | None:
    """With ``controller``: a `BatchSizeController` around the batch size that keeps the learning rate
    linear in the batch size (Goyal et al., 2017), never above a rank's ``share`` of the training set (with
    drop_last a larger batch is dropped whole: an epoch that trained nothing)."""
    if not config.controller:
        return None

    def rescale_lr(old: int, new: int) -> None:
        for g in trainer.opt.param_groups:
            g["lr"] *= new / old

    top = config.batch_size * 8 if share is None else max(1, min(config.batch_size * 8, share))
    return BatchSizeController(min(max(8, config.batch_size // 8), top), top, on_change=rescale_lr)


def _settings(reader: Reader, run: _Run, *, mixing: bool) -> dict[str, Any]:
    """What a resume must match: the run's settings that change what it trains on or how."""
    config = run.config
    settings = {
        "model": config.model,
        "loader": config.loader,
        "image_size": config.image_size,
        "seed": config.seed,
        **({"holdout": config.holdout} if run.sets.held_out != "val" else {"val": fingerprint(run.sets.val)}),
        "records": len(reader),
        "world_size": run.ctx.world_size,
        "controller": config.controller,
        "drop_last": config.drop_last,
        "fingerprint": fingerprint(reader),
    }
    kind, width = target_spec(reader)
    if kind != "class":  # kept out for class targets, so checkpoints written before target kinds still resume
        settings["target"] = f"{kind}:{width}"
    # A resolution schedule is its own setting, so another one is named as such (None matches the
    # checkpoints of runs written before schedules existed).
    settings["resolution"] = describe_resolution(run.recipe.resolution)
    # Other augmentation than the default is part of the run (kept out otherwise, so checkpoints
    # of default runs written before recipes existed still resume).
    recipe = run.recipe.with_(memory_format=torch.contiguous_format, resolution=None)
    if recipe != Recipe(image_size=config.image_size):
        settings["recipe"] = recipe.describe()
    if mixing:
        settings["mix"] = config.mix
    return settings


def _left_out(config: TrainConfig) -> dict[str, Any]:
    """What a setting `_settings` leaves out stands for: the default recipe, no batch mixing."""
    return {"recipe": Recipe(image_size=config.image_size).describe(), "mix": TrainConfig().mix}


def _resume(run: _Run) -> None:
    """Continue from the checkpoint, when there is one: model, optimizer, loader and progress as saved, also
    on another number of processes (each rank takes its part of the rest of the epoch, see `rank_state`)."""
    ctx, ckpt_path = run.ctx, run.ckpt_path
    assert ckpt_path is not None  # resume needs a checkpoint folder (TrainConfig.checked)
    found = ctx.is_main and ckpt_path.is_file()
    state = broadcast(load_checkpoint(ckpt_path) if found else None, ctx)
    if state is None:
        run.emit(f"no checkpoint in {run.config.checkpoint} yet: starting from the beginning")
        return
    elastic = {"world_size"}  # another number of processes resumes: the rest of the epoch is shared out again
    saved_config = {k: v for k, v in state["config"].items() if k not in elastic}
    settings = {k: v for k, v in run.settings.items() if k not in elastic}
    check_resume_classes(ckpt_path, state.get("classes"), run.train_set.classes)  # before the data's fingerprint
    check_resume_config(ckpt_path, saved_config, settings, defaults=_left_out(run.config))
    run.trainer.load_state_dict(state["trainer"])
    loader_state, run.partial = rank_state(ckpt_path, state["ranks"], ctx.rank, ctx.world_size)
    if loader_state is not None:
        run.train_loader.load_state_dict(loader_state)
    run.step, run.rows = int(state["step"]), list(state["rows"])
    run.start_epoch = int(state["epoch"]) + (1 if state["epoch_done"] else 0)
    torch.set_rng_state(state["torch_rng"])
    run.emit(f"resumed from {ckpt_path}: epoch {state['epoch']}, step {run.step}")
    if run.resumable and loader_state is not None:
        _resume_batch_size(run, int(loader_state["batch_size"]), len(state["ranks"]))


def _resume_batch_size(run: _Run, saved: int, saved_world: int) -> None:
    """The batch size of a resume: ``--batch-size`` as given; the same one on another number of processes
    keeps the global batch where it can (`resume_batch_size`); said in one line when it changes. Positions
    count samples, so any batch size resumes exactly (e.g. a smaller one after an out-of-memory)."""
    world = run.ctx.world_size
    if run.ctrl is not None:  # the controller sizes each rank's batch from its own memory
        if world != saved_world:
            run.emit(f"ranks {saved_world} → {world}: the controller sizes each rank's batch")
        run.ctrl.attach(run.ctrl.batch_size)  # within this run's bounds: a rank's share on this world size
        return
    most = len(run.train_set) // world if run.config.drop_last else None
    batch_size, line = resume_batch_size(saved, saved_world, run.config.batch_size, world, most)
    if line is not None:
        run.emit(line)
    run.train_loader.batch_size = batch_size


def _save(run: _Run, epoch: int, epoch_done: bool, samples: int, loss_sum: float) -> None:
    """A checkpoint of every rank's loader and progress, written by rank 0 (atomically)."""
    mine = {
        "loader": plain(run.train_loader.state_dict()) if run.resumable else None,
        "partial": {"samples": samples, "loss_sum": loss_sum},
    }
    ranks = gather(mine, run.ctx)
    if not run.ctx.is_main:
        return
    state = {
        "version": CHECKPOINT_VERSION,
        "config": run.settings,
        "step": run.step,
        "epoch": epoch,
        "epoch_done": epoch_done,
        "ranks": ranks,
        "classes": list(run.train_set.classes),  # the run's class map: a resume on another one is refused
        "trainer": run.trainer.state_dict(),
        "rows": plain(run.rows),
        "torch_rng": torch.get_rng_state(),
    }
    save_checkpoint(run.ckpt_path, state)  # type: ignore[arg-type]
    log.debug("checkpoint at epoch %d step %d → %s", epoch, run.step, run.ckpt_path)


def _epoch(run: _Run, epoch: int, monitor: UtilizationMonitor) -> dict[str, Any]:
    """One epoch trained (checkpoints every ``checkpoint_every`` steps), then evaluated: its row."""
    config, trainer, loader = run.config, run.trainer, run.train_loader
    _set_epoch(loader, epoch)
    batch_size = getattr(loader, "batch_size", config.batch_size)
    size = train_size(loader, config.image_size)
    before = run.rows[-1].get("image_size", size) if run.rows else size
    if size != before:
        # A new input shape: cudnn.benchmark (on on a GPU) times its convolution algorithms again on the
        # first batch, once per size (sizes seen before stay cached), and the controller has already
        # scaled the batch size to the pixels.
        tuned = (
            " (cudnn.benchmark re-tunes the convolutions on its first batch)" if trainer.device.type == "cuda" else ""
        )
        run.emit(f"epoch {epoch}: training at {size} px, was {before} px{tuned}")
    t0, n = time.perf_counter(), 0
    skipped_before = (getattr(loader, "skipped", 0), getattr(run.val_loader, "skipped", 0))
    loss_sum = torch.zeros((), device=trainer.device)  # summed on the device: no sync per step
    with monitor.phase(f"epoch{epoch}"):
        for images, labels in loader:
            loss_sum += trainer.step(images, labels, run.ctrl) * len(labels)
            n += len(labels)
            run.step += 1
            if run.recorder is not None:
                run.recorder.write(epoch, run.step, run.sets.record_ids(loader.last_indices))
            if run.ckpt_path is not None and run.resumable and run.step % config.checkpoint_every == 0:
                _save(run, epoch, False, run.partial["samples"] + n, run.partial["loss_sum"] + float(loss_sum))
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_all, loss_all = trainer.all_sum(n, float(loss_sum))
    done, done_loss = trainer.all_sum(run.partial["samples"], run.partial["loss_sum"])
    run.partial = {"samples": 0, "loss_sum": 0.0}
    val_loss, val_metric = trainer.evaluate(run.val_loader)
    skipped = trainer.all_sum(  # bad records skipped this epoch (--on-error skip), over every rank
        getattr(loader, "skipped", 0) - skipped_before[0], getattr(run.val_loader, "skipped", 0) - skipped_before[1]
    )
    metric = {"class": {"val_acc": val_metric}, "multihot": {"val_map": val_metric}}.get(trainer.target, {})
    util = monitor.summary(f"epoch{epoch}")
    return {
        "epoch": epoch,
        "batch_size": batch_size,
        "image_size": size,
        "train_loss": (loss_all + done_loss) / max(n_all + done, 1),
        "val_loss": val_loss,
        **metric,
        "img_per_s": n_all / dt,
        "ranks": run.ctx.world_size,
        "resumed": done > 0,
        "util_kind": util["kind"],
        "util_mean": util["mean"],
        "decision": run.ctrl.history[-1] if run.ctrl is not None and run.ctrl.history else None,
        "skipped": {"train": int(skipped[0]), "held_out": int(skipped[1])},
        "target": trainer.target,
    }


def _finish(run: _Run) -> None:
    """Whether the ranks ended with the same weights, and train.json (rank 0, with ``out``)."""
    in_sync = run.trainer.replicas_in_sync()
    if run.ctx.distributed:
        run.emit(f"replicas in sync after training: {'yes' if in_sync else 'NO'}")
    out = run.config.out
    if out is not None and run.ctx.is_main:
        result = {"config": run.settings, "rows": run.rows, "replicas_in_sync": in_sync, "steps": run.step}
        atomic_write(Path(out) / "train.json", lambda f: f.write(json.dumps(plain(result), indent=2).encode()))


def train_size(loader: Any, default: int) -> int:
    """The training loader's image size this epoch (a resolution schedule's; the baseline's sampler knows it)."""
    size = getattr(loader, "image_size", None) or getattr(getattr(loader, "sampler", None), "image_size", None)
    return int(size) if size else int(default)


def _set_epoch(loader: Any, epoch: int) -> None:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)  # a plain DataLoader with a DistributedSampler
