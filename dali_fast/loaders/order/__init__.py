"""The epoch orders: which of this rank's samples come when, each epoch, and where a saved position
resumes, on this world size or another. `make_order` picks a data set's.

- ``base``: what every order shares (`OrderCursor`): dealing to ranks, the cursor, the elastic resume;
- ``random``: the random-access order (`EpochSampler`): a seeded shuffle of every record per epoch;
- ``streaming``: the order that streams shards (`StreamingOrder`): shards shuffled, samples within
  windows of shards, each rank a run of whole shards.
"""

from __future__ import annotations

from ...data.base import StreamingReader, provides
from .base import OrderCursor
from .random import EpochSampler
from .streaming import StreamingOrder

__all__ = ["EpochSampler", "OrderCursor", "StreamingOrder", "make_order"]


def make_order(
    dataset: object, *, seed: int, shuffle: bool, rank: int, world_size: int, drop_last: bool, even: bool = True
) -> EpochSampler | StreamingOrder:
    """The order a loader uses over ``dataset``: `StreamingOrder` for a reader that streams shards (a
    `StreamingReader` whose ``streaming`` is true), else the random-access `EpochSampler`."""
    if provides(dataset, StreamingReader) and dataset.streaming:  # type: ignore[attr-defined]
        return StreamingOrder(
            dataset.shard_bounds,  # type: ignore[attr-defined]
            window=int(dataset.shuffle_window),  # type: ignore[attr-defined]
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            even=even,
        )
    return EpochSampler(
        len(dataset),  # type: ignore[arg-type]
        seed=seed,
        shuffle=shuffle,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        even=even,
    )
