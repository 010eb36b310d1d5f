"""The random-access epoch order: `EpochSampler`, a seeded shuffle of every record per epoch, dealt to the
ranks (`base.OrderCursor` has the dealing, the cursor and the elastic resume). numpy only."""

from __future__ import annotations

import numpy as np

from ..sampler import dist_rank_world
from .base import OrderCursor, per_rank


def ranks_for(n: int, rank: int | None, world_size: int | None, drop_last: bool) -> tuple[int, int]:
    """(rank, world size) of an order over ``n`` samples (`dist_rank_world`), refused in one line when
    ``drop_last`` would leave a rank without a sample."""
    rank, world_size = dist_rank_world(rank, world_size)
    if drop_last and n < world_size:
        raise ValueError(
            f"{n} samples cannot give each of {world_size} ranks one with drop_last=True; "
            "use drop_last=False or fewer ranks"
        )
    return rank, world_size


class EpochSampler(OrderCursor):
    """The order of one rank's samples for each epoch, and a cursor into it.

    The epoch's order is a permutation drawn from ``(seed, epoch)``, the same on every rank; rank ``r``
    takes every ``world_size``-th sample from position ``r``. Shards are disjoint. With ``even`` (the
    default; what training needs, so that DDP's ranks take the same number of steps) they are of equal
    length: without ``drop_last`` the permutation is padded by wrapping around to its first samples (at most
    ``world_size - 1`` samples appear twice in the epoch, as with torch's DistributedSampler); with
    ``drop_last`` the tail is cut instead. With ``even=False`` (evaluation) and no ``drop_last``, no sample
    is repeated: each is on exactly one rank, and the first ``n % world_size`` ranks have one more.

    A state saved by one rank of a lockstep run loads with another world size: each sample no rank had
    reached then comes once (`loaders.order` has the rule).

    Args:
        n: samples in the data set.
        seed: seeds the permutation, with the epoch.
        shuffle: permute (else the data set's order).
        rank: this rank (default: the process group's, see `dist_rank_world`).
        world_size: the number of ranks (default: the process group's).
        drop_last: cut the tail so that every rank has ``n // world_size`` samples.
        even: without ``drop_last``, give every rank the same count by padding; False: no repeats.

    >>> s = EpochSampler(10, seed=0, rank=1, world_size=2)
    >>> s.set_epoch(3); first = s.next_batch(4); rest = s.next_batch(100)
    >>> sorted(first.tolist() + rest.tolist()) == sorted(s.indices().tolist())
    True
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        even: bool = True,
    ) -> None:
        if n < 0:
            raise ValueError(f"n={n}: the number of samples must be >= 0")
        rank, world_size = ranks_for(n, rank, world_size, drop_last)
        super().__init__(
            n, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, drop_last=drop_last, even=even
        )

    def _sequence(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return np.arange(self.n)

    def _laid(self, seq: np.ndarray, world: int) -> np.ndarray:
        """``seq`` as the places ``world`` ranks take in turn: equal runs (the tail cut, or padded by
        wrapping around to its start), or as it is (``even=False``)."""
        if self.drop_last or self.even:
            return np.resize(seq, per_rank(len(seq), world, self.drop_last) * world)
        return seq

    def _deal(self, seq: np.ndarray, epoch: int, world: int, rank: int, part: int) -> np.ndarray:
        return self._laid(seq, world)[rank::world]

    def _split(
        self, seq: np.ndarray, epoch: int, world: int, position: int, part: int
    ) -> tuple[np.ndarray, np.ndarray]:
        laid = self._laid(seq, world)  # each rank at `position`: the first `position` rows of places taken
        return laid[: position * world], laid[position * world :]


# pragma: no mutate block (the sampler view of a loader: tested through the loaders)
