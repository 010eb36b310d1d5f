"""`dali-fast train`: a real training loop where the loader is swapped with one line.

Runs as one process, or as one process per GPU under ``torchrun`` with DDP (nccl on GPUs, gloo
on CPUs). With ``checkpoint=DIR`` it saves model, optimizer, scaler, controller and loader
state every K steps (atomically); ``resume=True`` continues at the exact sample where the
checkpoint was taken, mid-epoch included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_VERSION,
    IndexRecorder,
    check_resume_config,
    load_checkpoint,
    plain,
    save_checkpoint,
)
from .data.base import Reader, check_labels, check_on_error, fingerprint, split
from .loaders.base import LoaderBase
from .loaders.controller import BatchSizeController, oom_safe_step
from .loaders.factory import BACKENDS, make_loader
from .models import build_model
from .system import atomic_write, check_writable_folder, cuda_usable, local_device_index
from .transforms.mix import MixupCutmix, soft_target_cross_entropy
from .transforms.recipe import Recipe, resolve_recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """This process's place in a job: rank ``rank`` of ``world_size``, local rank ``local_rank``, driving
    CUDA device ``device_index`` (``local_rank``, or ``local_rank % device_count()`` where the launcher
    shows each process fewer GPUs than there are local ranks)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device_index: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@contextlib.contextmanager
def distributed_context(timeout_s: float = 1800) -> Iterator[DistContext]:
    """This process's `DistContext`, joining torchrun's process group when started with WORLD_SIZE > 1
    (nccl on GPUs, gloo on CPUs) and leaving it on exit; a group made by the caller is used and kept.

    Each process drives the GPU `local_device_index` gives (``LOCAL_RANK``, modulo the visible devices
    when a launcher such as SLURM shows each process its own); outside torchrun it is a single process.
    """
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    device = local_device_index() if cuda_usable() else 0
    if dist.is_available() and dist.is_initialized():
        yield DistContext(dist.get_rank(), dist.get_world_size(), local, str(dist.get_backend()), device)
        return
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        yield DistContext(local_rank=local, device_index=device)
        return
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
    if cuda_usable():
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield DistContext(dist.get_rank(), dist.get_world_size(), local, backend, device)
    finally:
        dist.destroy_process_group()


class Trainer:
    """Model, optimizer and one step (AMP on GPU, channels_last, DDP under torchrun), shared by train and bench."""

    def __init__(
        self,
        model_name: str,
        num_classes: int,
        *,
        lr: float = 0.05,
        amp: bool = True,
        dist_ctx: DistContext | None = None,
        mix: MixupCutmix | None = None,
        label_smoothing: float = 0.0,
    ) -> None:
        self.ctx = dist_ctx or DistContext()
        self.mix = mix  # batch-level mixup/cutmix: the step trains on soft targets
        if cuda_usable():
            self.device = torch.device(
                "cuda", self.ctx.device_index if self.ctx.distributed else torch.cuda.current_device()
            )
        else:
            self.device = torch.device("cpu")
        self.module: nn.Module = build_model(model_name, num_classes).to(self.device)
        if self.device.type == "cuda":
            self.module = self.module.to(memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = True  # fixed-size inputs: pick the fastest convolutions once
        self.model: nn.Module = self.module
        if self.ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=ids)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-5)
        self.amp = amp and self.device.type == "cuda"
        bf16 = self.amp and torch.cuda.is_bf16_supported()
        self.amp_dtype = torch.bfloat16 if bf16 else torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp and not bf16)
        self.loss_fn = nn.CrossEntropyLoss()  # held-out loss: plain cross-entropy, comparable across recipes
        self.train_loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing) if label_smoothing else self.loss_fn

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=self.amp_dtype) if self.amp else contextlib.nullcontext()

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device, non_blocking=True)

    def step(
        self, images: torch.Tensor, labels: torch.Tensor, controller: BatchSizeController | None = None
    ) -> torch.Tensor:
        """One SGD step on the batch; returns the loss as a 0-d tensor on the device (no host sync:
        the caller sums losses on the device and reads them once per epoch or checkpoint).

        On CUDA out-of-memory a single process runs the batch as two halves. Under DDP the OOM is
        raised instead: halving on one rank only would desynchronize the gradient all-reduce.
        """
        images, labels = self.to_device(images, labels)
        self.model.train()
        if self.mix is not None:
            images, labels = self.mix(images, labels)  # labels become (N, classes) soft targets

        def forward_backward(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
            with self._autocast():
                logits = self.model(x)
                loss = soft_target_cross_entropy(logits, y) if y.dim() == 2 else self.train_loss_fn(logits, y)
            self.scaler.scale(loss * weight).backward()
            return loss.detach().float()

        self.opt.zero_grad(set_to_none=True)
        try:
            loss = oom_safe_step(
                forward_backward,
                images,
                labels,
                zero_grad=lambda: self.opt.zero_grad(set_to_none=True),
                controller=controller,
                min_split=len(labels) if self.ctx.distributed else 1,
            )
        except ValueError as e:
            if len(labels) == 1 and "more than 1 value per channel" in str(e):
                raise ValueError(
                    "a batch of one sample reached BatchNorm in training; "
                    "train with drop_last (--drop-last) or a batch size that does not leave 1 sample"
                ) from e
            raise
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> tuple[float, float]:
        """(mean loss, accuracy) over a loader; under DDP over all ranks' shards together.

        The sums stay on the device and are read once at the end: no host sync per batch."""
        self.module.eval()
        total = 0
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, correct
        for images, labels in loader:
            images, labels = self.to_device(images, labels)
            with self._autocast():
                logits = self.module(images)
            loss = self.loss_fn(logits.float(), labels) * len(labels)
            sums += torch.stack([loss.double(), (logits.argmax(1) == labels).sum().double()])
            total += len(labels)
        loss_sum, correct = sums.tolist()
        loss_sum, correct, total = self.all_sum(loss_sum, correct, total)
        return loss_sum / max(total, 1), correct / max(total, 1)

    def all_sum(self, *values: float) -> list[float]:
        """Sums of ``values`` over all ranks (the values themselves in a single process)."""
        if not self.ctx.distributed:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def replicas_in_sync(self) -> bool:
        """True when every rank holds the same weights (always, in a single process)."""
        if not self.ctx.distributed:
            return True
        import torch.distributed as dist

        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for p in self.module.parameters():
            x = p.detach().double()
            total += torch.stack([x.sum(), (x * x).sum()])
        gathered = [torch.zeros_like(total) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, total)
        return all(torch.allclose(g, gathered[0], rtol=1e-9, atol=0) for g in gathered)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


def _set_epoch(loader: Any, epoch: int) -> None:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)  # a plain DataLoader with a DistributedSampler


def _gather(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank (so only rank 0 needs to see the checkpoint folder)."""
    if not ctx.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_train(
    reader: Reader,
    *,
    loader: str = "dali",
    epochs: int = 5,
    model: str = "resnet18",
    batch_size: int = 64,
    image_size: int = 224,
    lr: float = 0.05,
    amp: bool = True,
    controller: bool = False,
    holdout: float = 0.2,
    seed: int = 0,
    num_workers: int | None = None,
    drop_last: bool = True,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 500,
    resume: bool = False,
    record_indices: str | Path | None = None,
    out: str | Path | None = None,
    on_error: str = "raise",
    recipe: Recipe | None = None,
    mixup: float = 0.0,
    cutmix: float = 0.0,
    label_smoothing: float = 0.0,
    emit: Callable[[str], None] = log.info,
) -> list[dict[str, Any]]:
    """Train ``model`` on ``reader`` with the chosen loader; returns one row per epoch.

    Under torchrun every rank runs this; only rank 0 emits lines and writes ``checkpoint`` and ``out``.
    ``drop_last`` (the default, as is usual for training) leaves out each epoch's incomplete last
    batch, so BatchNorm never meets a one-sample batch. ``recipe`` is the per-image transform (its
    ``image_size`` must agree with ``image_size``); ``mixup``/``cutmix`` (Beta alphas, 0: off) mix each
    batch and train on soft targets, smoothed by ``label_smoothing``.
    """
    recipe = resolve_recipe(recipe, image_size=image_size)
    mix_kw = {"alpha_mixup": mixup, "alpha_cutmix": cutmix, "label_smoothing": label_smoothing}
    MixupCutmix(**mix_kw)  # settings checked before any work
    if mixup > 0 and not recipe.normalize:
        raise ValueError("mixup blends images: it needs normalized float images, not a recipe with mean=None")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be >= 1 step")
    if resume and checkpoint is None:
        raise ValueError("resume needs a checkpoint folder: pass --checkpoint DIR with --resume")
    if loader not in BACKENDS:
        raise ValueError(f"loader {loader!r}: choose one of {', '.join(BACKENDS)}")
    check_on_error(on_error)
    if controller and loader == "baseline":
        raise ValueError("--controller needs --loader dali or torch (the plain DataLoader's batch size is fixed)")
    if record_indices is not None and loader == "baseline":
        raise ValueError("--record-indices needs --loader dali or torch (the plain DataLoader does not expose indices)")
    from .monitor import UtilizationMonitor

    checkpoint = Path(checkpoint) if checkpoint is not None else None
    out = Path(out) if out is not None else None
    # Where results go is checked before any work, not found unwritable after the last epoch.
    for folder, what in ((out, "--out"), (checkpoint, "--checkpoint")):
        if folder is not None:
            check_writable_folder(folder, what)
    if record_indices is not None:
        check_writable_folder(Path(record_indices).parent, "--record-indices")
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(distributed_context())
        if not ctx.is_main:
            emit = lambda _line: None  # noqa: E731 - only rank 0 talks
        torch.manual_seed(seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
        train_set, val_set = split(reader, holdout, seed)
        per_rank = len(train_set) // ctx.world_size
        if drop_last and batch_size > per_rank:
            raise ValueError(
                f"--batch-size {batch_size} is larger than the {per_rank} training images of each of "
                f"{ctx.world_size} rank(s) ({len(train_set)} after holding out {holdout:.0%}): every batch would be "
                f"dropped; use --batch-size {max(1, per_rank)} or less, or more images"
            )
        check_labels(reader, len(reader.classes))  # once, on the CPU: never per step on the device
        mix = None
        if mixup > 0 or cutmix > 0:  # the same choices on every rank would mix alike: seed by rank
            mix = MixupCutmix(**mix_kw, num_classes=len(reader.classes), seed=seed * 1000 + ctx.rank)
        trainer = Trainer(
            model,
            len(reader.classes),
            lr=lr,
            amp=amp,
            dist_ctx=ctx,
            mix=mix,
            label_smoothing=label_smoothing if mix is None else 0.0,
        )
        ctrl = None
        if controller:

            def rescale_lr(old: int, new: int) -> None:
                for g in trainer.opt.param_groups:
                    g["lr"] *= new / old

            ctrl = BatchSizeController(max(8, batch_size // 8), batch_size * 8, on_change=rescale_lr)
        if trainer.device.type == "cuda":
            recipe = recipe.with_(memory_format=torch.channels_last)  # what the model wants, straight from the loader
        kw = dict(
            backend=loader, image_size=image_size, seed=seed, num_workers=num_workers, on_error=on_error, recipe=recipe
        )
        train_loader = make_loader(train_set, batch_size, train=True, controller=ctrl, drop_last=drop_last, **kw)
        val_loader = make_loader(val_set, batch_size, train=False, **kw)
        resumable = isinstance(train_loader, LoaderBase)
        config = {
            "model": model,
            "loader": loader,
            "image_size": image_size,
            "seed": seed,
            "holdout": holdout,
            "records": len(reader),
            "world_size": ctx.world_size,
            "controller": controller,
            "drop_last": drop_last,
            "fingerprint": fingerprint(reader),
        }
        # Other augmentation than the default is part of the run (kept out otherwise, so checkpoints
        # of default runs written before recipes existed still resume).
        if recipe.with_(memory_format=torch.contiguous_format) != Recipe(image_size=image_size):
            config["recipe"] = recipe.with_(memory_format=torch.contiguous_format).describe()
        if mix is not None or label_smoothing:
            config["mix"] = mix_kw
        ckpt_path = checkpoint / CHECKPOINT_FILE if checkpoint is not None else None
        if ckpt_path is not None and not resumable:
            emit(f"note: --loader {loader} cannot resume mid-epoch; checkpoints are written at epoch ends only")

        start_epoch, step, rows = 0, 0, []
        partial = {"samples": 0, "loss_sum": 0.0}  # of the epoch a mid-epoch checkpoint cut
        if resume and ckpt_path is not None:
            found = ctx.is_main and ckpt_path.is_file()
            state = _broadcast(load_checkpoint(ckpt_path) if found else None, ctx)
            if state is None:
                emit(f"no checkpoint in {checkpoint} yet: starting from the beginning")
            else:
                check_resume_config(ckpt_path, state["config"], config)
                trainer.load_state_dict(state["trainer"])
                mine = state["ranks"][ctx.rank]
                if mine["loader"] is not None:
                    train_loader.load_state_dict(mine["loader"])  # type: ignore[union-attr]
                step, rows = int(state["step"]), list(state["rows"])
                start_epoch = int(state["epoch"]) + (1 if state["epoch_done"] else 0)
                partial = dict(mine["partial"])
                torch.set_rng_state(state["torch_rng"])
                emit(f"resumed from {ckpt_path}: epoch {state['epoch']}, step {step}")
                if resumable and ctrl is None and train_loader.batch_size != batch_size:  # type: ignore[union-attr]
                    # Positions count samples, so a new batch size resumes exactly too (e.g. after an OOM).
                    emit(f"batch size {train_loader.batch_size} → {batch_size} as given")  # type: ignore[union-attr]
                    train_loader.batch_size = batch_size  # type: ignore[union-attr]

        def save(epoch: int, epoch_done: bool, samples: int, loss_sum: float) -> None:
            mine = {
                "loader": plain(train_loader.state_dict()) if resumable else None,
                "partial": {"samples": samples, "loss_sum": loss_sum},
            }
            ranks = _gather(mine, ctx)
            if not ctx.is_main:
                return
            save_checkpoint(
                ckpt_path,  # type: ignore[arg-type]
                {
                    "version": CHECKPOINT_VERSION,
                    "config": config,
                    "step": step,
                    "epoch": epoch,
                    "epoch_done": epoch_done,
                    "ranks": ranks,
                    "trainer": trainer.state_dict(),
                    "rows": plain(rows),
                    "torch_rng": torch.get_rng_state(),
                },
            )
            log.debug("checkpoint at epoch %d step %d → %s", epoch, step, ckpt_path)

        recorder = IndexRecorder(record_indices, ctx.rank, ctx.world_size) if record_indices is not None else None
        if recorder is not None:
            stack.enter_context(recorder)
        subset = train_set.indices
        extras = [f"{k}={v}" for k, v in mix_kw.items() if v]
        if recipe.auto_augment:
            extras.insert(0, f"augment={recipe.auto_augment}")
        if recipe.random_erasing:
            extras.append(f"random_erasing={recipe.random_erasing}")
        emit(
            f"training {model} on {len(train_set)} images ({len(val_set)} held out), loader={loader}, "
            f"device={trainer.device}"
            + (f", {ctx.world_size} ranks ({ctx.backend})" if ctx.distributed else "")
            + (f", {', '.join(extras)}" if extras else "")
        )
        mon = stack.enter_context(UtilizationMonitor(device_index=ctx.device_index))
        for epoch in range(start_epoch, epochs):
            _set_epoch(train_loader, epoch)
            bs = getattr(train_loader, "batch_size", batch_size)
            t0, n = time.perf_counter(), 0
            loss_sum = torch.zeros((), device=trainer.device)  # summed on the device: no sync per step
            with mon.phase(f"epoch{epoch}"):
                for images, labels in train_loader:
                    loss_sum += trainer.step(images, labels, ctrl) * len(labels)
                    n += len(labels)
                    step += 1
                    if recorder is not None:
                        recorder.write(epoch, step, subset[train_loader.last_indices])  # type: ignore[union-attr]
                    if ckpt_path is not None and resumable and step % checkpoint_every == 0:
                        save(epoch, False, partial["samples"] + n, partial["loss_sum"] + float(loss_sum))
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            n_all, loss_all = trainer.all_sum(n, float(loss_sum))
            done, done_loss = trainer.all_sum(partial["samples"], partial["loss_sum"])
            partial = {"samples": 0, "loss_sum": 0.0}
            val_loss, val_acc = trainer.evaluate(val_loader)
            util = mon.summary(f"epoch{epoch}")
            row = {
                "epoch": epoch,
                "batch_size": bs,
                "train_loss": (loss_all + done_loss) / max(n_all + done, 1),
                "val_loss": val_loss,
                "val_acc": val_acc,
                "img_per_s": n_all / dt,
                "ranks": ctx.world_size,
                "resumed": done > 0,
                "util_kind": util["kind"],
                "util_mean": util["mean"],
                "decision": ctrl.history[-1] if ctrl is not None and ctrl.history else None,
            }
            rows.append(row)
            emit(_epoch_line(row))
            if ckpt_path is not None:
                save(epoch, True, 0, 0.0)
        in_sync = trainer.replicas_in_sync()
        if ctx.distributed:
            emit(f"replicas in sync after training: {'yes' if in_sync else 'NO'}")
        if out is not None and ctx.is_main:
            result = {"config": config, "rows": rows, "replicas_in_sync": in_sync, "steps": step}
            atomic_write(out / "train.json", lambda f: f.write(json.dumps(plain(result), indent=2).encode()))
        return rows


def _epoch_line(row: dict[str, Any]) -> str:
    util_s = f"{row['util_mean']:.0f}%" if isinstance(row["util_mean"], float) else "n/a"
    line = (
        f"epoch {row['epoch']}: loss {row['train_loss']:.3f}, held-out loss {row['val_loss']:.3f} "
        f"acc {row['val_acc']:.1%}, {row['img_per_s']:.0f} img/s, {row['util_kind']} util {util_s}, "
        f"batch {row['batch_size']}"
    )
    if row["ranks"] > 1:
        line += f" x {row['ranks']} ranks"
    if row["resumed"]:
        line += " (resumed mid-epoch)"
    if row["decision"] is not None:
        d = row["decision"]
        line += f" | controller: {d['reason']} → {d['decision']} to {d['next_batch_size']}"
    return line
