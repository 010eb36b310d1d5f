"""Batch-level mixup and cutmix with label smoothing (`MixupCutmix`), and the loss for their soft targets.

`MixupCutmix` works on any ``(images, labels)`` batch, from our loaders or a plain DataLoader, on the
batch's own device, and is reproducible from a seed (one generator, on the CPU, draws every choice)::

    mix = MixupCutmix(alpha_mixup=0.8, alpha_cutmix=1.0, label_smoothing=0.1, num_classes=1000, seed=0)
    for images, labels in loader:
        images, targets = mix(images, labels)      # targets: (N, num_classes), rows sum to 1
        loss = soft_target_cross_entropy(model(images), targets)

With multi-hot or float targets (``open_dataset(path, target=...)``: the loaders yield float32 rows),
``target="multihot"`` or ``"float"`` mixes those rows with the images' weight, and label smoothing acts
per class on multi-hot rows (`smooth_multihot`); train on them with BCE-with-logits or MSE.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class MixupCutmix:
    """Batch-level mixup (Zhang et al., 2018) and cutmix (Yun et al., 2019) with label smoothing.

    With probability ``prob`` a batch is mixed with its own reversal (sample i with sample N-1-i): by
    cutmix with probability ``switch_prob`` when both are on, else by mixup. Mixup blends the images with
    weight lam ~ Beta(alpha_mixup, alpha_mixup); cutmix pastes a box of area (1 - lam) x H x W, lam ~
    Beta(alpha_cutmix, alpha_cutmix), clipped to the image, and then sets lam to the area actually kept.
    Targets are ``lam * onehot(y) + (1 - lam) * onehot(y_reversed)``, smoothed by ``label_smoothing``.
    ``last`` records the last batch's choice: ``{"mode": "mixup"|"cutmix"|"none", "lam": ..., "box": ...}``.

    ``target`` says what the batches' second tensor is: ``"class"`` (int64 labels, made one-hot),
    ``"multihot"`` or ``"float"`` (float rows ``(N, num_classes)``, as the loaders yield them for such data
    sets). Rows are mixed as they are, with the images' ``lam``; label smoothing applies per class to
    multi-hot rows (`smooth_multihot`) and is refused for float rows (no class to smooth towards).

    Args:
        alpha_mixup: Beta's parameter of mixup's lam (0: no mixup).
        alpha_cutmix: Beta's parameter of cutmix's lam (0: no cutmix).
        prob: the probability that a batch is mixed.
        switch_prob: the probability of cutmix rather than mixup when both are on.
        label_smoothing: the smoothing of the targets.
        num_classes: K, the width of the target rows.
        seed: the seed of the draws.
        target: "class", "multihot" or "float", as above.
    """

    def __init__(
        self,
        alpha_mixup: float = 0.8,
        alpha_cutmix: float = 1.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
        seed: int = 0,
        target: str = "class",
    ) -> None:
        for name, value in (("alpha_mixup", alpha_mixup), ("alpha_cutmix", alpha_cutmix)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value}: must be >= 0 (0 turns it off)")
        for name, value in (("prob", prob), ("switch_prob", switch_prob), ("label_smoothing", label_smoothing)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}={value}: must be in [0, 1]")
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes={num_classes!r}: must be a positive integer")
        if target not in ("class", "multihot", "float"):
            raise ValueError(f"target={target!r}: use 'class', 'multihot' or 'float'")
        if target == "float" and label_smoothing:
            raise ValueError(
                f"label_smoothing={label_smoothing}: float targets have no classes to smooth towards; use 0"
            )
        self.target = target
        self.alpha_mixup, self.alpha_cutmix = float(alpha_mixup), float(alpha_cutmix)
        self.prob, self.switch_prob = float(prob), float(switch_prob)
        self.label_smoothing, self.num_classes = float(label_smoothing), num_classes
        self.rng = np.random.default_rng(seed)
        self.last: dict = {}

    def targets(self, labels: torch.Tensor, lam: float) -> torch.Tensor:
        """Soft targets for a batch mixed with its reversal at weight ``lam``, smoothed."""
        if self.target != "class":
            rows = labels.float()
            if self.target == "multihot":
                rows = smooth_multihot(rows, self.label_smoothing)
            return lam * rows + (1.0 - lam) * rows.flip(0)
        off = self.label_smoothing / self.num_classes
        on = 1.0 - self.label_smoothing + off
        onehot = torch.full((len(labels), self.num_classes), off, device=labels.device)
        onehot.scatter_(1, labels.view(-1, 1).long(), on)
        return lam * onehot + (1.0 - lam) * onehot.flip(0)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix a batch; returns (images, soft targets). Labels on the CPU are checked against
        ``num_classes`` here; labels on a GPU are not (reading them would stop the GPU every step):
        check them once where they come from (``dali-fast train`` checks the data set's labels)."""
        if self.target != "class":
            if labels.dim() != 2 or labels.shape[1] != self.num_classes or not labels.is_floating_point():
                raise ValueError(
                    f"target={self.target!r} mixes float rows (N, {self.num_classes}), got {labels.dtype} "
                    f"{tuple(labels.shape)}: open the data set with target={self.target!r} (and num_classes)"
                )
        elif labels.dim() != 1 or labels.is_floating_point():  # known from the shape and dtype: no GPU read
            raise ValueError(
                f"target='class' mixes class indices, int64 (N,), got {labels.dtype} {tuple(labels.shape)}: "
                f"for multi-hot or float rows make MixupCutmix(target='multihot' or 'float', num_classes=K)"
            )
        elif labels.device.type == "cpu" and len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels outside 0..{self.num_classes - 1}: set num_classes to the data set's classes")
        use_mixup, use_cutmix = self.alpha_mixup > 0, self.alpha_cutmix > 0
        if not (use_mixup or use_cutmix) or self.rng.random() >= self.prob:
            self.last = {"mode": "none", "lam": 1.0, "box": None}
            return images, self.targets(labels, 1.0)
        cutmix = use_cutmix and (not use_mixup or self.rng.random() < self.switch_prob)
        if not cutmix:
            if not images.is_floating_point():
                raise ValueError("mixup blends images: pass float images (normalize first)")
            lam = float(self.rng.beta(self.alpha_mixup, self.alpha_mixup))
            mixed = images.mul(lam).add_(images.flip(0), alpha=1.0 - lam)
            self.last = {"mode": "mixup", "lam": lam, "box": None}
            return mixed, self.targets(labels, lam)
        h, w = images.shape[-2], images.shape[-1]
        lam = float(self.rng.beta(self.alpha_cutmix, self.alpha_cutmix))
        cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
        cy, cx = int(self.rng.integers(h)), int(self.rng.integers(w))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
        mixed = images.clone()
        mixed[..., y0:y1, x0:x1] = images.flip(0)[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually kept
        self.last = {"mode": "cutmix", "lam": lam, "box": (y0, y1, x0, x1)}
        return mixed, self.targets(labels, lam)


def smooth_multihot(rows: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label smoothing per class of multi-hot rows: each class is its own yes/no target, pulled towards
    1/2 by ``smoothing`` (1 becomes 1 - smoothing/2, 0 becomes smoothing/2), as BCE-with-logits wants."""
    return rows * (1.0 - smoothing) + smoothing / 2 if smoothing else rows


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against soft targets (rows summing to 1), averaged over the batch."""
    return torch.sum(-targets * torch.log_softmax(logits.float(), dim=-1), dim=-1).mean()
