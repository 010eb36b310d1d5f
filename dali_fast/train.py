"""`dali-fast train`: a real training loop where the loader is swapped with one line."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from .controller import BatchSizeController, oom_safe_step
from .models import build_model
from .records import Reader

log = logging.getLogger(__name__)
LOADERS = ("baseline", "torch", "dali")


class SubsetReader:
    """The reader interface over some of another reader's records (e.g. a held-out split)."""

    def __init__(self, reader: Reader, indices: Sequence[int]) -> None:
        self.reader, self.indices = reader, np.asarray(indices, dtype=np.int64)
        self.classes = reader.classes

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.reader[int(self.indices[i])]

    def source(self, i: int) -> str:
        return self.reader.source(int(self.indices[i]))

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.reader.labels)[self.indices]  # type: ignore[attr-defined]


def split(reader: Reader, holdout: float, seed: int = 0) -> tuple[SubsetReader, SubsetReader]:
    """(train, held-out) subsets; the held-out share is drawn per class-agnostic permutation of (seed)."""
    order = np.random.default_rng([seed, 99]).permutation(len(reader))
    k = max(1, int(round(len(reader) * holdout)))
    return SubsetReader(reader, np.sort(order[k:])), SubsetReader(reader, np.sort(order[:k]))


def make_loader_for(
    kind: str,
    reader: Reader,
    batch_size: int,
    *,
    train: bool,
    image_size: int,
    seed: int = 0,
    cache_bytes: int = 0,
    controller: BatchSizeController | None = None,
    num_workers: int | None = None,
) -> Iterable:
    """One line swaps the loader: 'baseline' (plain DataLoader), 'torch' (TorchIterator) or 'dali'."""
    if kind == "baseline":
        from .baseline import baseline_loader

        return baseline_loader(reader, batch_size, train=train, image_size=image_size, num_workers=num_workers)
    if kind not in LOADERS:
        raise ValueError(f"loader {kind!r}: choose one of {', '.join(LOADERS)}")
    from .fallback import make_loader

    return make_loader(
        reader,
        batch_size,
        backend=kind,
        num_workers=num_workers,
        train=train,
        image_size=image_size,
        seed=seed,
        cache_bytes=cache_bytes,
        controller=controller,
    )


class Trainer:
    """Model, optimizer and one step (AMP on GPU, channels_last), shared by train and bench."""

    def __init__(self, model_name: str, num_classes: int, *, lr: float = 0.05, amp: bool = True) -> None:
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model: nn.Module = build_model(model_name, num_classes).to(self.device)
        if self.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-5)
        self.amp = amp and self.device.type == "cuda"
        bf16 = self.amp and torch.cuda.is_bf16_supported()
        self.amp_dtype = torch.bfloat16 if bf16 else torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp and not bf16)
        self.loss_fn = nn.CrossEntropyLoss()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=self.amp_dtype) if self.amp else contextlib.nullcontext()

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device, non_blocking=True)

    def step(self, images: torch.Tensor, labels: torch.Tensor, controller: BatchSizeController | None = None) -> float:
        """One SGD step on the batch (split in halves on CUDA out-of-memory); returns the loss."""
        images, labels = self.to_device(images, labels)
        self.model.train()

        def forward_backward(x: torch.Tensor, y: torch.Tensor, weight: float) -> float:
            with self._autocast():
                loss = self.loss_fn(self.model(x), y)
            self.scaler.scale(loss * weight).backward()
            return float(loss.detach())

        self.opt.zero_grad(set_to_none=True)
        loss = oom_safe_step(
            forward_backward,
            images,
            labels,
            zero_grad=lambda: self.opt.zero_grad(set_to_none=True),
            controller=controller,
        )
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> tuple[float, float]:
        """(mean loss, accuracy) over a loader."""
        self.model.eval()
        total = correct = 0
        loss_sum = 0.0
        for images, labels in loader:
            images, labels = self.to_device(images, labels)
            with self._autocast():
                logits = self.model(images)
            loss_sum += float(self.loss_fn(logits.float(), labels)) * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            total += len(labels)
        return loss_sum / max(total, 1), correct / max(total, 1)


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
    emit: Callable[[str], None] = log.info,
) -> list[dict[str, Any]]:
    """Train ``model`` on ``reader`` with the chosen loader; returns one row per epoch."""
    from .monitor import UtilizationMonitor

    torch.manual_seed(seed)
    train_set, val_set = split(reader, holdout, seed)
    trainer = Trainer(model, len(reader.classes), lr=lr, amp=amp)
    ctrl = None
    if controller:

        def rescale_lr(old: int, new: int) -> None:
            for g in trainer.opt.param_groups:
                g["lr"] *= new / old

        ctrl = BatchSizeController(max(8, batch_size // 8), batch_size * 8, on_change=rescale_lr)
    kw = dict(image_size=image_size, seed=seed, num_workers=num_workers)
    train_loader = make_loader_for(loader, train_set, batch_size, train=True, controller=ctrl, **kw)
    val_loader = make_loader_for(loader, val_set, batch_size, train=False, **kw)
    rows = []
    emit(
        f"training {model} on {len(train_set)} images ({len(val_set)} held out), loader={loader}, device={trainer.device}"
    )
    with UtilizationMonitor() as mon:
        for epoch in range(epochs):
            if hasattr(train_loader, "set_epoch"):
                train_loader.set_epoch(epoch)
            bs = getattr(train_loader, "batch_size", batch_size)
            t0, n, losses = time.perf_counter(), 0, []
            with mon.phase(f"epoch{epoch}"):
                for images, labels in train_loader:
                    losses.append(trainer.step(images, labels, ctrl) * len(labels))
                    n += len(labels)
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            val_loss, val_acc = trainer.evaluate(val_loader)
            util = mon.summary(f"epoch{epoch}")
            row = {
                "epoch": epoch,
                "batch_size": bs,
                "train_loss": sum(losses) / max(n, 1),
                "val_loss": val_loss,
                "val_acc": val_acc,
                "img_per_s": n / dt,
                "util_kind": util["kind"],
                "util_mean": util["mean"],
                "decision": ctrl.history[-1] if ctrl is not None and ctrl.history else None,
            }
            rows.append(row)
            util_s = f"{util['mean']:.0f}%" if isinstance(util["mean"], float) else "n/a"
            line = (
                f"epoch {epoch}: loss {row['train_loss']:.3f}, held-out loss {val_loss:.3f} acc {val_acc:.1%}, "
                f"{row['img_per_s']:.0f} img/s, {util['kind']} util {util_s}, batch {bs}"
            )
            if row["decision"] is not None:
                d = row["decision"]
                line += f" | controller: {d['reason']} → {d['decision']} to {d['next_batch_size']}"
            emit(line)
    return rows
