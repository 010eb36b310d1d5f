"""Held-out metrics of multi-label training in torch: average precision per class and their mean (mAP)."""

from __future__ import annotations

import math

import torch


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each class's average precision over a set of samples: ``scores`` and ``targets`` are ``(N, K)`` (a
    target above 0.5 is a positive); returns float64 ``(K,)``, NaN for a class without a positive.

    A class's AP is the mean, over its positives, of the precision among the samples ranked at or above
    each one by score, samples of equal score counting as one threshold (scikit-learn's
    ``average_precision_score``, the step-wise area under the precision-recall curve)."""
    if scores.shape != targets.shape or scores.dim() != 2:
        raise ValueError(f"scores {tuple(scores.shape)} and targets {tuple(targets.shape)}: both must be (N, K)")
    n = scores.shape[0]
    if n == 0:
        return torch.full((scores.shape[1],), math.nan, dtype=torch.float64)
    order = scores.double().argsort(dim=0, descending=True, stable=True)
    ranked = scores.double().gather(0, order)
    hits = (targets > 0.5).double().gather(0, order)
    precision = hits.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64, device=scores.device)[:, None]
    last = torch.ones_like(ranked, dtype=torch.bool)
    last[:-1] = ranked[:-1] != ranked[1:]  # the last sample of each run of equal scores
    position = torch.arange(n, device=scores.device)[:, None].expand_as(ranked)
    ends = torch.where(last, position, n).flip(0).cummin(0).values.flip(0)  # each sample's run end
    return (hits * precision.gather(0, ends)).sum(0) / hits.sum(0)  # 0/0: NaN for a class without positives


def mean_average_precision(scores: torch.Tensor, targets: torch.Tensor) -> float:
    """The mean of `average_precision` over the classes that have a positive (NaN when none has)."""
    ap = average_precision(scores, targets)
    has = ~torch.isnan(ap)
    return float(ap[has].mean()) if bool(has.any()) else math.nan
