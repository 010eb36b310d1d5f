"""What a batch yields beside its images: its labels, or the reader's target rows of the records it holds,
and their copy to the images' device.

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


def to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``rows`` (labels or target rows, on the CPU) on ``device``. To a GPU through page-locked memory, so
    the copy is asynchronous: from pageable memory a ``non_blocking`` copy is staged by the host and waits.
    torch's pinned-memory pool keeps the page-locked copy until the transfer has finished."""
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)
