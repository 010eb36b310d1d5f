"""The streaming epoch order: whole shards per rank, shuffle windows, exactly once, resume (also elastic)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import IndexReader

from dali_fast.loaders.sampler import EpochSampler
from dali_fast.loaders.shard_order import StreamingOrder, make_order

# 9 shards of uneven sizes (the last one short, as WebDataset writers leave it): 71 samples.
COUNTS = [8, 8, 8, 8, 8, 8, 8, 8, 7]
BOUNDS = np.concatenate([[0], np.cumsum(COUNTS)])
N = int(BOUNDS[-1])
SHARD_OF = np.repeat(np.arange(len(COUNTS)), COUNTS)


def orders(world: int, epoch: int = 0, **kw) -> list[np.ndarray]:
    out = []
    for r in range(world):
        o = StreamingOrder(BOUNDS, rank=r, world_size=world, **kw)
        o.set_epoch(epoch)
        out.append(o.indices())
    return out


def max_open_shards(order: np.ndarray) -> int:
    """The most shards a reader of ``order`` has begun and not finished at any point."""
    last = {s: i for i, s in enumerate(SHARD_OF[order])}
    opened, most = set(), 0
    for i, s in enumerate(SHARD_OF[order]):
        opened.add(s)
        most = max(most, len(opened))
        if last[s] == i:
            opened.discard(s)
    return most


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_runs_covering_every_sample_once(world, drop_last):
    for epoch in (0, 1, 5):
        got = orders(world, epoch, seed=3, drop_last=drop_last)
        per = N // world if drop_last else -(-N // world)
        assert [len(o) for o in got] == [per] * world  # equal batches on every rank: DDP cannot hang
        seen = Counter(np.concatenate(got).tolist())
        if drop_last:
            assert max(seen.values()) == 1 and len(seen) == per * world  # only the tail is left out
        else:
            assert set(seen) == set(range(N))  # every sample, and repeats only as padding
            assert sum(seen.values()) - N == per * world - N and max(seen.values()) <= 2


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_reads_whole_shards_a_window_at_a_time(world):
    for window in (1, 2, 3):
        got = orders(world, 2, seed=1, window=window)
        shards = [set(SHARD_OF[o].tolist()) for o in got]
        shared = [s for s in range(len(COUNTS)) if sum(s in x for x in shards) > 1]
        assert len(shared) <= world - 1  # only runs' ends split a shard
        for o in got:
            assert max_open_shards(o) <= window  # what a rank must hold in the cache at once


def test_order_is_a_pure_function_of_seed_epoch_rank_and_world():
    assert all(np.array_equal(a, b) for a, b in zip(orders(3, 4, seed=7), orders(3, 4, seed=7), strict=True))
    assert not np.array_equal(orders(1, 0, seed=7)[0], orders(1, 1, seed=7)[0])  # reshuffled per epoch
    assert not np.array_equal(orders(1, 0, seed=7)[0], orders(1, 0, seed=8)[0])
    first_shards = {int(SHARD_OF[orders(1, e)[0][0]]) for e in range(12)}
    assert len(first_shards) > 3  # the shard order is shuffled too, not only samples inside windows
    plain = orders(1, 0, shuffle=False)[0]
    assert sorted(plain.tolist()) == list(range(N)) and np.array_equal(plain, orders(1, 3, shuffle=False)[0])


def test_the_cursor_and_a_resume_on_the_same_world_size():
    o = StreamingOrder(BOUNDS, seed=2, rank=1, world_size=2)
    o.set_epoch(3)
    first = o.next_batch(10)
    state = o.state_dict()
    again = StreamingOrder(BOUNDS, seed=2, rank=1, world_size=2)
    again.load_state_dict(state)
    rest = np.concatenate(again.batches(4))
    assert np.array_equal(np.concatenate([first, rest]), o.indices())
    assert again.epoch == 3 and again.remaining() == 0


@pytest.mark.parametrize(("old", "new"), [(4, 3), (2, 1), (2, 5), (3, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_elastic_resume_gives_each_remaining_sample_exactly_once(old, new, drop_last):
    position = 7
    before = [o[:position] for o in orders(old, 1, seed=5, drop_last=drop_last)]
    state = StreamingOrder(BOUNDS, seed=5, rank=0, world_size=old, drop_last=drop_last)
    state.set_epoch(1)
    state.position = position
    after = []
    for r in range(new):
        o = StreamingOrder(BOUNDS, seed=5, rank=r, world_size=new, drop_last=drop_last)
        o.load_state_dict(state.state_dict())
        after.append(np.concatenate(o.batches(3)) if len(o) else np.empty(0, np.int64))
    assert len({len(a) for a in after}) == 1  # equal on the new ranks too
    full = Counter(np.concatenate(orders(old, 1, seed=5, drop_last=drop_last)).tolist())
    seen = Counter(np.concatenate(before + after).tolist())
    if drop_last:
        assert max(seen.values()) == 1 and set(seen) <= set(full)  # nothing twice; only tails cut
        assert len(set(full) - set(seen)) < old + new
    else:
        assert set(seen) == set(range(N))  # every sample of the epoch
        repeats = sum(seen.values()) - N
        assert repeats <= (old - 1) + (new - 1)  # only padding, as in any epoch
    if old != new:  # the new ranks also read whole shards, a window at a time
        assert all(max_open_shards(a) <= 4 for a in after)


def test_elastic_twice_in_one_epoch_then_the_next_epoch_is_plain():
    states = []
    o = StreamingOrder(BOUNDS, seed=9, rank=0, world_size=4)
    o.set_epoch(2)
    o.position = 5
    consumed = [x[:5] for x in orders(4, 2, seed=9)]
    mid = []
    for r in range(3):
        m = StreamingOrder(BOUNDS, seed=9, rank=r, world_size=3)
        m.load_state_dict(o.state_dict())
        consumed.append(m.next_batch(6))
        mid.append(m)
    states = mid[0].state_dict()
    assert states["history"] == [[4, 5]] and states["position"] == 6
    last = []
    for r in range(2):
        e = StreamingOrder(BOUNDS, seed=9, rank=r, world_size=2)
        e.load_state_dict(states)
        last.append(np.concatenate(e.batches(100)))
    seen = Counter(np.concatenate(consumed + last).tolist())
    assert set(seen) == set(range(N)) and sum(seen.values()) - N <= 3 + 2 + 1
    e.set_epoch(3)
    assert e.history == [] and np.array_equal(e.indices(), orders(2, 3, seed=9)[1])


def test_a_state_from_other_settings_or_the_random_order_is_refused():
    o = StreamingOrder(BOUNDS, seed=1, rank=0, world_size=1)
    for change in ({"seed": 2}, {"window": 2}, {"drop_last": True}):
        other = StreamingOrder(BOUNDS, rank=0, world_size=1, **{"seed": 1, **change})
        with pytest.raises(ValueError, match=f"cannot resume: the saved state has {next(iter(change))}="):
            o.load_state_dict(other.state_dict())
    moved = StreamingOrder([0, 9, 16, 24, 32, 40, 48, 56, 64, 71], seed=1, rank=0, world_size=1)  # same n
    with pytest.raises(ValueError, match="layout"):
        o.load_state_dict(moved.state_dict())
    with pytest.raises(ValueError, match="saved state is from the random-access order"):
        o.load_state_dict(EpochSampler(N, rank=0, world_size=1).state_dict())
    with pytest.raises(ValueError, match="position 99 is outside"):
        o.load_state_dict({**o.state_dict(), "position": 99})


def test_loaders_pick_the_streaming_order_only_for_streaming_readers(index_reader):
    from dali_fast.loaders.torch_iterator import TorchIterator

    plain = make_order(index_reader, seed=0, shuffle=True, rank=0, world_size=1, drop_last=False)
    assert isinstance(plain, EpochSampler)

    class Streaming(IndexReader):
        streaming, shuffle_window = True, 2
        shard_bounds = np.array([0, 10, 20, 30, 37])

        def __init__(self, base):
            self.items, self.classes = base.items, base.classes
            self.calls = []

        def schedule(self, order, then=None):
            self.calls.append(("schedule", order.tolist(), None if then is None else len(then)))

        def advance(self, n):
            self.calls.append(("advance", n))

    reader = Streaming(index_reader)
    loader = TorchIterator(reader, 8, image_size=16, num_workers=0, rank=0, world_size=1, seed=4)
    assert isinstance(loader.order, StreamingOrder) and loader.order.window == 2
    got = [lab.tolist() for _, lab in loader]
    assert sorted(sum(got, [])) == list(range(37))
    schedule = reader.calls[0]
    assert schedule[0] == "schedule" and schedule[1] == sum(got, []) and schedule[2] == 37  # then: the next epoch
    assert [c[1] for c in reader.calls[1:]] == [len(g) for g in got]  # advanced batch by batch
    plain_loader = TorchIterator(index_reader, 8, image_size=16, num_workers=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="saved with the random order, this data set uses the stream order"):
        loader.load_state_dict(plain_loader.state_dict())
