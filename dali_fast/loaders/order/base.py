"""What every epoch order shares (`OrderCursor`): dealing to ranks, the cursor, the elastic resume. numpy only.

The random-access order (`sampler.EpochSampler`) and the shard-streaming one (`shard_order.StreamingOrder`)
are its subclasses: each says how it orders an epoch and deals it to ranks; the rest lives here, once.

**Elastic resume, the one rule.** In a lockstep run (DDP) every rank has yielded the same number of
batches of the same size, so after ``p`` samples each, the ranks have together consumed the first ``p``
of each of the ``W`` ranks' orders, a pure function of (seed, epoch, ``W``): the state any one rank saves
(rank 0's, in practice) says what the whole job consumed. A ``position`` counts samples *yielded*
(prefetched ones are not consumed). Loaded with ``W' != W`` ranks (and any batch size), the rest of the
epoch is every later entry of the ``W`` orders, without the consumed samples and each sample once, dealt
to the ``W'`` ranks as an epoch is dealt: equal runs, padded by wrapping around (at most ``W' - 1``
repeats) or, with ``drop_last``, the tail cut. So:

- without ``drop_last``, every sample of the data set comes exactly once in the epoch, consumed before or
  dealt after, but for the new ranks' padding. The old ranks' padding repeats never count twice: a repeat
  of a consumed sample is dropped, and a sample no old rank reached comes once whatever its repeats;
- with ``drop_last``, every sample comes at most once: the tail the old world's epoch had cut (fewer than
  ``W`` samples) stays out, and the new ranks cut fewer than ``W'`` of what remains;
- with uneven shares (``even=False``, evaluation: no padding) the rule holds for rank 0's state (the
  longest share): a rank whose share ended before ``p`` had consumed all of it.

The state keeps each resize's (``W``, ``p``) in ``history`` until the epoch ends, so a job can change size
again mid-epoch; the next epoch is the plain order for the new world size. A data set of any kind resumes
this way: the order depends only on its length (and, for streamed shards, the shard bounds).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def per_rank(n: int, world_size: int, drop_last: bool) -> int:
    """Samples each of ``world_size`` ranks gets of ``n`` in equal shares: the tail cut (``drop_last``) or
    padded with repeats."""
    return n // world_size if drop_last else math.ceil(n / world_size)


def share(n: int, world_size: int, rank: int, drop_last: bool, even: bool) -> int:
    """Samples rank ``rank`` of ``world_size`` gets of ``n``: an equal share (`per_rank`) with ``drop_last``
    or ``even``; else its own, each sample on one rank only (the first ``n % world_size`` ranks get one more)."""
    if drop_last or even:
        return per_rank(n, world_size, drop_last)
    return n // world_size + (rank < n % world_size)


def kept_global_batch(batch_size: int, saved_world: int, world_size: int) -> int:
    """The per-rank batch size on ``world_size`` ranks that keeps the global batch of ``batch_size`` on
    ``saved_world`` ranks, when it divides evenly; else ``batch_size`` (the per-rank size is kept). Logs
    what it chose, in one line."""
    total = batch_size * saved_world
    kept = total // world_size if total % world_size == 0 else batch_size
    log.info(
        "loader: resumed with ranks %d → %d: batch size %d → %d per rank, a global batch of %d (was %d)",
        *(saved_world, world_size, batch_size, kept, kept * world_size, total),
    )
    return kept


def unreached(taken: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """``rest`` without the samples in ``taken``, each sample once (where it first comes), in its order."""
    rest = rest[~np.isin(rest, taken)]
    _, first = np.unique(rest, return_index=True)
    return rest[np.sort(first)]


def check_same_settings(state: dict, order: Any, keys: Sequence[str], what: str) -> None:
    """A saved order state must have ``order``'s value for each of ``keys`` it holds; else one line."""
    for key in keys:
        if key in state and state[key] != getattr(order, key):
            raise ValueError(
                f"cannot resume: the saved state has {key}={state[key]} but this {what} has "
                f"{key}={getattr(order, key)}; resume with the same data set and settings"
            )


class OrderCursor:
    """An epoch's order over ``n`` samples dealt to ranks, a cursor into this rank's part, and the elastic
    resume (the module docstring has the rule): what `EpochSampler` and `StreamingOrder` share.

    A subclass writes three methods of the order itself: ``_sequence(epoch)``, the epoch's samples in
    order; ``_deal(seq, epoch, world, rank, part)``, rank ``rank``'s order of ``seq`` when ``world`` ranks
    share it (``part``: how many elastic resumes came before in the epoch); and ``_split(seq, epoch, world,
    position, part)``, the samples those ranks had taken when each was at ``position``, and every later
    entry of their orders (repeats included), in the order the rest of the epoch is dealt again.
    ``position`` counts this rank's samples already taken; ``history`` holds the (world size, position) of
    the earlier parts of the current epoch.
    """

    kind = "random"  # what a state says its order is ("order"; a state without it is of this kind)
    _refusal = "the saved state is from the streaming order, this data set is read by random access"
    _settings: tuple[str, ...] = ("n", "seed", "shuffle", "drop_last", "even")
    _what = "sampler"

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        drop_last: bool,
        even: bool,
    ) -> None:
        self.n = int(n)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.rank, self.world_size = int(rank), int(world_size)
        self.drop_last = bool(drop_last)
        self.even = bool(even)
        self.epoch = 0
        self.position = 0
        self.history: list[tuple[int, int]] = []  # (world_size, position) of earlier parts of this epoch
        self._cache: dict[tuple, np.ndarray] = {}  # dealt orders: a few epochs (the current, the next...)

    # ------------------------------------------------------------------ what a subclass writes
    def _sequence(self, epoch: int) -> np.ndarray:
        raise NotImplementedError

    def _deal(self, seq: np.ndarray, epoch: int, world: int, rank: int, part: int) -> np.ndarray:
        raise NotImplementedError

    def _split(
        self, seq: np.ndarray, epoch: int, world: int, position: int, part: int
    ) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    # ------------------------------------------------------------------ the order
    def _part(self, epoch: int, history: Sequence[tuple[int, int]]) -> np.ndarray:
        """The samples the current part of ``epoch`` deals to its ranks, once the earlier parts in
        ``history`` took what their ranks had reached."""
        seq = self._sequence(epoch)
        for part, (world, position) in enumerate(history):
            seq = unreached(*self._split(seq, epoch, world, position, part))
        return seq

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's samples for ``epoch`` (default: the current one, continuing its history), as int64."""
        current = epoch is None or int(epoch) == self.epoch
        epoch = self.epoch if epoch is None else int(epoch)
        history = tuple(self.history) if current else ()
        key = (epoch, history, self.rank, self.world_size)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        seq = self._part(epoch, history)
        out = self._deal(seq, epoch, self.world_size, self.rank, len(history))
        if len(self._cache) >= 4:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = out
        return out

    def _length(self, epoch: int, history: Sequence[tuple[int, int]], world: int, rank: int) -> int:
        """Samples rank ``rank`` of ``world`` gets in the part of ``epoch`` after ``history``."""
        return share(len(self._part(epoch, history)), world, rank, self.drop_last, self.even)

    def __len__(self) -> int:
        """Samples of the current epoch (its part since an elastic resume) on this rank."""
        if not self.history:
            return share(self.n, self.world_size, self.rank, self.drop_last, self.even)
        return len(self.indices())

    # ------------------------------------------------------------------ the cursor
    def remaining(self) -> int:
        return len(self) - self.position

    def next_batch(self, batch_size: int) -> np.ndarray:
        """The next ``batch_size`` (or fewer, at the end) indices; empty when the epoch is done."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        shard = self.indices()
        out = shard[self.position : self.position + batch_size]
        self.position += len(out)
        return out

    def batches(self, batch_size: int, drop_last: bool = False) -> list[np.ndarray]:
        """The rest of the epoch cut into batches (consumes the cursor)."""
        out = []
        while self.remaining() > 0:
            if drop_last and self.remaining() < batch_size:
                self.position = len(self)
                break
            out.append(self.next_batch(batch_size))
        return out

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s order and put the cursor at its start (the plain order for this world size)."""
        self.epoch = int(epoch)
        self.position = 0
        self.history = []

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "history": [list(h) for h in self.history],
            "seed": self.seed,
            "n": self.n,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "even": self.even,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``, with this world size: the same one continues at the saved position;
        another one takes, each once, the samples of the epoch that no rank had reached (the module
        docstring has the rule)."""
        if state.get("order", "random") != self.kind:
            raise ValueError(f"cannot resume: {self._refusal}; resume with the data set it was saved with")
        check_same_settings(state, self, self._settings, self._what)
        epoch, position = int(state["epoch"]), int(state["position"])
        history = [(int(w), int(p)) for w, p in state.get("history", [])]
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world == self.world_size:
            length = self._length(epoch, history, self.world_size, self.rank)
            if not 0 <= position <= length:
                raise ValueError(f"cannot resume: position {position} is outside this epoch's {length} samples")
            self.epoch, self.history, self.position = epoch, history, position
            return
        length = self._length(epoch, history, saved_world, int(state.get("rank", 0)))
        if not 0 <= position <= length:
            raise ValueError(f"cannot resume: position {position} is outside that epoch's {length} samples")
        self.epoch, self.history, self.position = epoch, [*history, (saved_world, position)], 0
