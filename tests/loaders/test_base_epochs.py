"""The epoch driver (`LoaderBase`) on every backend: each sample exactly once per epoch whatever the
prefetch depth, batch size, `break` or rank; one pass at a time; `close()` mid-pass; what it tells a
DataLoader's user."""

from __future__ import annotations

import pytest
import torch
from builders import first_batch
from contract import each_once, run_close_mid_pass
from fakes import ScriptedController
from loader_cases import epoch_labels


def test_exactly_once_per_epoch_shuffled(make, index_reader):
    loader = make(index_reader, 8, seed=3)
    orders = []
    for epoch in range(3):
        labels, sizes = epoch_labels(loader, epoch)
        each_once(labels, range(37))
        assert sizes == [8, 8, 8, 8, 5] and len(loader) == 5
        orders.append(labels)
    assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_exactly_once_any_prefetch_depth(make, index_reader, prefetch):
    # TorchIterator: worker processes, where prefetch_factor decides how far ahead batches are made
    extra = {"num_workers": 2} if make.backend == "torch" else {}
    loader = make(index_reader, 6, prefetch=prefetch, **extra)
    for epoch in range(2):
        labels, sizes = epoch_labels(loader, epoch)
        each_once(labels, range(37))
        assert sizes == [6] * 6 + [1]
    labels, _ = epoch_labels(loader, 2, limit=2)  # leave with batches in flight
    assert len(labels) == 12
    each_once(epoch_labels(loader, 3)[0], range(37))


def test_close_mid_pass_contract(make, index_reader):
    """close() between two batches: one rule for every backend (the pass raises that it was closed, nothing
    more is yielded), checked by the shared contract, with worker processes working ahead (TorchIterator)
    and a deep DALI prefetch."""
    extra = {"num_workers": 2} if make.backend == "torch" else {"prefetch": 3}
    run_close_mid_pass(lambda: make(index_reader, 5, seed=9, **extra), midpoint=3)


def test_close_mid_pass_releases_what_the_pass_holds_at_once(make, index_reader, monkeypatch):
    """close() mid-pass releases the pass's own pipeline or worker processes now, not when the pass is
    dropped: DALI's pipeline is shut down, TorchIterator's workers have exited."""
    import multiprocessing

    shut = []
    if make.backend == "dali":
        import dali_fast.loaders.dali_iterator as di

        real = di.shutdown_pipeline
        monkeypatch.setattr(di, "shutdown_pipeline", lambda pipe: (shut.append(pipe), real(pipe)))
    loader = make(index_reader, 4, **({"num_workers": 2} if make.backend == "torch" else {}))
    it = iter(loader)
    next(it)
    before = set(multiprocessing.active_children())
    loader.close()
    if make.backend == "dali":
        assert len(shut) == 1  # the pipeline the pass was running
    else:
        assert len(before) == 2 and not set(multiprocessing.active_children()) & before
    with pytest.raises(RuntimeError, match=r"^this pass over the loader ended when the loader was closed"):
        next(it)


def test_batch_size_changes_between_epochs(make, index_reader):
    ctrl = ScriptedController([8, 16, 5, 32, 3, 11])
    loader = make(index_reader, 8, controller=ctrl)
    for epoch, bs in enumerate(ctrl.sizes):
        assert loader.batch_size == bs
        expected_len = len(loader)
        labels, sizes = epoch_labels(loader, epoch)
        each_once(labels, range(37), what=f"epoch {epoch} at batch size {bs}")
        assert max(sizes) == bs and len(sizes) == expected_len


def test_batch_size_setter_between_epochs_only(make, index_reader):
    loader = make(index_reader, 8)
    loader.batch_size = 10
    labels, sizes = epoch_labels(loader, 0)
    assert sorted(labels) == list(range(37)) and sizes == [10, 10, 10, 7]
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="between epochs"):
        loader.batch_size = 4
    it.close()


def test_break_then_next_epoch_exactly_once(make, index_reader):
    loader = make(index_reader, 4, prefetch=3)
    first, _ = epoch_labels(loader, 0, limit=2)
    assert len(first) == 8
    for epoch in (1, 2):
        labels, _ = epoch_labels(loader, epoch)
        each_once(labels, range(37))


def test_drop_last_drops_only_the_tail(make, index_reader):
    loader = make(index_reader, 8, drop_last=True)
    assert len(loader) == 4
    labels, sizes = epoch_labels(loader, 0)
    assert sizes == [8, 8, 8, 8] and len(set(labels)) == 32
    full = make(index_reader, 8)
    full_labels, _ = epoch_labels(full, 0)
    assert labels == full_labels[:32]  # the same order, only the tail is missing


def test_looping_again_without_set_epoch_moves_to_next_epoch(make, index_reader):
    loader = make(index_reader, 8)
    a, _ = epoch_labels(loader)
    b, _ = epoch_labels(loader)
    assert sorted(a) == sorted(b) == list(range(37)) and a != b and loader.epoch == 1


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_disjoint_cover_equal_batches(make, index_reader, world):
    per_rank = []
    for rank in range(world):
        loader = make(index_reader, 4, rank=rank, world_size=world, drop_last=False)
        labels, sizes = epoch_labels(loader, 1)
        per_rank.append((labels, len(sizes)))
    assert len({n for _, n in per_rank}) == 1  # same number of batches on every rank
    each_once((x for labels, _ in per_rank for x in labels), range(37), padding=world - 1)  # only the wrap-around


def test_same_seed_epoch_same_batches(make, index_reader):
    a, b = make(index_reader, 8, seed=5), make(index_reader, 8, seed=5)
    a.set_epoch(2)
    b.set_epoch(2)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb)
        assert torch.equal(xa, xb)


def test_peek_then_train_loses_nothing(make, index_reader):
    loader = make(index_reader, 8, seed=1)
    images, labels = first_batch(loader)  # look at the shapes first
    assert images.shape[0] == 8
    labels0, sizes = epoch_labels(loader, 0)
    assert sorted(labels0) == list(range(37)) and sizes == [8, 8, 8, 8, 5]
    assert labels0[:8] == labels.tolist()  # the peeked batch comes again, in its place


def test_break_then_iter_again_restarts_the_epoch(make, index_reader):
    loader = make(index_reader, 8, seed=1)
    loader.set_epoch(2)
    first, _ = epoch_labels(loader, limit=2)
    again, _ = epoch_labels(loader)
    assert sorted(again) == list(range(37)) and again[:16] == first and loader.epoch == 2


def test_a_new_pass_abandons_the_running_one_which_then_refuses_in_one_line(make, index_reader):
    """As with a DataLoader, iter() (or set_epoch, load_state_dict) starts over; the old pass, if used
    again, raises instead of silently sharing or losing batches."""
    loader = make(index_reader, 8)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="between epochs"):
        loader.batch_size = 4
    for start_over in (
        lambda: iter(loader),
        lambda: loader.set_epoch(0),
        lambda: loader.load_state_dict(loader.state_dict()),
    ):
        new = start_over()
        with pytest.raises(RuntimeError) as e:
            next(it)
        assert str(e.value) == (
            "this pass over the loader was abandoned when another started (iter(), set_epoch() or "
            "load_state_dict()); iterate one pass at a time"
        )
        it = iter(loader) if new is None else new
        next(it)
    rest = [x for _, lab in it for x in lab.tolist()]
    assert len(rest) == 37 - 16  # the last pass (resumed at 8, one batch taken) runs on undisturbed
    assert sorted(epoch_labels(loader, 5)[0]) == list(range(37))


def test_iter_then_set_epoch_then_next_as_lightning_calls_them(make, index_reader):
    loader = make(index_reader, 8, seed=3)
    epoch_labels(loader, 0)
    it = iter(loader)
    loader.set_epoch(4)  # between iter() and the first next(): the pass covers epoch 4
    labels = [x for _, lab in it for x in lab.tolist()]
    assert labels == epoch_labels(make(index_reader, 8, seed=3), 4)[0]


def test_last_indices_name_the_records_of_the_last_batch(make, index_reader):
    loader = make(index_reader, 8, seed=2)
    loader.set_epoch(1)
    for _, labels in loader:
        assert loader.last_indices.tolist() == labels.tolist()  # labels are the record indices here


def test_cache_serves_second_epoch(make, index_reader):
    loader = make(index_reader, 8, cache_bytes=10**7)
    epoch_labels(loader, 0)
    epoch_labels(loader, 1)
    s = loader.cache_stats()
    assert s["misses"] == 37 and s["hits"] == 37 and s["hit_rate"] == 0.5


def test_dataloader_attributes_tell_the_truth(make, index_reader):
    from torch.utils.data import Sampler

    loader = make(index_reader, 8, drop_last=False)
    assert len(loader) == 5 and loader.batch_size == 8 and loader.drop_last is False
    assert loader.batch_sampler is None and loader.dataset is index_reader and len(loader.dataset) == 37
    assert isinstance(loader.sampler, Sampler) and len(loader.sampler) == 37
    loader.batch_size = 16
    assert len(loader) == 3  # len() follows the batch size
    loader.sampler.set_epoch(3)  # what Lightning calls: the loader's own set_epoch
    labels, sizes = epoch_labels(loader)
    assert loader.epoch == 3 and sizes == [16, 16, 5] and labels == list(loader.sampler)
    assert make(index_reader, 8, rank=1, world_size=2).sampler.__len__() == 19
