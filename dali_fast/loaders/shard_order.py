"""The epoch order that streams shards: `StreamingOrder`, with `EpochSampler`'s interface. numpy only.

For data read shard by shard (remote WebDataset shards), each epoch:

1. the shards are shuffled (seeded by ``(seed, epoch)``, the same on every rank) and laid end to end;
2. that sequence is cut into ``world_size`` equal runs of samples, one per rank, so every rank gets the
   same number of samples (and batches) and whole shards, except that a run's first and last shard
   may be shared with the neighbouring rank (at most ``world_size - 1`` shards are split). Without
   ``drop_last`` the last rank's run is padded with repeats of its own last samples (as
   `EpochSampler` pads: at most ``world_size - 1`` samples twice); with it, the tail is cut;
3. within a rank, the shard shared with the previous rank and the one shared with the next come first
   (ranks of a node that share the cache then use the shard at about the same time), and samples are
   shuffled within windows of ``window`` consecutive shards.

So a rank reads ``window`` shards at a time, the order is a pure function of (seed, epoch, rank,
world_size), and each sample comes once per epoch. The cursor is the position in this rank's list, as
for `EpochSampler`. **Elastic resume**: a state saved at position ``p`` with ``W`` ranks can be loaded
with another world size ``W'``. The samples the ``W`` ranks had not reached (computed, since the order
is a pure function) are regrouped by shard and cut into ``W'`` equal runs as above; each remaining
sample of the epoch then comes exactly once. The state keeps that history until the epoch ends.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..data.base import StreamingReader, provides
from .sampler import EpochSampler, OrderCursor, check_same_settings, per_rank, ranks_for

_WINDOW_SALT = 0x5E9_0D3  # the in-window shuffle's stream, apart from the shard shuffle's


def shard_sequence(bounds: np.ndarray, shard_order: np.ndarray) -> np.ndarray:
    """The sample indices of the shards in ``shard_order``, shard after shard (``bounds``: S+1 starts)."""
    counts = np.diff(bounds)[shard_order]
    starts = bounds[:-1][shard_order]
    first = np.cumsum(counts) - counts  # each shard's first place in the sequence
    return (np.arange(counts.sum()) - np.repeat(first, counts) + np.repeat(starts, counts)).astype(np.int64)


def cut(seq: np.ndarray, world_size: int, rank: int, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s equal run of ``seq`` (padded with the sequence's own last samples, or cut)."""
    n = len(seq)
    per = per_rank(n, world_size, drop_last)
    total = per * world_size
    if total > n:
        seq = np.concatenate([seq, seq[(n - 1 - np.arange(total - n)) % n]])
    return seq[rank * per : (rank + 1) * per]


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
    ) -> None:
        self.bounds = np.asarray(bounds, dtype=np.int64)
        if self.bounds.ndim != 1 or len(self.bounds) < 2 or self.bounds[0] != 0 or np.any(np.diff(self.bounds) < 0):
            raise ValueError("bounds: the first sample of each shard and the total, starting at 0 and not decreasing")
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1 shard")
        self.n = int(self.bounds[-1])
        self.window = int(window)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.rank, self.world_size = ranks_for(self.n, rank, world_size, drop_last)
        self.drop_last = bool(drop_last)
        self._shard_of = np.repeat(np.arange(len(self.bounds) - 1), np.diff(self.bounds))
        self.layout = hashlib.sha1(self.bounds.tobytes()).hexdigest()[:16]
        self.epoch = 0
        self.position = 0
        self.history: list[tuple[int, int]] = []  # (world_size, position) of earlier parts of this epoch
        self._cache: dict[tuple, np.ndarray] = {}

    # ------------------------------------------------------------------ the order
    def _rng(self, epoch: int, world: int, rank: int, part: int) -> np.random.Generator | None:
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch, world, rank, part, _WINDOW_SALT])

    def _runs(self, epoch: int, history: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        """(the sequence the current part of ``epoch`` cuts into ranks, the part's number), after the
        earlier parts in ``history`` took what their ranks had reached."""
        shards = len(self.bounds) - 1
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(shards)
        else:
            perm = np.arange(shards)
        seq = shard_sequence(self.bounds, perm)
        for part, (w, p) in enumerate(history):
            taken, rest = [], []
            for r in range(w):
                order, group = arrange(
                    cut(seq, w, r, self.drop_last), self._shard_of, self.window, self._rng(epoch, w, r, part)
                )
                taken.append(order[:p])
                left = np.argsort(group[p:], kind="stable")  # what was not reached, back in shard blocks
                rest.append(order[p:][left])
            rest_all = np.concatenate(rest)  # every part had ranks (w >= 1)
            rest_all = rest_all[~np.isin(rest_all, np.concatenate(taken))]
            _, first = np.unique(rest_all, return_index=True)  # padding repeats: each sample once
            seq = rest_all[np.sort(first)]
        return seq, len(history)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's samples for ``epoch`` (default: the current one, continuing its history), as int64."""
        current = epoch is None or int(epoch) == self.epoch
        epoch = self.epoch if epoch is None else int(epoch)
        history = self.history if current else []
        key = (epoch, tuple(history), self.rank, self.world_size)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        seq, part = self._runs(epoch, history)
        if len(seq) < self.world_size and self.drop_last:
            out = np.empty(0, np.int64)
        else:
            run = cut(seq, self.world_size, self.rank, self.drop_last)
            out, _ = arrange(run, self._shard_of, self.window, self._rng(epoch, self.world_size, self.rank, part))
        if len(self._cache) >= 4:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = out
        return out

    # ------------------------------------------------------------------ EpochSampler's interface
    def __len__(self) -> int:
        """Samples of the current epoch (its part since an elastic resume) on this rank."""
        if not self.history:
            return per_rank(self.n, self.world_size, self.drop_last)
        return len(self.indices())

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.position = 0
        self.history = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "order": self.kind,
            "epoch": self.epoch,
            "position": self.position,
            "history": [list(h) for h in self.history],
            "seed": self.seed,
            "n": self.n,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "window": self.window,
            "layout": self.layout,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``, with this world size: the same one continues at the saved position;
        another one takes, exactly once, the samples of the epoch that no rank had reached."""
        if state.get("order") != self.kind:
            raise ValueError(
                "cannot resume: the saved state is from the random-access order, this data set streams shards; "
                "resume with the data set it was saved with"
            )
        check_same_settings(state, self, ("n", "seed", "shuffle", "drop_last", "window", "layout"), "order")
        history = [(int(w), int(p)) for w, p in state.get("history", [])]
        position = int(state["position"])
        saved_world = int(state.get("world_size", self.world_size))
        self.epoch = int(state["epoch"])
        if saved_world == self.world_size:
            self.history = history
            if not 0 <= position <= len(self):
                raise ValueError(f"cannot resume: position {position} is outside this epoch's {len(self)} samples")
            self.position = position
            return
        saved_len = per_rank(len(self._runs(self.epoch, history)[0]), saved_world, self.drop_last)
        if not 0 <= position <= saved_len:
            raise ValueError(f"cannot resume: position {position} is outside that epoch's {saved_len} samples")
        self.history, self.position = [*history, (saved_world, position)], 0


def make_order(
    dataset: object, *, seed: int, shuffle: bool, rank: int, world_size: int, drop_last: bool
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
        )
    return EpochSampler(len(dataset), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, drop_last=drop_last)  # type: ignore[arg-type]
