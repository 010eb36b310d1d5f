"""Elastic resume: a state saved by one rank of a lockstep run resumes on another number of ranks, each
remaining sample of the epoch exactly once, equal batch counts, the next epoch plain. The rule in one place
(`loaders.order`), for both orders, both loaders and every local data kind (Parquet both read at random and
streamed by row groups); the checkpoint helpers of ``train --resume``; and `torchrun` with 2 processes
SIGKILLed mid-epoch, resumed with 1."""

from __future__ import annotations

import json
import logging
import math
import subprocess
from collections import Counter

import numpy as np
import pytest
from builders import jpeg_bytes, make_folder
from contract import each_once
from elastic_cases import TRANSITIONS, loader_maker, run_elastic, write_hf_parquet

from dali_fast.loaders.order import EpochSampler
from dali_fast.loaders.order.base import kept_global_batch, per_rank, share, unreached
from dali_fast.loaders.order.streaming import StreamingOrder, cut
from dali_fast.train.checkpoint import rank_state, resume_batch_size


def saved_at(order_cls, world: int, position: int, epoch: int = 1, **kw) -> dict:
    """The state rank 0 of ``world`` ranks saves after ``position`` samples of ``epoch`` (as a plain,
    checkpointed dict)."""
    o = order_cls(rank=0, world_size=world, **kw)
    o.set_epoch(epoch)
    o.position = position
    return json.loads(json.dumps(o.state_dict()))


def consumed(order_cls, world: int, position: int, epoch: int = 1, **kw) -> list[int]:
    """What the ``world`` ranks of a lockstep run had taken after ``position`` samples each."""
    out = []
    for r in range(world):
        o = order_cls(rank=r, world_size=world, **kw)
        o.set_epoch(epoch)
        out += o.indices()[:position].tolist()
    return out


def resumed(order_cls, state: dict, world: int, **kw) -> list[np.ndarray]:
    """What each of ``world`` new ranks takes after loading ``state`` (the rest of its order)."""
    out = []
    for r in range(world):
        o = order_cls(rank=r, world_size=world, **kw)
        o.load_state_dict(state)
        assert len(o) == len(o.indices()) and o.position == (state["position"] if world == state["world_size"] else 0)
        out.append(o.indices()[o.position :])
    return out


def sampler(n: int):
    return lambda **kw: EpochSampler(n, **kw)


BOUNDS = np.array([0, 8, 16, 24, 29])  # 4 shards, the last one short: 29 samples


def streaming(**kw):
    return StreamingOrder(BOUNDS, window=2, **kw)


# ------------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("make", [sampler(29), streaming], ids=["random", "stream"])
@pytest.mark.parametrize(("old", "new"), [*TRANSITIONS, (3, 2), (2, 5)])
def test_every_sample_no_old_rank_reached_comes_once_and_ranks_stay_equal(make, old, new):
    """Wherever the old ranks stopped (every position of the epoch), the rest goes to the new ranks: each
    sample of the data set once, before or after, but for at most ``new - 1`` padding repeats."""
    n = 29
    full = per_rank(n, old, False)
    for position in range(full + 1):
        before = consumed(make, old, position, seed=5)
        after = resumed(make, saved_at(make, old, position, seed=5), new, seed=5)
        assert len({len(a) for a in after}) == 1, position  # equal: DDP cannot hang
        rest = np.concatenate(after).tolist()
        assert not set(before) & set(rest), position  # nothing the old ranks had taken comes again
        left = set(range(n)) - set(before)  # what no old rank had reached: each once, but the new padding
        each_once(rest, left, padding=new - 1, what=f"position {position}")
        each_once(before, set(before), padding=old - 1)  # the old ranks' own padding, if they reached it
        assert len(after[0]) == math.ceil(len(left) / new), position


@pytest.mark.parametrize("make", [sampler(29), streaming], ids=["random", "stream"])
@pytest.mark.parametrize(("old", "new"), TRANSITIONS)
def test_with_drop_last_each_sample_at_most_once_and_only_tails_left_out(make, old, new):
    n = 29
    kw = {"seed": 2, "drop_last": True}
    old_epoch = set(consumed(make, old, per_rank(n, old, True), **kw))  # what the old world's epoch shows
    for position in range(per_rank(n, old, True) + 1):
        before = consumed(make, old, position, **kw)
        after = resumed(make, saved_at(make, old, position, **kw), new, **kw)
        rest = np.concatenate(after).tolist()
        assert len({len(a) for a in after}) == 1
        each_once(before + rest, set(before + rest), what=f"position {position}")  # nothing twice
        assert set(rest) <= old_epoch - set(before)  # the old world's cut tail stays out
        left = len(old_epoch) - len(before)
        assert len(rest) == left // new * new  # the new ranks cut fewer than `new` of the rest


def test_the_rest_is_dealt_in_the_epoch_s_order_exactly():
    """Unshuffled, 10 samples, 3 ranks (padded with 0 and 1): the places each rank had taken, and what a
    new world gets, by hand."""
    plain = {"shuffle": False}
    assert [o.tolist() for o in resumed(sampler(10), saved_at(sampler(10), 3, 2, **plain), 2, **plain)] == [
        [6, 8],
        [7, 9],
    ]  # 0..5 taken; 6..9 left; the padding (0, 1) was taken already
    assert [o.tolist() for o in resumed(sampler(10), saved_at(sampler(10), 3, 0, **plain), 4, **plain)] == [
        [0, 4, 8],
        [1, 5, 9],
        [2, 6, 0],
        [3, 7, 1],
    ]  # nothing taken: the old padding's repeats are dropped, the new ranks pad their own way
    cut_kw = {"shuffle": False, "drop_last": True}
    assert [o.tolist() for o in resumed(sampler(10), saved_at(sampler(10), 3, 1, **cut_kw), 4, **cut_kw)] == [
        [3],
        [4],
        [5],
        [6],
    ]  # 9 was the old tail; 7 and 8 the new one
    uneven = {"shuffle": False, "even": False}
    assert [o.tolist() for o in resumed(sampler(10), saved_at(sampler(10), 3, 3, **uneven), 2, **uneven)] == [
        [9],
        [],
    ]  # rank 0 (0, 3, 6, 9) at 3: the shorter ranks had ended; only 9 is left
    assert [o.tolist() for o in resumed(sampler(10), saved_at(sampler(10), 3, 4, **uneven), 2, **uneven)] == [[], []]


# Epoch 1 of seed 3, 29 samples: four ranks saved at position 3, resumed on three (the last one pads with
# a repeat of 6, the first of the 17 samples left).
GOLDEN = [[6, 24, 16, 17, 15, 22], [20, 4, 28, 1, 26, 19], [18, 3, 27, 21, 8, 6]]


def test_the_elastic_order_is_the_same_from_release_to_release():
    got = [o.tolist() for o in resumed(sampler(29), saved_at(sampler(29), 4, 3, seed=3), 3, seed=3)]
    assert got == GOLDEN


@pytest.mark.parametrize("make", [sampler(29), streaming], ids=["random", "stream"])
def test_twice_in_one_epoch_then_the_next_epoch_is_plain(make):
    """4 ranks, then 3, then 2 in one epoch: the state keeps each resize; the next epoch is the plain order."""
    taken = consumed(make, 4, 3, seed=9)
    middle = []
    for r in range(3):
        o = make(rank=r, world_size=3, seed=9)
        o.load_state_dict(saved_at(make, 4, 3, seed=9))
        taken += o.next_batch(2).tolist()
        middle.append(o)
    state = json.loads(json.dumps(middle[0].state_dict()))
    assert state["history"] == [[4, 3]] and state["position"] == 2 and state["world_size"] == 3
    same = make(rank=1, world_size=3, seed=9)
    same.load_state_dict(middle[1].state_dict())  # the same world size: the same place, history kept
    assert same.history == [(4, 3)] and same.position == 2 and np.array_equal(same.indices(), middle[1].indices())
    last = resumed(make, state, 2, seed=9)
    each_once(taken + np.concatenate(last).tolist(), range(29), padding=2 + 1)
    o = make(rank=1, world_size=2, seed=9)
    o.load_state_dict(state)
    assert o.history == [(4, 3), (3, 2)] and len(o) == len(last[1])
    o.set_epoch(2)
    assert o.history == [] and np.array_equal(o.indices(), make(rank=1, world_size=2, seed=9).indices(2))
    assert len(o) == per_rank(29, 2, False)


def test_a_position_outside_the_saved_epoch_is_refused_in_one_line():
    state = saved_at(sampler(10), 3, 0, even=False)  # shares of 4, 3 and 3 samples
    new = EpochSampler(10, rank=0, world_size=2, even=False)
    for position in (0, 4):
        new.load_state_dict({**state, "position": position})
        assert new.history == [(3, position)]
    for position, rank, length in ((5, 0, 4), (-1, 0, 4), (4, 1, 3)):
        with pytest.raises(ValueError) as e:
            new.load_state_dict({**state, "position": position, "rank": rank})
        assert str(e.value) == f"cannot resume: position {position} is outside that epoch's {length} samples"
    even = EpochSampler(10, rank=2, world_size=3)  # equal shares: rank 2 has 4 (one padded), like rank 0
    even.load_state_dict({**saved_at(sampler(10), 3, 0), "position": 4})
    assert even.position == 4 and even.remaining() == 0
    two_hops = {**saved_at(sampler(29), 3, 0), "history": [[4, 3]]}  # 4 ranks took 3 each: 17 left, 6 a rank
    new29 = EpochSampler(29, rank=1, world_size=2)
    new29.load_state_dict({**two_hops, "position": 6})
    assert new29.history == [(4, 3), (3, 6)]
    with pytest.raises(ValueError) as e:
        new29.load_state_dict({**two_hops, "position": 7})
    assert str(e.value) == "cannot resume: position 7 is outside that epoch's 6 samples"
    no_rank = {k: v for k, v in state.items() if k != "rank"}  # a state without its rank: rank 0's
    new.load_state_dict({**no_rank, "position": 4})
    assert new.history == [(3, 4)]
    elastic = EpochSampler(10, rank=0, world_size=2)
    elastic.load_state_dict(saved_at(sampler(10), 3, 2))  # 8 left after 3 ranks took 2 each
    assert len(elastic) == 2 and len(elastic.indices()) == 2
    with pytest.raises(ValueError) as e:
        elastic.load_state_dict({**elastic.state_dict(), "position": 3})
    assert str(e.value) == "cannot resume: position 3 is outside this epoch's 2 samples"
    with pytest.raises(ValueError) as e:
        EpochSampler(10, rank=0, world_size=2).load_state_dict({**state, "order": "stream"})
    assert str(e.value) == (
        "cannot resume: the saved state is from the streaming order, this data set is read by random access; "
        "resume with the data set it was saved with"
    )
    with pytest.raises(ValueError) as e:
        EpochSampler(10, rank=0, world_size=2).load_state_dict(state)  # saved with even=False
    assert str(e.value) == (
        "cannot resume: the saved state has even=False but this sampler has even=True; "
        "resume with the same data set and settings"
    )
    with pytest.raises(ValueError) as e:
        streaming(rank=0, world_size=2).load_state_dict(saved_at(streaming, 3, 0, even=False))
    assert str(e.value) == (
        "cannot resume: the saved state has even=False but this order has even=True; "
        "resume with the same data set and settings"
    )


def test_make_order_deals_evenly_unless_told_and_passes_even_on():
    from builders import IndexReader

    from dali_fast.loaders.order import make_order

    class Streaming(IndexReader):
        streaming, shuffle_window, shard_bounds = True, 2, BOUNDS

        def __init__(self):
            self.items, self.classes = [b"x"] * N, ["0"]

        def schedule(self, order, then=None):
            pass

        def advance(self, n):
            pass

    kw = {"seed": 1, "shuffle": True, "rank": 0, "world_size": 2, "drop_last": False}
    for data, kind in ((Streaming(), StreamingOrder), (IndexReader([b"x"] * N), EpochSampler)):
        assert type(make_order(data, **kw)) is kind
        assert make_order(data, **kw).even is True and make_order(data, **kw, even=False).even is False


def test_helpers_exactly():
    assert unreached(np.array([5, 1]), np.array([3, 5, 2, 3, 1, 7, 2])).tolist() == [3, 2, 7]
    assert unreached(np.array([], np.int64), np.array([4, 4])).tolist() == [4]
    assert unreached(np.array([1]), np.array([], np.int64)).tolist() == []
    assert [share(10, 3, r, False, False) for r in range(3)] == [4, 3, 3]
    assert [share(9, 3, r, False, False) for r in range(3)] == [3, 3, 3]
    assert [share(10, 3, r, False, True) for r in range(3)] == [4, 4, 4]
    assert [share(10, 3, r, True, False) for r in range(3)] == [3, 3, 3]  # drop_last cuts, even or not
    assert [share(10, 3, r, True, True) for r in range(3)] == [3, 3, 3]
    seq = np.arange(10, 15)
    assert [cut(seq, 4, r, False).tolist() for r in range(4)] == [[10, 11], [12], [13], [14]]
    assert [cut(seq, 2, r, False).tolist() for r in range(2)] == [[10, 11, 12], [13, 14]]
    assert [cut(seq, 4, r, True).tolist() for r in range(4)] == [[10], [11], [12], [13]]


def test_the_global_batch_is_kept_where_it_divides(caplog):
    with caplog.at_level(logging.INFO, logger="dali_fast.loaders.order"):
        got = [kept_global_batch(b, w, v) for b, w, v in ((3, 4, 2), (3, 2, 3), (3, 1, 4), (4, 1, 4), (3, 4, 1))]
    assert got == [6, 2, 3, 1, 12] and all(type(g) is int for g in got)
    assert caplog.messages[0] == (
        "loader: resumed with ranks 4 → 2: batch size 3 → 6 per rank, a global batch of 12 (was 12)"
    )
    assert caplog.messages[2] == (
        "loader: resumed with ranks 1 → 4: batch size 3 → 3 per rank, a global batch of 12 (was 3)"
    )


# ----------------------------------------------------------------------------------- the checkpoint


def _ranks(*places, history=()):
    return [
        {
            "loader": {"sampler": {"epoch": 1, "position": p, "history": list(history)}, "batch_size": 4, "r": r},
            "partial": {"samples": 10 * (r + 1), "loss_sum": 1.5 * (r + 1)},
        }
        for r, p in enumerate(places)
    ]


def test_each_rank_resumes_from_its_own_state_or_rank_zero_s():
    ranks = _ranks(8, 8, 8, 8)
    assert rank_state("ck", ranks, 2, 4) == (ranks[2]["loader"], {"samples": 30, "loss_sum": 4.5})  # the same world
    assert rank_state("ck", ranks, 0, 2) == (ranks[0]["loader"], {"samples": 100, "loss_sum": 15.0})
    assert rank_state("ck", ranks, 1, 2) == (ranks[0]["loader"], {"samples": 0, "loss_sum": 0.0})
    assert rank_state("ck", ranks[:1], 3, 4) == (ranks[0]["loader"], {"samples": 0, "loss_sum": 0.0})
    plain = [{"loader": None, "partial": {"samples": 0, "loss_sum": 0.0}}] * 2  # the DataLoader baseline
    assert rank_state("ck", plain, 0, 1) == (None, {"samples": 0, "loss_sum": 0.0})
    with pytest.raises(ValueError) as e:
        rank_state("ck/checkpoint.pt", _ranks(8, 12), 0, 1)
    assert str(e.value) == (
        "ck/checkpoint.pt: the 2 saved ranks stopped at different places in the epoch ([1, 12, []], [1, 8, []]); "
        "resume on 2 processes"
    )
    for r in (older := _ranks(8, 12)):  # states saved before the history was kept
        del r["loader"]["sampler"]["history"]
    with pytest.raises(ValueError) as e:
        rank_state("ck", older, 0, 1)
    assert str(e.value).startswith(
        "ck: the 2 saved ranks stopped at different places in the epoch ([1, 12, []], [1, 8, []])"
    )
    mixed = [*_ranks(8), *_ranks(8, history=[[4, 2]])[:1]]
    with pytest.raises(ValueError, match=r"^ck: the 2 saved ranks stopped at different places"):
        rank_state("ck", mixed, 0, 1)


def test_the_batch_size_of_a_resume_and_what_it_says():
    assert resume_batch_size(16, 2, 16, 2) == (16, None)
    assert resume_batch_size(16, 2, 8, 2) == (8, "batch size 16 → 8 as given")
    assert resume_batch_size(5, 2, 5, 1) == (
        10,
        "ranks 2 → 1: batch size 5 → 10 per rank, the global batch stays 10",
    )
    assert resume_batch_size(8, 4, 8, 2, most=16) == (
        16,
        "ranks 4 → 2: batch size 8 → 16 per rank, the global batch stays 32",
    )
    assert resume_batch_size(5, 2, 5, 3) == (
        5,
        "ranks 2 → 3: a global batch of 10 does not split into 3 equal batches, so the batch size stays 5 "
        "per rank (a global batch of 15; the learning rate is unchanged)",
    )
    assert resume_batch_size(8, 4, 8, 2, most=15) == (
        8,
        "ranks 4 → 2: a global batch of 32 does not split into 2 equal batches of at most 15 samples, so "
        "the batch size stays 8 per rank (a global batch of 16; the learning rate is unchanged)",
    )
    assert resume_batch_size(5, 2, 4, 1) == (
        4,
        "batch size 5 → 4 as given, with ranks 2 → 1 (a global batch of 4, was 10)",
    )


# ------------------------------------------------------------------------------ loaders and data kinds

N = 29  # samples of each data set: no world size here divides it


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """The same 29 images as a packed set, an ImageFolder, local WebDataset shards and local Parquet files
    (3 files of 10, 10 and 9 rows, row groups of 4: 9 groups): {kind: path}."""
    from dali_fast import open_dataset, pack

    root = tmp_path_factory.mktemp("elastic")
    colors = [(200, 30, 60), (10, 200, 10), (0, 0, 255)]
    images = {c: [jpeg_bytes(30 + i, 20 + i % 5, colors[k]) for i in range(k, N, 3)] for k, c in enumerate("abc")}
    folder = make_folder(root / "folder", images)
    pack(folder, root / "packed", progress=False)
    wds = pytest.importorskip("webdataset")
    (root / "shards").mkdir()
    files = sorted(folder.rglob("*.jpg"))
    for s in range(4):
        with wds.TarWriter(str(root / "shards" / f"train-{s:06d}.tar")) as sink:
            for i in range(s * 8, min(N, s * 8 + 8)):
                sink.write({"__key__": f"s{i:05d}", "jpg": files[i].read_bytes(), "cls": str(i % 3).encode()})
    src = open_dataset(folder)
    parquet = write_hf_parquet(
        root / "parquet", [bytes(src[i][0]) for i in range(N)], src.labels.tolist(), src.classes, files=3, group=4
    )
    return {
        "packed": root / "packed",
        "folder": folder,
        "webdataset": str(root / "shards" / "train-{000000..000003}.tar"),
        "parquet": parquet,
        "parquet-streaming": parquet,
    }


# How each kind is opened: a Parquet set this small fits the row-group cache, so it is read at random; with
# no cache to speak of (raised to two row groups) it streams, its samples shuffled in windows of 2 groups.
OPEN = {"parquet-streaming": {"row_group_cache": 0, "shuffle_window": 2}}
STREAMS = {"parquet-streaming"}  # the kinds read in the streaming order (`StreamingOrder`)


@pytest.mark.parametrize("backend", ["torch", "dali"])
@pytest.mark.parametrize("kind", ["packed", "folder", "webdataset", "parquet", "parquet-streaming"])
def test_elastic_resume_of_each_local_data_kind_in_both_loaders(kinds, kind, backend, tmp_path, monkeypatch):
    from dali_fast import open_dataset

    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    reader = open_dataset(kinds[kind], **OPEN.get(kind, {}))
    assert len(reader) == N
    labels = np.array([reader[i][1] for i in range(N)])
    make = loader_maker(backend, reader)
    loader = make(3, rank=0, world_size=2)
    order = loader.order
    loader.close()
    assert type(order) is (StreamingOrder if kind in STREAMS else EpochSampler)
    if kind.startswith("parquet"):
        assert reader.group_rows.tolist() == [4, 4, 2] * 2 + [4, 4, 1] and len(reader.files) == 3
        assert reader.streaming == (kind in STREAMS)
    if kind in STREAMS:  # the window counts row groups
        assert order.bounds.tolist() == reader.shard_bounds.tolist() and order.window == 2
    for old, new in TRANSITIONS:
        run_elastic(make, old, new, labels)


def test_a_loader_with_a_controller_keeps_its_batch_size_and_the_eval_default_is_uneven(index_reader, caplog):
    from dali_fast import BatchSizeController, TorchIterator

    kw = {"image_size": 16, "device": "cpu", "num_workers": 0}
    saved = TorchIterator(index_reader, 4, rank=0, world_size=2, **kw).state_dict()
    ctrl = TorchIterator(index_reader, 4, rank=0, world_size=1, controller=BatchSizeController(2, 64), **kw)
    ctrl.load_state_dict(saved)
    assert ctrl.state_dict()["batch_size"] == 4  # the controller sizes each rank's batch: nothing rescaled
    plain = TorchIterator(index_reader, 4, rank=0, world_size=1, **kw)
    plain.load_state_dict(saved)
    assert plain.state_dict()["batch_size"] == 8
    same = TorchIterator(index_reader, 4, rank=0, world_size=2, **kw)
    with caplog.at_level(logging.INFO, logger="dali_fast.loaders.order"):
        same.load_state_dict({**saved, "batch_size": 6})  # the same world size: the batch size as saved
        ctrl.load_state_dict(saved)
    assert same.batch_size == 6 and caplog.messages == []  # nothing rescaled, nothing said
    assert (plain.even, TorchIterator(index_reader, 4, train=False, **kw).even) == (True, False)
    assert TorchIterator(index_reader, 4, train=False, even=True, **kw).even is True
    assert TorchIterator(index_reader, 4, rank=1, world_size=2, even=False, **kw).order.even is False


# ----------------------------------------------------------------------------- torchrun, SIGKILL, resume


@pytest.mark.slow
def test_torchrun_two_ranks_killed_mid_epoch_then_resumed_on_one(tmp_path):
    """``train`` on 2 processes SIGKILLed right after its first mid-epoch checkpoint, resumed with 1 process:
    the epoch sees each sample of the training split exactly once (the old ranks had not reached their
    padding; one rank needs none), the batch keeps its global size, and the next epoch is the plain order."""
    from train_runs import kill_at_first_checkpoint, skip_without_enough_gpus, train_args, train_command, train_env

    from dali_fast.data.base import split
    from dali_fast.data.open import open_dataset
    from dali_fast.data.pack.packed import pack
    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.train.checkpoint import load_checkpoint, read_index_records

    skip_without_enough_gpus(2)
    make_synthetic(tmp_path / "images", images=121, classes=3, seed=2, progress=False)
    pack(tmp_path / "images", tmp_path / "packed", progress=False)
    data, ck = tmp_path / "packed", tmp_path / "ck"
    extra = ["--checkpoint", str(ck), "--checkpoint-every", "3"]
    kill_at_first_checkpoint(
        train_command(2, train_args(data, "torch", tmp_path, "before") + extra), ck / "checkpoint.pt"
    )
    state = load_checkpoint(ck / "checkpoint.pt")
    cut_step, positions = int(state["step"]), [r["loader"]["sampler"]["position"] for r in state["ranks"]]
    assert not state["epoch_done"] and state["epoch"] == 0 and positions == [15, 15]  # 3 steps of 5, mid-epoch

    proc = subprocess.run(
        train_command(1, train_args(data, "torch", tmp_path, "after") + extra + ["--resume"]),
        env=train_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"resumed from {ck / 'checkpoint.pt'}: epoch 0, step {cut_step}" in lines
    assert "ranks 2 → 1: batch size 5 → 10 per rank, the global batch stays 10" in lines
    before = [
        x for r in (0, 1) for x in read_index_records(tmp_path / f"before.jsonl.rank{r}") if x["step"] <= cut_step
    ]
    after = read_index_records(tmp_path / "after.jsonl")
    assert min(x["step"] for x in after) == cut_step + 1
    reader = open_dataset(data)
    train, _ = split(reader, 0.2, 0)
    epoch0 = [i for x in before + after if x["epoch"] == 0 for i in x["indices"]]
    assert len(train) == 97 and Counter(epoch0) == Counter(train.indices.tolist())  # each exactly once
    assert {len(x["indices"]) for x in after if x["epoch"] == 0} <= {10, (97 - 30) % 10}  # batches of 10
    epoch1 = [i for x in after if x["epoch"] == 1 for i in x["indices"]]
    assert epoch1 == train.indices[EpochSampler(97, seed=0, rank=0, world_size=1).indices(1)].tolist()
    saved = load_checkpoint(ck / "checkpoint.pt")
    assert saved["epoch_done"] and len(saved["ranks"]) == 1 and saved["config"]["world_size"] == 1
