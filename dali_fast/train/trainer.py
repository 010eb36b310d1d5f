"""`Trainer`: the model, its optimizer and one training step (AMP on a GPU, channels_last, DDP under
torchrun, mixup/cutmix soft targets; cross-entropy for class targets, BCE-with-logits for multi-hot, MSE
for float), shared by ``train`` and ``bench``; and `oom_safe_step`, a step that survives a CUDA
out-of-memory by running the batch as halves."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..loaders.controller import BatchSizeController
from ..machine import cuda_usable
from ..transforms.mix import MixupCutmix, smooth_multihot, soft_target_cross_entropy
from .distributed import DistContext
from .metrics import mean_average_precision
from .models import build_model

log = logging.getLogger(__name__)


class Trainer:
    """Model, optimizer and one step (AMP on GPU, channels_last, DDP under torchrun), shared by train and bench.

    ``target`` is what the batches' second tensor is (`data.targets`): "class" (int64 labels; cross-entropy,
    accuracy), "multihot" (float32 rows of ``num_classes``; BCE-with-logits, label smoothing per class,
    mean average precision) or "float" (float32 rows of ``num_classes`` numbers; MSE).
    """

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
        target: str = "class",
    ) -> None:
        if target not in ("class", "multihot", "float"):
            raise ValueError(f"target={target!r}: use 'class', 'multihot' or 'float'")
        if target == "float" and label_smoothing:
            raise ValueError(f"label_smoothing={label_smoothing}: float targets have no classes to smooth; use 0")
        self.target = target
        self.ctx = dist_ctx or DistContext()
        self.mix = mix  # batch-level mixup/cutmix: the step trains on soft targets
        if cuda_usable():
            self.device = torch.device(
                "cuda", self.ctx.device_index if self.ctx.distributed else torch.cuda.current_device()
            )
        else:
            self.device = torch.device("cpu")
        self.module: nn.Module = build_model(model_name, num_classes).to(self.device)
        self.module_outputs = num_classes
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
        self.label_smoothing = label_smoothing
        # held-out loss: the plain loss of the target kind, comparable across recipes
        self.loss_fn: nn.Module = {"class": nn.CrossEntropyLoss, "multihot": nn.BCEWithLogitsLoss}.get(
            target, nn.MSELoss
        )()
        self.train_loss_fn = (
            nn.CrossEntropyLoss(label_smoothing=label_smoothing)
            if label_smoothing and target == "class"
            else self.loss_fn
        )

    def train_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch: soft-target cross-entropy for mixed class targets ((N, classes)
        rows), else the target kind's loss (multi-hot rows smoothed per class first)."""
        if self.target == "class":
            return soft_target_cross_entropy(logits, y) if y.dim() == 2 else self.train_loss_fn(logits, y)
        if self.target == "multihot":
            y = smooth_multihot(y, self.label_smoothing)
        return self.train_loss_fn(logits.float(), y.float())

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
                loss = self.train_loss(logits, y)
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
    def evaluate(self, loader: Iterable) -> tuple[float, float | None]:
        """(mean loss, metric) over a loader; under DDP over all ranks' shards together, with rank 0's
        weights and BatchNorm statistics on every rank (each rank's statistics drift apart in training: DDP
        hands out rank 0's only at the next step), so the numbers are those of the model a checkpoint
        saves. An evaluation loader repeats no sample (``even=False``), so they equal one process's. The
        metric is the accuracy for class targets, the mean average precision
        (`metrics.mean_average_precision`, over the classes with a positive) for multi-hot targets, and
        None for float targets.

        The sums stay on the device and are read once at the end: no host sync per batch (multi-hot
        targets keep each batch's logits and targets on the device for the mAP, read once at the end)."""
        self.module.eval()
        if self.ctx.distributed:
            import torch.distributed as dist

            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)
        total = 0
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, correct
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for images, labels in loader:
            images, labels = self.to_device(images, labels)
            with self._autocast():
                logits = self.module(images)
            loss = self.loss_fn(logits.float(), labels) * len(labels)
            correct = (
                (logits.argmax(1) == labels).sum() if self.target == "class" else torch.zeros((), device=self.device)
            )
            sums += torch.stack([loss.double(), correct.double()])
            total += len(labels)
            if self.target == "multihot":
                kept.append((logits.float(), labels))
        loss_sum, correct_sum = sums.tolist()
        loss_sum, correct_sum, total = self.all_sum(loss_sum, correct_sum, total)
        metric: float | None = None
        if self.target == "class":
            metric = correct_sum / max(total, 1)
        elif self.target == "multihot":
            metric = self._held_out_map(kept)
        return loss_sum / max(total, 1), metric

    def _held_out_map(self, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The mAP of every rank's (logits, targets) together."""
        width = self.module_outputs
        scores = torch.cat([k[0] for k in kept]).cpu() if kept else torch.empty(0, width)
        targets = torch.cat([k[1] for k in kept]).float().cpu() if kept else torch.empty(0, width)
        if self.ctx.distributed:
            import torch.distributed as dist

            parts: list = [None] * self.ctx.world_size
            dist.all_gather_object(parts, (scores, targets))
            scores, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return mean_average_precision(scores, targets)

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


# pragma: no mutate block (the OOM split: tested with fakes and, on a GPU, real allocations)
def oom_safe_step(
    step: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor | float],
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    zero_grad: Callable[[], None],
    controller: BatchSizeController | None = None,
    min_split: int = 1,
) -> torch.Tensor | float:
    """Run ``step(images, labels, weight)`` (forward + backward, loss scaled by ``weight``); on CUDA
    out-of-memory, empty the cache and run the batch as two halves (each sample once), recursively.

    The caller steps the optimizer after it returns; gradients then equal the whole batch's.
    Returns the batch's loss. The OOM is reported to ``controller``, which shrinks at the next epoch.
    """
    n = len(labels)
    try:
        return step(images, labels, 1.0)  # as the step returns it: a device tensor is not synced here
    except torch.cuda.OutOfMemoryError:
        if n <= min_split:
            raise
    # Recover here, outside the `except` block: inside it, the exception's traceback would keep the
    # failed step's frames, and with them its activations and graph, alive while the halves run.
    zero_grad()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if controller is not None:
        controller.report_oom(n)
    log.warning("out of memory on a batch of %d: running it as two halves", n)
    half = n // 2
    total: torch.Tensor | float = 0.0
    for lo, hi in ((0, half), (half, n)):

        def part(x: torch.Tensor, y: torch.Tensor, w: float, _s: float = (hi - lo) / n) -> torch.Tensor | float:
            return step(x, y, w * _s)

        total += oom_safe_step(
            part, images[lo:hi], labels[lo:hi], zero_grad=lambda: None, controller=None, min_split=min_split
        ) * ((hi - lo) / n)
    return total
