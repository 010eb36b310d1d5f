"""The epoch order that streams shards: `StreamingOrder`, with `EpochSampler`'s interface.

For data read shard by shard (remote WebDataset shards, Parquet row groups), each epoch:

1. the shards are shuffled (seeded by ``(seed, epoch)``, the same on every rank) and laid end to end;
2. that sequence is cut into ``world_size`` runs of samples, one per rank, that differ by at most one
   sample (the first ``n % world_size`` ranks one longer), so every rank gets whole shards, except that a
   run's first and last shard may be shared with the neighbouring rank (at most ``world_size - 1``
   shards are split). With ``drop_last`` the runs are equal instead, and the tail is cut;
3. within a rank, the shard shared with the previous rank and the one shared with the next come first
   (ranks of a node that share the cache then use the shard at about the same time), and samples are
   shuffled within windows of ``window`` consecutive shards;
4. with ``even`` (training) and no ``drop_last``, each shorter run is padded with one repeat, dealt last,
   as `EpochSampler` pads (at most ``world_size - 1`` samples twice, each in a rank's last place): the
   sample that rank read just before (still in the cache). So every rank gets the same number of samples
   (and batches), a repeat is reached only with a rank's very last sample, and a state saved before it
   holds none: no resume on any world size delivers twice a sample that the old ranks' padding had
   delivered. ``even=False`` (evaluation) adds no repeat.

So a rank reads ``window`` shards at a time, the order is a pure function of (seed, epoch, rank,
world_size), and each sample comes once per epoch. The cursor is the position in this rank's list, as
for `EpochSampler`. **Elastic resume**: as for `EpochSampler` (`base` has the rule); the samples
no rank had reached are regrouped by shard (each old rank's rest, its blocks in the order it would have
read them) and cut into the new ranks' runs as above, so the new ranks also read whole shards a window at
a time.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from .base import OrderCursor, per_rank
from .random import ranks_for

_WINDOW_SALT = 0x5E9_0D3  # the in-window shuffle's stream, apart from the shard shuffle's


def shard_sequence(bounds: np.ndarray, shard_order: np.ndarray) -> np.ndarray:
    """The sample indices of the shards in ``shard_order``, shard after shard (``bounds``: S+1 starts)."""
    counts = np.diff(bounds)[shard_order]
    starts = bounds[:-1][shard_order]
    first = np.cumsum(counts) - counts  # each shard's first place in the sequence
    return (np.arange(counts.sum()) - np.repeat(first, counts) + np.repeat(starts, counts)).astype(np.int64)


def cut(seq: np.ndarray, world_size: int, rank: int, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s own run of ``seq``, no sample on two ranks: with ``drop_last`` an equal run (the tail
    cut), else runs that differ by at most one (the first ``len(seq) % world_size`` ranks one longer)."""
    n = len(seq)
    if drop_last:
        per = n // world_size
        return seq[rank * per : (rank + 1) * per]
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return seq[start : start + base + (rank < extra)]


def arrange(
    run: np.ndarray, shard_of: np.ndarray, window: int, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """(order, group): ``run``'s shard blocks with the last block moved second, then shuffled within
    windows of ``window`` blocks (``rng`` None: not shuffled); ``group`` is each sample's block rank."""
    if not len(run):
        return run.astype(np.int64), np.empty(0, np.int64)
    shards = shard_of[run]
    starts = np.flatnonzero(np.concatenate([[True], shards[1:] != shards[:-1]]))
    blocks = np.split(run, starts[1:])
    if len(blocks) >= 3:
        blocks = [blocks[0], blocks[-1], *blocks[1:-1]]
    order, group = [], []
    for w in range(0, len(blocks), window):
        part = np.concatenate(blocks[w : w + window])
        ranks = np.concatenate([np.full(len(b), w + k) for k, b in enumerate(blocks[w : w + window])])
        if rng is not None:
            p = rng.permutation(len(part))
            part, ranks = part[p], ranks[p]
        order.append(part)
        group.append(ranks)
    return np.concatenate(order).astype(np.int64), np.concatenate(group)


class StreamingOrder(OrderCursor):
    """`EpochSampler`'s interface (epoch, position, indices, batches, state) over a shard layout.

    ``bounds``: the first sample of each shard and the total (S+1 increasing integers); ``window``: the
    shards whose samples are shuffled together. See the module docstring for the order and the resume.
    """

    kind = "stream"
    _refusal = "the saved state is from the random-access order, this data set streams shards"
    _settings = ("n", "seed", "shuffle", "drop_last", "even", "window", "layout")
    _what = "order"

    def __init__(
        self,
        bounds: np.ndarray | list[int],
        *,
        window: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        even: bool = True,
    ) -> None:
        self.bounds = np.asarray(bounds, dtype=np.int64)
        if self.bounds.ndim != 1 or len(self.bounds) < 2 or self.bounds[0] != 0 or np.any(np.diff(self.bounds) < 0):
            raise ValueError("bounds: the first sample of each shard and the total, starting at 0 and not decreasing")
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1 shard")
        n = int(self.bounds[-1])
        rank, world_size = ranks_for(n, rank, world_size, drop_last)
        super().__init__(
            n, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, drop_last=drop_last, even=even
        )
        self.window = int(window)
        self._shard_of = np.repeat(np.arange(len(self.bounds) - 1), np.diff(self.bounds))
        self.layout = hashlib.sha1(self.bounds.tobytes()).hexdigest()[:16]

    def _rng(self, epoch: int, world: int, rank: int, part: int) -> np.random.Generator | None:
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch, world, rank, part, _WINDOW_SALT])

    def _sequence(self, epoch: int) -> np.ndarray:
        """The epoch's shards, shuffled, laid end to end."""
        shards = len(self.bounds) - 1
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(shards)
        else:
            perm = np.arange(shards)
        return shard_sequence(self.bounds, perm)

    def _arranged(self, seq: np.ndarray, epoch: int, world: int, rank: int, part: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, group) of rank ``rank``: its own run arranged (`arrange`), then, to even it out, its
        padding repeat (in a group after every block's)."""
        run = cut(seq, world, rank, self.drop_last)
        order, group = arrange(run, self._shard_of, self.window, self._rng(epoch, world, rank, part))
        if self.drop_last or not self.even or len(run) == per_rank(len(seq), world, False):
            return order, group
        repeat = order[-1:] if len(order) else seq[(rank - len(seq)) % len(seq) :][:1]  # fewer samples than ranks
        return np.concatenate([order, repeat]), np.concatenate([group, [len(run)]]).astype(np.int64)

    def _deal(self, seq: np.ndarray, epoch: int, world: int, rank: int, part: int) -> np.ndarray:
        return self._arranged(seq, epoch, world, rank, part)[0]

    def _split(
        self, seq: np.ndarray, epoch: int, world: int, position: int, part: int
    ) -> tuple[np.ndarray, np.ndarray]:
        taken, rest = [], []
        for r in range(world):
            order, group = self._arranged(seq, epoch, world, r, part)
            taken.append(order[:position])
            left = np.argsort(group[position:], kind="stable")  # what was not reached, back in shard blocks
            rest.append(order[position:][left])
        return np.concatenate(taken), np.concatenate(rest)  # every part had ranks (world >= 1)

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.kind, **super().state_dict(), "window": self.window, "layout": self.layout}
