"""What a batch yields beside its images: its labels, or the reader's target rows of the records it holds.

A data set opened with ``target="multihot"`` or ``"float"`` (`data.targets`) has a row per record; each
backend knows which records a batch's images are (`TorchIterator`'s workers send their indices back,
`DALIIterator`'s feed keeps them), so the rows are made once per batch from those indices, in the main
process: nothing per sample crosses a process boundary, and a resume gives the same rows as the images.
"""

from __future__ import annotations

from typing import Any

import torch


def batch_targets(targets: Any, indices: Any, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` (int64) when ``targets`` is None (class targets), else the float32 rows of ``indices`` (the
    records the batch's images are, in order), on ``labels``' device."""
    if targets is None:
        return labels
    return torch.from_numpy(targets.rows(indices)).to(labels.device)
