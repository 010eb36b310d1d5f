from collections import Counter

import numpy as np
import pytest

from dali_fast.loaders.order import EpochSampler
from dali_fast.loaders.sampler import dist_rank_world, sharding_note


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1 * 4, 10, 13])
def test_exactly_once_per_epoch_disjoint_equal_shards(world, n):
    for epoch in range(3):
        shards = []
        for rank in range(world):
            s = EpochSampler(n, seed=7, rank=rank, world_size=world)
            s.set_epoch(epoch)
            shards.append(np.concatenate(s.batches(3)))
        assert len({len(x) for x in shards}) == 1
        allidx = np.concatenate(shards)
        pad = len(allidx) - n
        assert 0 <= pad < world
        counts = Counter(allidx.tolist())
        assert set(counts) == set(range(n))  # every sample at least once
        assert sum(c - 1 for c in counts.values()) == pad  # only the wrap-around padding repeats


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_drop_last_shards_disjoint(world):
    n = 13
    shards = []
    for rank in range(world):
        s = EpochSampler(n, seed=1, rank=rank, world_size=world, drop_last=True)
        shards.append(s.indices(0))
    allidx = np.concatenate(shards)
    assert len(set(allidx.tolist())) == len(allidx) == (n // world) * world
    assert len({len(x) for x in shards}) == 1


def test_order_is_function_of_seed_and_epoch():
    a, b = EpochSampler(100, seed=3, rank=0, world_size=1), EpochSampler(100, seed=3, rank=0, world_size=1)
    assert np.array_equal(a.indices(5), b.indices(5))
    assert not np.array_equal(a.indices(5), a.indices(6))
    assert not np.array_equal(a.indices(5), EpochSampler(100, seed=4, rank=0, world_size=1).indices(5))
    assert sorted(a.indices(6).tolist()) == list(range(100))
    assert np.array_equal(EpochSampler(5, shuffle=False, rank=0, world_size=1).indices(9), np.arange(5))


def test_resume_gives_exactly_the_remaining():
    s = EpochSampler(50, seed=0, rank=1, world_size=3)
    s.set_epoch(2)
    consumed = [s.next_batch(4), s.next_batch(7)]
    state = s.state_dict()
    rest_here = np.concatenate(s.batches(5))
    t = EpochSampler(50, seed=0, rank=1, world_size=3)
    t.load_state_dict(state)
    rest_resumed = np.concatenate(t.batches(6))  # batch size may differ after resume
    assert np.array_equal(rest_here, rest_resumed)
    assert np.array_equal(np.concatenate(consumed + [rest_resumed]), s.indices(2))


def test_resume_refuses_other_settings():
    s = EpochSampler(50, seed=0, rank=0, world_size=2)
    EpochSampler(50, seed=0, rank=0, world_size=4).load_state_dict(s.state_dict())  # another world size resumes
    with pytest.raises(ValueError, match="n=50"):
        EpochSampler(51, seed=0, rank=0, world_size=2).load_state_dict(s.state_dict())


def test_batches_drop_last_and_errors():
    s = EpochSampler(10, shuffle=False, rank=0, world_size=1)
    assert [b.tolist() for b in s.batches(4, drop_last=True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert s.remaining() == 0 and len(s.next_batch(4)) == 0
    with pytest.raises(ValueError, match="batch_size"):
        s.next_batch(0)
    with pytest.raises(ValueError, match="rank=2"):
        EpochSampler(10, rank=2, world_size=2)


def test_rank_world_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert dist_rank_world() == (2, 3)
    assert dist_rank_world(0, 1) == (0, 1)
    s = EpochSampler(9)
    assert (s.rank, s.world_size) == (2, 3)


def test_padding_wraps_to_the_epochs_first_samples():
    """Without drop_last the padded positions repeat the start of the epoch's order (as DistributedSampler)."""
    n, world = 10, 4  # 12 positions: 2 padded
    for epoch in range(3):
        order = np.random.default_rng([5, epoch]).permutation(n)
        shards = [EpochSampler(n, seed=5, rank=r, world_size=world).indices(epoch) for r in range(world)]
        assert all(len(s) == 3 for s in shards)
        assert [int(s[2]) for s in shards[2:]] == order[:2].tolist()  # positions 10 and 11 = order[0], order[1]
        repeats = Counter(np.concatenate(shards).tolist()) - Counter(range(n))
        assert sorted(repeats.elements()) == sorted(order[:2].tolist())


def test_unshuffled_order_and_shards():
    s = [EpochSampler(7, shuffle=False, rank=r, world_size=3) for r in range(3)]
    assert [x.indices(4).tolist() for x in s] == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]


def test_rank_world_defaults_and_partial_arguments(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist_rank_world() == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dist_rank_world() == (0, 4)  # RANK unset: rank 0
    assert dist_rank_world(rank=3) == (3, 4)  # the world from the environment, the rank as given
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError) as e:
        dist_rank_world()  # RANK=1 with the default world of 1
    assert str(e.value) == "rank=1: must be in [0, 1) for world_size=1"
    assert dist_rank_world(world_size=2) == (1, 2)
    with pytest.raises(ValueError) as e:
        dist_rank_world(0, 0)
    assert str(e.value) == "world_size=0: must be >= 1"


def test_rank_world_from_an_initialized_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 5)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dist_rank_world() == (2, 5)  # the process group wins over the environment


def test_sizes_edges_and_messages():
    empty = EpochSampler(0, rank=0, world_size=3)
    assert len(empty) == 0 and empty.indices().tolist() == [] and empty.batches(4) == []
    with pytest.raises(ValueError) as e:
        EpochSampler(-1, rank=0, world_size=1)
    assert str(e.value) == "n=-1: the number of samples must be >= 0"
    assert len(EpochSampler(3, rank=2, world_size=3, drop_last=True)) == 1  # n == world is enough
    with pytest.raises(ValueError) as e:
        EpochSampler(2, rank=0, world_size=3, drop_last=True)
    assert str(e.value) == (
        "2 samples cannot give each of 3 ranks one with drop_last=True; use drop_last=False or fewer ranks"
    )
    exact = EpochSampler(12, seed=1, rank=1, world_size=4)  # divides evenly: no padding
    assert len(exact) == 3 and exact.indices(0).dtype == np.int64
    assert sorted(
        np.concatenate([EpochSampler(12, seed=1, rank=r, world_size=4).indices(0) for r in range(4)])
    ) == list(range(12))
    with pytest.raises(ValueError) as e:
        exact.next_batch(0)
    assert str(e.value) == "batch_size=0: must be >= 1"


def test_new_sampler_starts_at_epoch_zero_position_zero():
    s = EpochSampler(20, seed=4, rank=0, world_size=1)
    assert (s.epoch, s.position, s.remaining()) == (0, 0, 20)
    assert np.array_equal(s.indices(), s.indices(0))
    assert s.next_batch(1).tolist() == s.indices(0)[:1].tolist()  # a batch of one is allowed
    assert (s.position, s.remaining()) == (1, 19)
    assert s.next_batch(5).tolist() == s.indices(0)[1:6].tolist()
    assert (s.position, s.remaining()) == (6, 14)
    s.set_epoch(3)
    assert (s.epoch, s.position) == (3, 0)


def test_batches_keep_a_last_batch_that_is_exactly_full():
    s = EpochSampler(8, shuffle=False, rank=0, world_size=1)
    assert [b.tolist() for b in s.batches(4, drop_last=True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    s.set_epoch(1)
    assert [b.tolist() for b in s.batches(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert s.remaining() == 0


def test_state_dict_is_exact_and_every_setting_is_checked_on_resume():
    s = EpochSampler(30, seed=6, rank=1, world_size=2, drop_last=True)
    s.set_epoch(2)
    s.next_batch(4)
    assert s.state_dict() == {
        "epoch": 2,
        "position": 4,
        "seed": 6,
        "n": 30,
        "rank": 1,
        "world_size": 2,
        "shuffle": True,
        "drop_last": True,
        "even": True,
        "history": [],
    }
    others = {"n": 31, "seed": 7, "shuffle": False, "drop_last": False, "even": False}
    for key, value in others.items():
        kw = {"n": 30, "seed": 6, "rank": 1, "world_size": 2, "shuffle": True, "drop_last": True, key: value}
        with pytest.raises(ValueError) as e:
            EpochSampler(kw.pop("n"), **kw).load_state_dict(s.state_dict())
        assert str(e.value) == (
            f"cannot resume: the saved state has {key}={s.state_dict()[key]} but this sampler has {key}={value}; "
            "resume with the same data set and settings"
        )
    t = EpochSampler(30, seed=6, rank=1, world_size=2, drop_last=True)
    t.load_state_dict({"epoch": 2, "position": 15})  # a minimal state: nothing to compare
    assert (t.epoch, t.position) == (2, 15)
    for bad in (-1, 16):
        with pytest.raises(ValueError) as e:
            t.load_state_dict({"epoch": 2, "position": bad})
        assert str(e.value) == f"cannot resume: position {bad} is outside this epoch's 15 samples"


def test_default_seed_is_zero_and_position_zero_resumes():
    assert np.array_equal(
        EpochSampler(20, rank=0, world_size=1).indices(3), EpochSampler(20, seed=0, rank=0, world_size=1).indices(3)
    )
    s = EpochSampler(20, seed=1, rank=0, world_size=1)
    s.load_state_dict({"epoch": 4, "position": 0})  # the start of an epoch is a valid position
    assert (s.epoch, s.position) == (4, 0)


def test_a_real_gloo_group_wins_over_rank_and_world_size_and_the_disagreement_is_named(monkeypatch, tmp_path):
    """A real (gloo) process group of one rank, while RANK/WORLD_SIZE say rank 1 of 2: the group the
    framework really uses decides, and the disagreement is one line naming both."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dist_rank_world() == (1, 2)  # no group yet: the launcher's word
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist_rank_world() == (0, 1)
        assert EpochSampler(9).world_size == 1
        assert sharding_note() == (
            "RANK/WORLD_SIZE say rank 1 of 2, but torch.distributed runs this process as rank 0 of 1: "
            "sharding by the process group"
        )
        assert sharding_note(0, 1) is None  # explicit rank and world size: nothing to disagree with
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert sharding_note() is None  # they agree
    finally:
        dist.destroy_process_group()


def test_rank_and_world_size_without_a_process_group_are_used_and_said(monkeypatch):
    """RANK/WORLD_SIZE with no process group (torchrun, but nothing started one): they shard, and the line
    says that nothing synchronises the processes and how to read all the data."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert sharding_note() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sharding_note() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dist_rank_world() == (1, 2)
    assert sharding_note() == (
        "RANK/WORLD_SIZE say rank 1 of 2, but no torch.distributed process group is initialised: sharding by "
        "them, so this process reads 1/2 of the data and nothing synchronises the processes; start the process "
        "group before the first pass, or pass rank=0, world_size=1 to read all of it"
    )


def test_world_size_without_rank_agrees_with_a_group_of_that_size(monkeypatch):
    """Lightning's DDP launcher sets WORLD_SIZE, not RANK, in the ranks it starts: rank 1 of a 2-rank group
    is no disagreement there; a group of another size still is."""
    from dali_fast.loaders import sampler

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sampler, "_framework_rank_world", lambda: (1, 2, "torch.distributed"))
    assert sharding_note() is None
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert sharding_note() == (
        "RANK/WORLD_SIZE say rank 0 of 3, but torch.distributed runs this process as rank 1 of 2: "
        "sharding by the process group"
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sharding_note() is not None  # RANK said, and it is not this rank


class _FakeAccelerate:
    """What `accelerate.state` looks like to the sampler: `PartialState._shared_state`, a dict Accelerate
    fills when an Accelerator (or PartialState) is made in this process."""

    def __init__(self, shared):
        self.PartialState = type("PartialState", (), {"_shared_state": shared})


def test_accelerate_s_count_is_read_only_when_it_holds_both_numbers(monkeypatch):
    """With no process group, Accelerate's own count (process_index of num_processes) decides once an
    Accelerator was made; an empty or partial state (nothing made yet), or no Accelerate imported at all,
    leaves RANK/WORLD_SIZE to decide; and the numbers are read as ints."""
    import sys

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delitem(sys.modules, "accelerate.state", raising=False)
    assert dist_rank_world() == (1, 4)  # Accelerate not imported: the launcher's word
    for shared in ({}, {"num_processes": 2}, {"process_index": 1}, None, ["num_processes", "process_index"]):
        monkeypatch.setitem(sys.modules, "accelerate.state", _FakeAccelerate(shared))
        assert dist_rank_world() == (1, 4), shared  # nothing (or not all) said: the launcher's word
    monkeypatch.setitem(sys.modules, "accelerate.state", object())  # no PartialState
    assert dist_rank_world() == (1, 4)
    monkeypatch.setitem(sys.modules, "accelerate.state", _FakeAccelerate({"num_processes": "3", "process_index": "2"}))
    assert dist_rank_world() == (2, 3)
    assert type(dist_rank_world()[0]) is int and type(dist_rank_world()[1]) is int
    assert EpochSampler(12, shuffle=False).indices(0).tolist() == [2, 5, 8, 11]
    assert sharding_note() == (
        "RANK/WORLD_SIZE say rank 1 of 4, but Accelerate runs this process as rank 2 of 3 (no torch.distributed "
        "process group, so nothing synchronises the processes): sharding as rank 2 of 3, so each process reads "
        "all the data; on CPUs, make the Accelerator with cpu=True for distributed training"
    )
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert sharding_note() is None  # they agree
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert sharding_note() is None  # the launcher says nothing: nothing to disagree with


def test_sharding_note_compares_unless_both_rank_and_world_size_are_given(monkeypatch):
    """One of rank/world_size given is not enough to skip the comparison; both given is."""
    import sys

    monkeypatch.delitem(sys.modules, "accelerate.state", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    expected = (
        "RANK/WORLD_SIZE say rank 1 of 2, but no torch.distributed process group is initialised: sharding by "
        "them, so this process reads 1/2 of the data and nothing synchronises the processes; start the process "
        "group before the first pass, or pass rank=0, world_size=1 to read all of it"
    )
    assert sharding_note(rank=0) == expected
    assert sharding_note(world_size=2) == expected
    assert sharding_note(0, 2) is None


def test_a_pass_starting_mid_epoch_follows_a_process_group_that_started_late(monkeypatch):
    """A loader one batch into an epoch (not resumed) when the process group starts: a new pass restarts
    the epoch, so it takes the group's rank; outside a starting pass the position stands in the way."""
    from builders import IndexReader, jpeg_bytes

    from dali_fast import TorchIterator

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loader = TorchIterator(IndexReader([jpeg_bytes(16, 16) for _ in range(12)]), 3, image_size=8, device="cpu",
                           num_workers=0)  # fmt: skip
    it = iter(loader)
    next(it)
    del it
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="the process group says rank 1 of 2, but this loader is mid-epoch"):
        loader.follow_process_group()
    loader.follow_process_group(starting=True)
    assert (loader.rank, loader.world_size) == (1, 2)
