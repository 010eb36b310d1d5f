"""The preemption fuzz's checks: what a run that was killed and resumed must have delivered, epoch by epoch,
by the rules of docs/distributed.md and `dali_fast.loaders.order` (pure functions over the runs' logs).

A trial is a list of generations (`Gen`): processes of one world size that ran until killed, the last one to
the end. A generation resumed from a commit point (the checkpoint every rank had saved) and committed up to
another; what it delivered after its commit was lost work, which the next one delivers again. Per epoch:

- **lost**: samples never delivered (without ``drop_last``: none; with it, at most what the tails cut:
  fewer than the world size per part of the epoch, and fewer than a batch per rank at its end);
- **repeated**: deliveries beyond the padding the docs allow: each part of the epoch (a run of one world
  size) pads its ``m`` remaining samples to ``ceil(m / W) * W``, and its padding is reached only by a part
  that ran to its end (the last part, or one that left nothing); none with ``drop_last`` or ``even=False``;
- **order**: where the epoch ran on one world size throughout, each rank's deliveries are exactly the
  uninterrupted order (with ``drop_last``, that order without the last incomplete batch);
- **replay**: a generation on the same world size as the one before it delivers again exactly what that one
  had delivered after its commit point (the lost work), in the same order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

END = 1 << 40  # the key of an epoch's end: after every batch of it

Key = tuple[int, int]  # (epoch, batch key): a place in a run, ordered


@dataclass
class Gen:
    """One generation: its world size, what each rank delivered ((key, sample ids) in order), where it
    started (``start``: the commit point it resumed from, None when fresh) and the point every rank had
    saved when it ended (``commit``; None: nothing past ``start``; the last generation: `END` of the last
    epoch). ``batches``: each epoch's batch size, else ``batch`` (a bound of what ``drop_last`` leaves out)."""

    world: int
    delivered: dict[int, list[tuple[Key, list[int]]]] = field(default_factory=dict)
    start: Key | None = None
    commit: Key | None = None
    batches: dict[int, int] = field(default_factory=dict)  # epoch -> the batch size of its passes
    batch: int = 1  # the batch size of an epoch it ran without a batch in its logs (a pass left with none)

    def committed(self, rank: int) -> list[tuple[Key, list[int]]]:
        top = self.commit if self.commit is not None else self.start
        return [(k, ids) for k, ids in self.delivered.get(rank, []) if top is not None and k <= top]

    def lost_work(self, rank: int) -> list[tuple[Key, list[int]]]:
        top = self.commit if self.commit is not None else self.start
        return [(k, ids) for k, ids in self.delivered.get(rank, []) if top is None or k > top]


@dataclass
class Verdict:
    lost: int = 0
    repeated: int = 0
    order: int = 0
    replay: int = 0
    notes: list[str] = field(default_factory=list)
    orders_checked: int = 0  # (epoch, rank) sequences compared with the uninterrupted order
    replays_checked: int = 0  # (epoch, rank) runs of lost work compared with what came again

    def add(self, other: Verdict) -> None:
        self.lost += other.lost
        self.repeated += other.repeated
        self.order += other.order
        self.replay += other.replay
        self.notes += other.notes
        self.orders_checked += other.orders_checked
        self.replays_checked += other.replays_checked

    @property
    def ok(self) -> bool:
        return not (self.lost or self.repeated or self.order or self.replay)


def _epoch_parts(gens: Sequence[Gen], epoch: int) -> list[tuple[int, list[int], list[list[int]]]]:
    """The parts of ``epoch``: (world size, every id delivered in it, each rank's ids in order), one per run
    of generations of one world size that committed something in the epoch."""
    parts: list[tuple[int, list[int], list[list[int]]]] = []
    for g in gens:
        mine = {r: [i for k, ids in g.committed(r) if k[0] == epoch for i in ids] for r in range(g.world)}
        if not any(mine.values()):
            continue
        if parts and parts[-1][0] == g.world:
            world, ids, ranks = parts[-1]
            parts[-1] = (
                world,
                ids + [i for r in range(world) for i in mine[r]],
                [ranks[r] + mine[r] for r in range(world)],
            )
        else:
            parts.append((g.world, [i for r in range(g.world) for i in mine[r]], [mine[r] for r in range(g.world)]))
    return parts


def _ran(gens: Sequence[Gen], epoch: int) -> list[Gen]:
    """The generations that ran part of ``epoch`` and kept it (resumed before its end, committed past where
    they resumed and past its start), in order, deliveries or none: a rest smaller than a rank's batch
    delivers nothing with ``drop_last``, but its world size still cut the epoch."""
    return [
        g
        for g in gens
        if g.commit is not None and g.commit != g.start and g.commit >= (epoch, 0)
        and (g.start is None or g.start < (epoch, END))
    ]  # fmt: skip


def check_epoch(
    gens: Sequence[Gen],
    epoch: int,
    universe: Sequence[int],
    order: Callable[[int, int, int], list[int]],
    *,
    drop_last: bool,
    even: bool,
) -> Verdict:
    """The checks of one epoch (the module docstring): ``universe`` the ids the epoch covers, ``order(world,
    rank, epoch)`` the uninterrupted order of a rank."""
    v = Verdict()
    parts = _epoch_parts(gens, epoch)
    n = len(universe)
    seen = Counter(i for _, ids, _ in parts for i in ids)
    foreign = set(seen) - set(universe)
    if foreign:
        v.repeated += len(foreign)
        v.notes.append(f"epoch {epoch}: {len(foreign)} ids outside the data set, e.g. {sorted(foreign)[:4]}")
    missing = n - len(set(seen) & set(universe))
    extra = sum(seen.values()) - len(seen)
    ran = _ran(gens, epoch)
    worlds = [w for k, w in enumerate(g.world for g in ran) if k == 0 or w != ran[k - 1].world]
    last = ran[-1] if ran else None
    batch = last.batches.get(epoch, last.batch) if last is not None else 1
    if drop_last:  # each world size cuts a tail under it, and the last pass a batch under its size per rank
        bound = sum(w - 1 for w in worlds) + (last.world * (batch - 1) if last is not None else n)
        v.lost = max(0, missing - bound)
        v.repeated += extra
    else:
        allowed, left, consumed = 0, n, set()
        for i, (w, ids, _) in enumerate(parts):
            padding = math.ceil(left / w) * w - left if even else 0
            consumed |= set(ids)
            after = n - len(consumed & set(universe))
            if i == len(parts) - 1 or after == 0:
                allowed += padding
            left = after
        v.lost = missing
        v.repeated += max(0, extra - allowed)
    if v.lost or v.repeated:
        v.notes.append(
            f"epoch {epoch}: {missing} missing, {extra} repeats ({v.repeated} beyond the padding) over parts of "
            f"{[w for w, _, _ in parts]} ranks"
        )
    if len(parts) == 1 and len(worlds) == 1:  # one world size throughout: the uninterrupted order
        world, _, ranks = parts[0]
        for r in range(world):
            want = order(world, r, epoch)
            got = ranks[r]
            ok = got == want if not drop_last else (got == want[: len(got)] and 0 <= len(want) - len(got) < batch)
            v.orders_checked += 1
            if not ok:
                v.order += 1
                v.notes.append(f"epoch {epoch} rank {r} of {world}: {got[:12]}... not the order {want[:12]}...")
    return v


def check_replay(gens: Sequence[Gen]) -> Verdict:
    """Each generation on the world size of the one before it delivers again, epoch by epoch, what that one
    had delivered after its commit point."""
    v = Verdict()
    for before, after in zip(gens, gens[1:], strict=False):
        if before.world != after.world:
            continue
        for r in range(before.world):
            lost, again = _by_epoch(before.lost_work(r)), _by_epoch(after.delivered.get(r, []))
            for epoch, ids in lost.items():
                redo = again.get(epoch, [])
                k = min(len(ids), len(redo))
                v.replays_checked += k > 0
                if ids[:k] != redo[:k]:
                    v.replay += 1
                    v.notes.append(f"replay of epoch {epoch} rank {r}: {ids[:8]}... then {redo[:8]}...")
    return v


def _by_epoch(entries: list[tuple[Key, list[int]]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for (epoch, _), ids in entries:
        out.setdefault(epoch, []).extend(ids)
    return out


def check_trial(
    gens: Sequence[Gen],
    epochs: int,
    universe: Sequence[int],
    order: Callable[[int, int, int], list[int]],
    *,
    drop_last: bool,
    even: bool,
) -> Verdict:
    """Every epoch's checks, and the replays."""
    v = Verdict()
    for epoch in range(epochs):
        v.add(check_epoch(gens, epoch, universe, order, drop_last=drop_last, even=even))
    v.add(check_replay(gens))
    return v
