"""Loaders of either backend on the CPU, and what tests read from them: an epoch's labels, the state
after some batches, a reader with bad records."""

from __future__ import annotations

import numpy as np
import pytest
from builders import IndexReader, jpeg_bytes


def loader_class(backend):
    """The loader class of ``backend`` ("dali" or "torch"); skips the test without DALI."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return DALIIterator
    from dali_fast import TorchIterator

    return TorchIterator


def epoch_labels(loader, epoch=None, limit=None):
    """The labels of a pass (of ``epoch`` if given, else the loader's next) and its batch sizes; ``limit`` batches at most."""
    if epoch is not None:
        loader.set_epoch(epoch)
    out, sizes = [], []
    for k, (images, labels) in enumerate(loader):
        assert images.shape[0] == labels.shape[0]
        out += labels.tolist()
        sizes.append(len(labels))
        if limit is not None and k + 1 >= limit:
            break
    return out, sizes


def take_then_save(loader, batches):
    """Labels of the first ``batches`` batches of the current epoch, then the loader's state."""
    seen = []
    for k, (_, labels) in enumerate(loader):
        seen += labels.tolist()
        if k + 1 == batches:
            return seen, loader.state_dict()
    raise AssertionError(f"the epoch had fewer than {batches} batches")


def bad_reader(reversed_labels: bool = False):
    """Ten JPEGs labelled by index (or 9 - index), of which 2 (truncated), 5 (random bytes) and 7 (empty) are
    bad."""
    good = [jpeg_bytes(32, 24, (i * 20, 100, 50)) for i in range(10)]
    items = list(good)
    items[2] = good[2][: len(good[2]) // 2]  # truncated JPEG
    items[5] = bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8))  # random bytes
    items[7] = b""  # empty record
    return IndexReader(items, reversed_labels=reversed_labels)


def loader(backend, reader, batch_size=8, **kw):
    """A loader of ``backend`` on the CPU, in-process (no worker pool), seed 1 unless given."""
    from dali_fast import DALIIterator, TorchIterator

    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        return DALIIterator(reader, batch_size, device="cpu", num_threads=1, **{"seed": 1, **kw})
    return TorchIterator(reader, batch_size, device="cpu", num_workers=0, **{"seed": 1, **kw})


def fresh_sampler_state(**kw):
    """A new loader's sampler state (seed 4, the 37 records of `index_reader`), with ``kw`` changed."""
    return {
        "epoch": 0,
        "position": 0,
        "seed": 4,
        "n": 37,
        "rank": 0,
        "world_size": 1,
        "shuffle": True,
        "drop_last": False,
        "even": True,
        "history": [],
        **kw,
    }
