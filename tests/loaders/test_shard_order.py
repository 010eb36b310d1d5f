"""The streaming epoch order: whole shards per rank, shuffle windows, exactly once, resume (also elastic)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from builders import IndexReader

from dali_fast.loaders.order import EpochSampler, StreamingOrder, make_order

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


# ----------------------------------------------------------------------------- exact edges and messages


def test_bad_bounds_window_and_ranks_are_one_line_exactly():
    said = "bounds: the first sample of each shard and the total, starting at 0 and not decreasing"
    for bounds in ([[0, 5], [5, 9]], [0], [7], [1, 5], [0, 5, 3]):  # 2-D, one number, not from 0, decreasing
        with pytest.raises(ValueError) as e:
            StreamingOrder(np.array(bounds), rank=0, world_size=1)
        assert str(e.value) == said, bounds
    for bounds in ([0, 5], [0, 5, 5, 9], [0, 0]):  # one shard; an empty shard; no samples at all
        assert StreamingOrder(bounds, rank=0, world_size=1).n == bounds[-1]
    assert len(StreamingOrder([0, 0], rank=0, world_size=2)) == 0
    with pytest.raises(ValueError) as e:
        StreamingOrder(BOUNDS, window=0, rank=0, world_size=1)
    assert str(e.value) == "window=0: must be >= 1 shard"
    with pytest.raises(ValueError) as e:
        StreamingOrder([0, 2], rank=0, world_size=3, drop_last=True)
    assert (
        str(e.value)
        == "2 samples cannot give each of 3 ranks one with drop_last=True; use drop_last=False or fewer ranks"
    )
    one_each = [StreamingOrder([0, 3], rank=r, world_size=3, drop_last=True).indices().tolist() for r in range(3)]
    assert sorted(sum(one_each, [])) == [0, 1, 2] and all(len(x) == 1 for x in one_each)


def test_a_new_order_and_its_state_exactly():
    import hashlib

    o = StreamingOrder(BOUNDS, rank=1, world_size=2)
    assert (o.epoch, o.position, o.seed, o.window, o.history) == (0, 0, 0, 4, [])
    assert np.array_equal(o.indices(), StreamingOrder(BOUNDS, seed=0, window=4, rank=1, world_size=2).indices())
    assert o.indices().dtype == np.int64
    layout = hashlib.sha1(np.asarray(BOUNDS, np.int64).tobytes()).hexdigest()[:16]
    assert o.state_dict() == {
        "order": "stream",
        "epoch": 0,
        "position": 0,
        "history": [],
        "seed": 0,
        "n": N,
        "rank": 1,
        "world_size": 2,
        "shuffle": True,
        "drop_last": False,
        "even": True,
        "window": 4,
        "layout": layout,
    }


def test_shard_sequence_cut_and_arrange_at_their_edges():
    from dali_fast.loaders.order.streaming import arrange, cut, shard_sequence

    bounds = np.array([0, 0, 3, 3, 5])  # shards 0 and 2 are empty
    assert shard_sequence(bounds, np.array([3, 1, 0, 2])).tolist() == [3, 4, 0, 1, 2]
    for order in (np.array([0, 2]), np.array([], np.int64)):
        empty = shard_sequence(bounds, order)
        assert empty.dtype == np.int64 and empty.tolist() == []
    assert shard_sequence(np.array([0, 1]), np.array([0])).tolist() == [0]  # one sample
    seq = np.arange(10, 15)  # five samples for four ranks: own runs of 2, 1, 1, 1; or 1 each, the tail cut
    assert [cut(seq, 4, r, False).tolist() for r in range(4)] == [[10, 11], [12], [13], [14]]
    assert [cut(seq, 4, r, True).tolist() for r in range(4)] == [[10], [11], [12], [13]]
    assert cut(seq[:0], 3, 2, False).tolist() == [] and cut(seq, 1, 0, False).tolist() == seq.tolist()
    order, group = arrange(np.empty(0, np.int64), np.zeros(0, np.int64), 2, None)
    assert (order.dtype, group.dtype, len(order), len(group)) == (np.int64, np.int64, 0, 0)
    order, group = arrange(np.arange(6), np.array([0, 0, 1, 1, 2, 2]), 8, None)  # three blocks, unshuffled
    assert order.tolist() == [0, 1, 4, 5, 2, 3] and group.tolist() == [0, 0, 1, 1, 2, 2]  # the last one second


def test_indices_of_another_epoch_and_many_epochs():
    o = StreamingOrder(BOUNDS, seed=4, rank=0, world_size=2)
    fresh = StreamingOrder(BOUNDS, seed=4, rank=0, world_size=2)
    for epoch in range(7):  # more epochs than the order keeps in memory
        fresh.set_epoch(epoch)
        assert np.array_equal(o.indices(epoch), fresh.indices())
    o.set_epoch(2)
    o.position = 9
    resumed = StreamingOrder(BOUNDS, seed=4, rank=0, world_size=3)
    resumed.load_state_dict(o.state_dict())
    assert resumed.history == [(2, 9)] and np.array_equal(resumed.indices(2), resumed.indices())
    fresh.set_epoch(3)
    assert not np.array_equal(resumed.indices(3), resumed.indices())
    assert np.array_equal(resumed.indices(3), StreamingOrder(BOUNDS, seed=4, rank=0, world_size=3).indices(3))


def test_an_elastic_resume_of_an_epoch_s_last_samples_leaves_nothing_to_the_extra_ranks():
    o = StreamingOrder([0, 8], rank=0, world_size=2, drop_last=True)
    o.position = 3  # each of the two ranks read 3 of its 4: two samples are left
    for r in range(3):
        new = StreamingOrder([0, 8], rank=r, world_size=3, drop_last=True)
        new.load_state_dict(o.state_dict())
        left = new.indices()
        assert left.dtype == np.int64 and left.tolist() == [] and len(new) == 0  # fewer than ranks: none


# Epoch 1 of seed 3, three ranks saved at position 6, resumed on two ranks (rank 1 pads, last, with a repeat
# of 28, the sample it read just before).
GOLDEN_ELASTIC = [
    [12, 46, 43, 23, 19, 62, 13, 17, 44, 9, 16, 20, 18, 45, 14, 60, 63, 41, 22, 58, 21, 57, 10, 33, 36, 32, 35],
    [56, 64, 54, 59, 48, 66, 0, 1, 3, 49, 7, 2, 55, 50, 69, 51, 5, 53, 6, 31, 26, 24, 25, 29, 27, 28, 28],
]


def test_the_elastic_order_is_the_same_from_release_to_release():
    """The order after an elastic resume, pinned: a pure function of (seed, epoch, ranks, positions)."""
    old = StreamingOrder(BOUNDS, seed=3, rank=0, world_size=3)
    old.set_epoch(1)
    old.position = 6
    got = []
    for r in range(2):
        new = StreamingOrder(BOUNDS, seed=3, rank=r, world_size=2)
        new.load_state_dict(old.state_dict())
        got.append(new.indices().tolist())
    assert got == GOLDEN_ELASTIC


def test_resume_states_exactly(monkeypatch):
    o = StreamingOrder(BOUNDS, seed=1, rank=0, world_size=2)
    with pytest.raises(ValueError) as e:
        o.load_state_dict(EpochSampler(N, rank=0, world_size=2).state_dict())
    assert str(e.value) == (
        "cannot resume: the saved state is from the random-access order, this data set streams shards; "
        "resume with the data set it was saved with"
    )
    for change, key in (({"bounds": [0, 5, 9]}, "n"), ({"shuffle": False}, "shuffle")):
        other = StreamingOrder(**{"bounds": BOUNDS, "seed": 1, "rank": 0, "world_size": 2, **change})
        with pytest.raises(ValueError, match=f"^cannot resume: the saved state has {key}="):
            o.load_state_dict(other.state_dict())
    o.load_state_dict({"order": "stream", "epoch": 2, "position": 5})  # the least a state holds
    assert (o.epoch, o.position, o.history) == (2, 5, [])
    for position in (0, len(o)):
        o.load_state_dict({**o.state_dict(), "position": position})
        assert o.position == position
    with pytest.raises(ValueError) as e:
        o.load_state_dict({**o.state_dict(), "position": len(o) + 1})
    assert str(e.value) == f"cannot resume: position {len(o) + 1} is outside this epoch's {len(o)} samples"
    monkeypatch.setenv("RANK", "4")  # under torchrun: this process's rank in the new world, not the old one's
    monkeypatch.setenv("WORLD_SIZE", "5")
    saved = StreamingOrder(BOUNDS, seed=1, rank=0, world_size=2, drop_last=True)  # 35 samples per rank
    new = StreamingOrder(BOUNDS, seed=1, rank=4, world_size=5, drop_last=True)
    for position in (0, 35):
        new.load_state_dict({**saved.state_dict(), "position": position})
        assert new.history == [(2, position)]
    with pytest.raises(ValueError) as e:
        new.load_state_dict({**saved.state_dict(), "position": 36})
    assert str(e.value) == "cannot resume: position 36 is outside that epoch's 35 samples"


def test_make_order_passes_every_setting_on():
    class Streaming(IndexReader):
        streaming, shuffle_window = True, 3
        shard_bounds = np.array([0, 10, 20, 30, 37])

        def __init__(self):
            self.classes = []

        def schedule(self, order, then=None):
            pass

        def advance(self, n):
            pass

    o = make_order(Streaming(), seed=5, shuffle=False, rank=1, world_size=2, drop_last=True)
    assert isinstance(o, StreamingOrder)
    assert (o.seed, o.shuffle, o.rank, o.world_size, o.drop_last, o.window, o.n) == (5, False, 1, 2, True, 3, 37)
    p = make_order(IndexReader([b"x"] * 9), seed=5, shuffle=False, rank=1, world_size=2, drop_last=True)
    assert isinstance(p, EpochSampler)
    assert (p.seed, p.shuffle, p.rank, p.world_size, p.drop_last, p.n) == (5, False, 1, 2, True, 9)


def test_make_order_shuffles_when_asked():
    class Streaming(IndexReader):
        streaming, shuffle_window = True, 3
        shard_bounds = np.array([0, 10, 20, 30, 37])

        def __init__(self):
            self.classes = []

        def schedule(self, order, then=None):
            pass

        def advance(self, n):
            pass

    for data in (Streaming(), IndexReader([b"x"] * 9)):
        assert make_order(data, seed=5, shuffle=True, rank=0, world_size=1, drop_last=False).shuffle is True


def test_bounds_of_any_integer_type_give_the_same_order_and_layout():
    narrow = StreamingOrder(BOUNDS.astype(np.int32), seed=2)
    wide = StreamingOrder(BOUNDS.tolist(), seed=2)
    assert narrow.bounds.dtype == np.int64 and narrow.layout == wide.layout
    assert np.array_equal(narrow.indices(), wide.indices())


def test_an_epoch_s_order_is_computed_once_and_a_few_epochs_are_kept():
    for o in (StreamingOrder(BOUNDS, seed=3), EpochSampler(N, seed=3)):
        assert o.indices() is o.indices()  # the loader asks for it several times a pass
    o = StreamingOrder(BOUNDS, seed=3)
    first = o.indices(0)
    for epoch in (1, 2, 3):
        o.indices(epoch)
    assert o.indices(0) is first  # four epochs are kept (the current one, the next one the cache reads ahead...)
    o.indices(4)
    again = o.indices(0)
    assert again is not first and np.array_equal(again, first)  # ...and no more: the oldest is computed again


@pytest.mark.parametrize("new", [1, 2, 4])
def test_an_elastic_resume_never_gives_again_what_a_rank_had_read(new):
    """The old ranks' padding repeats a few samples: wherever the old ranks stopped, a sample one of them
    had read (the first copy or the repeat) is not in the new ranks' order."""
    old = 3  # 71 samples: 24 per rank, one of them a repeat
    full = orders(old, 1, seed=5)
    for position in range(len(full[0]) + 1):
        taken = set(np.concatenate([o[:position] for o in full]).tolist())
        state = StreamingOrder(BOUNDS, seed=5, rank=0, world_size=old)
        state.set_epoch(1)
        state.position = position
        after = []
        for r in range(new):
            o = StreamingOrder(BOUNDS, seed=5, rank=r, world_size=new)
            o.load_state_dict(state.state_dict())
            after.extend(o.indices().tolist())
        assert not taken & set(after), position
        assert taken | set(after) == set(range(N)), position


def test_a_refused_setting_is_named_with_both_values_in_one_line():
    o = StreamingOrder(BOUNDS, seed=1, rank=0, world_size=1)
    with pytest.raises(ValueError) as e:
        o.load_state_dict(StreamingOrder(BOUNDS, seed=2, rank=0, world_size=1).state_dict())
    assert str(e.value) == (
        "cannot resume: the saved state has seed=2 but this order has seed=1; "
        "resume with the same data set and settings"
    )


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_padding_is_one_repeat_in_a_shorter_rank_s_last_place(world):
    """As `EpochSampler` pads: each rank short of ``ceil(n / world)`` samples repeats one, in its very last
    place (the sample it read just before, still in the cache), so no place before the last holds a repeat."""
    for n_bounds in (BOUNDS, np.array([0, 3, 3, 5]), np.array([0, 2])):  # 71 samples; 5 (an empty shard); 2
        n = int(n_bounds[-1])
        per = -(-n // world)
        got = []
        for r in range(world):
            o = StreamingOrder(n_bounds, seed=2, rank=r, world_size=world)
            o.set_epoch(1)
            got.append(o.indices().tolist())
        assert [len(g) for g in got] == [per] * world
        before_last = [i for g in got for i in g[:-1]]
        assert len(before_last) == len(set(before_last))  # no repeat before a rank's last place
        everything = Counter(i for g in got for i in g)
        assert set(everything) == set(range(n)) and everything.total() - n == per * world - n
        for g in got:
            if g.count(g[-1]) == 2 and len(g) > 1:  # a padded rank with samples of its own: the one it read last
                assert g[-1] == g[-2]
