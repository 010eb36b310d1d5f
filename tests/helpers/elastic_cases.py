"""Elastic resume as the tests run it: old ranks in lockstep take a few batches, rank 0's state resumes on
another number of ranks; each sample of the epoch once, equal batch counts, the next epoch plain. And the
local Parquet set those tests read (`write_hf_parquet`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from builders import hf_table
from contract import each_once

from dali_fast.loaders.order.base import kept_global_batch

TRANSITIONS = [(4, 2), (2, 3), (1, 4), (4, 1)]


def loader_maker(backend: str, reader):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return lambda bs, **kw: DALIIterator(reader, bs, image_size=16, device="cpu", seed=4, **kw)
    from dali_fast import TorchIterator

    return lambda bs, **kw: TorchIterator(reader, bs, image_size=16, device="cpu", seed=4, num_workers=0, **kw)


def write_hf_parquet(
    out: Path, images: list[bytes], labels: list[int], names: list[str], files: int, group: int
) -> Path:
    """``images`` and ``labels``, in their order, as ``out/data/train-0000k-of-0000F.parquet``: ``files``
    files of about equal rows, each cut into row groups of ``group`` rows, in the Hugging Face layout
    (``image: struct<bytes, path>``, ``label: int64`` with a ClassLabel of ``names``). Returns ``out``."""
    pq = pytest.importorskip("pyarrow.parquet")
    (out / "data").mkdir(parents=True)
    per = -(-len(images) // files)
    for k in range(files):
        rows = range(k * per, min(len(images), (k + 1) * per))
        table = hf_table([images[i] for i in rows], [labels[i] for i in rows], names)
        pq.write_table(table, out / "data" / f"train-{k:05d}-of-{files:05d}.parquet", row_group_size=group)
    return out


def run_elastic(make, old: int, new: int, labels: np.ndarray, epoch: int = 1, taken: int = 2) -> None:
    """``old`` ranks in lockstep take ``taken`` batches of 3 of ``epoch``; rank 0's state (through JSON, as a
    checkpoint keeps it) resumes on ``new`` ranks: each sample once over the epoch but for the new ranks'
    padding (the old ranks reach theirs only with their last sample), equal batch counts, the labels those
    of the samples named, the global batch kept where it divides; then the next epoch plain."""
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
    assert len(loader.order) > len(before) // old  # a saved state before the old ranks' last places
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
    after = [i for x in rest for i in x]
    assert not set(before) & set(after)  # nothing an old rank had taken comes again
    each_once(before, set(before), what="what the old ranks took")  # none of their padding yet
    each_once(after, set(after), padding=new - 1, what="the rest of the epoch")
    each_once(before + after, range(len(labels)), padding=new - 1)
