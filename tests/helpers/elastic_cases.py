"""Elastic resume as the tests run it: old ranks in lockstep take a few batches, rank 0's state resumes on
another number of ranks; each sample of the epoch once, equal batch counts, the next epoch plain."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from contract import each_once

from dali_fast.loaders.order import kept_global_batch

TRANSITIONS = [(4, 2), (2, 3), (1, 4), (4, 1)]


def loader_maker(backend: str, reader):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return lambda bs, **kw: DALIIterator(reader, bs, image_size=16, device="cpu", seed=4, **kw)
    from dali_fast import TorchIterator

    return lambda bs, **kw: TorchIterator(reader, bs, image_size=16, device="cpu", seed=4, num_workers=0, **kw)


def run_elastic(make, old: int, new: int, labels: np.ndarray, epoch: int = 1, taken: int = 2) -> None:
    """``old`` ranks in lockstep take ``taken`` batches of 3 of ``epoch``; rank 0's state (through JSON, as a
    checkpoint keeps it) resumes on ``new`` ranks: each sample once over the epoch, equal batch counts, the
    labels those of the samples named, the global batch kept where it divides; then the next epoch plain."""
    before = []
    olds = [make(3, rank=r, world_size=old) for r in range(old)]
    for loader in olds:
        loader.set_epoch(epoch)
        it = iter(loader)
        for _ in range(taken):
            _, y = next(it)
            assert y.tolist() == labels[loader.last_indices].tolist()
            before += loader.last_indices.tolist()
        it.close()
        loader.close()
    state = json.loads(json.dumps(olds[0].state_dict()))
    rest, batches = [], []
    for r in range(new):
        loader = make(5, rank=r, world_size=new)
        loader.load_state_dict(state)
        loader.set_epoch(epoch)  # as the loop does: the resumed epoch keeps its place
        assert loader.batch_size == kept_global_batch(3, old, new)
        mine = []
        for _, y in loader:
            assert y.tolist() == labels[loader.last_indices].tolist()
            mine += loader.last_indices.tolist()
        assert len(loader) == math.ceil(len(mine) / loader.batch_size)
        rest.append(mine)
        batches.append(len(loader))
        loader.set_epoch(epoch + 1)
        plain = [i for _ in loader for i in loader.last_indices.tolist()]
        assert plain == make(3, rank=r, world_size=new).order.indices(epoch + 1).tolist()  # the next epoch: plain
        loader.close()
    assert len(set(batches)) == 1 and len({len(x) for x in rest}) == 1  # equal on every new rank
    assert not set(before) & {i for x in rest for i in x}
    each_once(before + [i for x in rest for i in x], range(len(labels)), padding=new - 1)
