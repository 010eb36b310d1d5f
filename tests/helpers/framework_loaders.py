"""The data set and loaders that the Lightning and Accelerate tests train on, in the test process and in
the processes their launchers start (which put this folder on `sys.path`)."""

from __future__ import annotations

import pytest
from builders import IndexReader, jpeg_bytes

N = 37


def reader() -> IndexReader:
    """``N`` small JPEGs labelled by index."""
    return IndexReader([jpeg_bytes(32 + i % 5, 24 + i % 3) for i in range(N)])


def loader(backend: str, data, batch_size: int = 8, train: bool = True, **kw):
    """A loader of ``backend`` on the CPU at 16 px, seed 1, in this process; skips the test without DALI."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator as cls

        kw.setdefault("num_threads", 2)
    else:
        from dali_fast import TorchIterator as cls

        kw.setdefault("num_workers", 0)
    return cls(data, batch_size, train=train, image_size=16, device="cpu", seed=1, **kw)
