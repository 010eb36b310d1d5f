"""TorchIterator's main-process side of its workers: the slot ring's accounting, how a pass's
batches are dealt to the workers, and the outputs handed to the consumer."""

from __future__ import annotations

import pytest
import torch

from dali_fast.loaders.torch_slots import OutputPool, SlotRing, image_shape, slot_layout


class FakeEvent:
    """Stands in for a CUDA event: records whether the ring waited for it."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_ring_hands_out_each_slot_once_and_refuses_to_overbook():
    ring = SlotRing(3, 4, (3, 8, 8))
    assert ring.buffer.is_shared() and ring.buffer.shape == (3, 4, 3, 8, 8)
    got = [ring.take() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no free batch slot"):
        ring.take()  # a fourth batch in flight would overwrite one in use
    ring.give_back(got[1])
    assert ring.take() == got[1]
    ring.give_back(got[0])
    with pytest.raises(RuntimeError, match="given back twice"):
        ring.give_back(got[0])
    ring.reset()
    assert sorted(ring.take() for _ in range(3)) == [0, 1, 2]


def test_a_slot_still_read_by_a_device_copy_is_waited_for_before_reuse():
    """On a GPU the copy out of a slot runs asynchronously: the slot goes to a worker only after it ends."""
    waited: list[str] = []
    ring = SlotRing(2, 1, (3, 4, 4), shared=False)
    a, b = ring.take(), ring.take()
    ring.give_back(a, FakeEvent(waited, "copy of a"))
    ring.give_back(b)
    assert waited == []
    assert ring.take() == a and waited == ["copy of a"]  # waited at hand-out, not before
    assert ring.take() == b and waited == ["copy of a"]
    ring.give_back(a, FakeEvent(waited, "second copy of a"))
    ring.reset()  # a new pass: the pending copy is still waited for when the slot is taken
    assert ring.take() == 0 and waited[-1] == "second copy of a"
    ring.give_back(0, FakeEvent(waited, "last"))
    ring.close()
    assert waited[-1] == "last" and ring.buffer.numel() == 0


def test_layouts():
    assert slot_layout(torch.channels_last) == "HWC" and slot_layout(torch.contiguous_format) == "CHW"
    assert image_shape("HWC", 5) == (5, 5, 3) and image_shape("CHW", 5) == (3, 5, 5)


def test_a_batch_is_split_evenly_among_the_workers_in_parts_of_four_or_more():
    from dali_fast.loaders.torch_slots import split

    assert split(32, 2) == [(0, 16), (16, 32)]
    assert split(37, 3) == [(0, 12), (12, 24), (24, 37)]
    assert split(7, 2) == [(0, 7)]  # under two parts of 4: whole
    assert split(9, 8) == [(0, 4), (4, 9)]
    assert split(256, 8) == [(32 * k, 32 * (k + 1)) for k in range(8)]
    assert split(5, 1) == [(0, 5)] and split(1, 4) == [(0, 1)]


def test_batches_go_whole_to_a_worker_except_the_passs_last_ones():
    """One task per batch (a worker's cost per task paid once per batch); the pass's last batches split, so
    the pass ends with every worker busy."""
    from dali_fast.loaders.torch_iterator import _PlanSampler
    from dali_fast.loaders.torch_slots import batch_parts

    assert [batch_parts(b, 5, 32, 2) for b in range(5)] == [[(0, 32)]] * 2 + [[(0, 16), (16, 32)]] * 3
    assert [batch_parts(b, 4, 32, 2) for b in range(4)] == [[(0, 32)]] * 2 + [[(0, 16), (16, 32)]] * 2
    assert batch_parts(0, 1, 32, 2) == [(0, 16), (16, 32)]  # a pass of one batch
    assert batch_parts(1, 2, 7, 2) == [(0, 7)]  # too small to split
    assert [batch_parts(b, 4, 40, 1) for b in range(4)] == [[(0, 40)]] * 4  # one process

    sizes = [12] * 6 + [5]
    plan = _PlanSampler()
    plan.keys = [[(i, 0) for i in range(12 * b, 12 * b + n)] for b, n in enumerate(sizes)]
    plan.sizes, plan.workers, plan.ring = sizes, 3, SlotRing(7, 12, (3, 2, 2), shared=False)
    tasks = list(plan)
    assert len(tasks) == len(plan) == 3 + 3 * 3 + 1  # 3 whole, 3 split in 3, and 5 images stay whole
    assert [(t.part, t.parts, t.offset, len(t.keys)) for t in tasks[3:6]] == [(0, 3, 0, 4), (1, 3, 4, 4), (2, 3, 8, 4)]
    assert [k for t in tasks for k in t.keys] == [k for keys in plan.keys for k in keys]  # each key once, in order
    assert len({t.slot for t in tasks}) == 7  # a slot per batch


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("images", [400, 401, 1000, 96, 33])
def test_workers_dealt_tasks_in_turn_get_the_same_number_of_images(workers, images):
    """DataLoader deals tasks to its workers in turn: each worker must get as many images as the others
    (within one part), or it ends the pass while the others still decode (measured on 2 cpus: one worker
    with a whole batch more, the other idle for the last 40 ms of a 300 ms epoch)."""
    from dali_fast.loaders.torch_slots import batch_parts

    sizes = [32] * (images // 32) + ([images % 32] if images % 32 else [])
    got = [0] * workers
    deal = 0
    for b, size in enumerate(sizes):
        for start, stop in batch_parts(b, len(sizes), size, workers):
            got[deal % workers] += stop - start
            deal += 1
    assert sum(got) == images
    assert max(got) - min(got) <= 32 // workers, got


def test_a_refused_page_lock_is_said_once_and_copies_still_work(monkeypatch, caplog):
    """Where CUDA refuses to page-lock the slots, the ring says so and stays usable (copies then wait)."""
    import logging

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
            calls.append((ptr, size, flags))
            return 1  # cudaErrorInvalidValue

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    ring = SlotRing(2, 3, (3, 4, 4))
    with caplog.at_level(logging.WARNING):
        assert ring.pin() is False
    assert calls == [(ring.buffer.data_ptr(), ring.buffer.numel(), 0)]
    assert "could not page-lock the batch slots (CUDA error 1)" in caplog.text
    assert ring.take() == 0 and not ring._pinned  # noqa: SLF001
    ring.close()  # nothing to unregister


# ----------------------------------------------------------------------------- the main process's outputs

SPEC = ((4, 3, 8, 8), torch.float32, torch.contiguous_format)


def _hold_tensor(t):
    return t


def _hold_view(t):
    return t[1:].view(-1)


def _hold_numpy(t):
    return t.numpy()


def _hold_storage(t):
    return t.untyped_storage()


def _read(kept) -> torch.Tensor:
    """What a holder reaches, as float values."""
    if isinstance(kept, list):
        return kept[0]
    if isinstance(kept, torch.UntypedStorage):
        return torch.empty(0).set_(kept, 0, SPEC[0])
    return torch.as_tensor(kept)


def _hold_dlpack_import(t):
    return torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))


def _hold_from_numpy(t):
    return torch.from_numpy(t.numpy()[2:])


def _hold_list(t):
    return [t.unsqueeze(0)]


HOLDERS = [_hold_tensor, _hold_view, _hold_numpy, _hold_storage, _hold_dlpack_import, _hold_from_numpy, _hold_list]


@pytest.mark.skipif(not OutputPool.COUNTED, reason="this torch does not count tensor references")
@pytest.mark.parametrize("hold", HOLDERS, ids=lambda f: f.__name__[6:])
def test_an_output_anything_still_reaches_is_never_handed_out_again(hold):
    pool = OutputPool(keep=3)
    out = pool.get(*SPEC)
    out.fill_(7)
    kept, address = hold(out), out.data_ptr()
    del out
    for _ in range(5):  # a full pool's worth of batches and more: each a new tensor while ``kept`` lives
        other = pool.get(*SPEC)
        assert other.data_ptr() != address
        other.fill_(-1)
        del other
    assert pool.reused == 4  # the other outputs, released at once, were reused
    assert (_read(kept) == 7).all()  # untouched
    del kept
    pool.get(*SPEC)  # the oldest outputs dropped out of the pool meanwhile: whatever comes is unheld
    assert pool.reused == 5


@pytest.mark.skipif(not OutputPool.COUNTED, reason="this torch does not count tensor references")
def test_an_output_released_is_handed_out_again_unless_it_changed():
    pool = OutputPool(keep=3)
    first = pool.get(*SPEC)
    address = first.data_ptr()
    del first
    again = pool.get(*SPEC)
    assert again.data_ptr() == address and pool.reused == 1  # no new memory, no page faults
    again.requires_grad_()  # a consumer made it a leaf of a graph: a fresh tensor is not one
    del again
    assert pool.get(*SPEC).data_ptr() != address
    tagged = pool.get(*SPEC)
    tagged.note = "mine"  # an attribute a fresh tensor would not have
    tagged_address = tagged.data_ptr()
    del tagged
    assert pool.get(*SPEC).data_ptr() != tagged_address
    assert pool.get((2, 3, 8, 8), torch.float32, torch.contiguous_format).shape == (2, 3, 8, 8)  # by shape
    chl = pool.get((4, 3, 8, 8), torch.float32, torch.channels_last)
    assert chl.is_contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        inner = pool.get(*SPEC)
    assert inner.is_inference() and not pool.get(*SPEC).is_inference()  # never mixed across the mode


@pytest.mark.skipif(not OutputPool.COUNTED, reason="this torch does not count tensor references")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_a_consumer_keeps_are_never_overwritten(index_reader, num_workers):
    """A consumer that keeps every batch (or views of them) still has what it was given; one that lets
    each go gets the same pixels from reused outputs."""
    from dali_fast import TorchIterator

    loader = TorchIterator(index_reader, 4, image_size=16, seed=1, num_workers=num_workers, device="cpu")
    try:
        loader.set_epoch(2)
        kept = [(x, x.clone()) for x, _ in loader]
        loader.set_epoch(3)
        views = [(x[1:3], x[1:3].clone()) for x, _ in loader]
        assert len({x.data_ptr() for x, _ in kept}) == len(kept) == 10
        assert all(torch.equal(x, copy) for x, copy in kept + views)
        reused = loader._outputs.reused  # noqa: SLF001
        loader.set_epoch(2)
        released, pooled = [], 0
        for x, _ in loader:  # each batch let go at the next step
            released.append(x.clone())
            pooled += any(o.tensor.data_ptr() == x.data_ptr() for o in loader._outputs._outputs)  # noqa: SLF001
        assert pooled == len(released)  # every batch is one of the pool's outputs
        assert loader._outputs.reused >= reused + 7  # noqa: SLF001 - the outputs were reused
        assert all(torch.equal(x, copy) for x, (_, copy) in zip(released, kept, strict=True))
    finally:
        loader.close()
    assert loader._outputs._outputs == []  # noqa: SLF001 - close() lets them go
