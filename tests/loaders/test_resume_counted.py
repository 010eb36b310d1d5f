"""A framework that counts an epoch's batches (``len``) before it restores the loader, as Lightning does,
cannot finish that epoch at another batch size: such a mid-epoch state is refused in one line (the
preemption fuzz found the epoch ended early, its last samples never delivered, when a Lightning job was
resumed with a loader of another batch size); the same batch size, or a state between epochs, resumes."""

from __future__ import annotations

import pytest
from builders import IndexReader, jpeg_bytes
from contract import each_once

from dali_fast import TorchIterator

N = 37


def _loader(batch_size: int) -> TorchIterator:
    return TorchIterator(IndexReader([jpeg_bytes(20 + i % 5, 18) for i in range(N)]), batch_size, image_size=16,
                         device="cpu", num_workers=0, seed=1)  # fmt: skip


def _mid_epoch_state(batch_size: int = 3, batches: int = 4) -> tuple[list[int], dict]:
    loader = _loader(batch_size)
    it = iter(loader)
    seen = [i for _ in range(batches) for i in (next(it), loader.last_indices.tolist())[1]]
    return seen, loader.state_dict()


def test_a_counted_length_refuses_a_mid_epoch_state_of_another_batch_size():
    seen, state = _mid_epoch_state()
    resumed = _loader(5)
    assert len(resumed) == 8  # counted at batch size 5, as Lightning does before it restores
    with pytest.raises(ValueError) as e:
        resumed.load_state_dict(state)
    assert str(e.value) == (
        "cannot resume mid-epoch at batch size 3: len() counted this epoch's batches at batch size 5, and a "
        "framework that counts them before it restores the loader (Lightning does) would end the epoch after "
        "that count; make the loader with batch_size=3 to finish this epoch (change loader.batch_size between "
        "epochs)"
    )
    assert resumed.order.position == 0 and resumed.batch_size == 5  # refused whole: nothing applied
    same = _loader(3)
    assert len(same) == 13
    same.load_state_dict(state)
    each_once(seen + [i for _ in same for i in same.last_indices.tolist()], range(N))
    uncounted = _loader(5)  # never counted: the state's batch size, as always
    uncounted.load_state_dict(state)
    assert uncounted.batch_size == 3
    between = _loader(5)
    len(between)
    done = _loader(3)
    for _ in done:
        pass
    between.load_state_dict(done.state_dict())  # an epoch's end: any batch size goes on
    between.batch_size = 5
    assert len(between) == 8


def test_lightning_resumed_with_another_batch_size_is_refused_not_short(tmp_path):
    """Under Lightning: a checkpoint mid-epoch at batch size 3 (after 4 batches), restored into a loader made at
    batch size 5. Before, Lightning counted 8 batches at 5, went on from its 4th with batches of 3, and ended
    the epoch after 4 of them: 24 of the 37 samples; now the restore is refused in one line."""
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_parts import Model, Recorder

    class Preempted(Exception):
        pass

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                raise Preempted  # nothing more is saved, as when the job is killed

    def trainer(recorder, *callbacks):
        return pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=[recorder, *callbacks], default_root_dir=tmp_path)  # fmt: skip

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_last=True)
    first = Recorder()
    with pytest.raises(Preempted):
        trainer(first, ckpt, Stop()).fit(Model({"train": lambda: _loader(3)}))
    assert len(first.epoch(0)) == 15  # 5 batches, the checkpoint after 4
    with pytest.raises(
        ValueError, match=r"^cannot resume mid-epoch at batch size 3: len\(\) counted .* at batch size 5"
    ):
        trainer(Recorder()).fit(Model({"train": lambda: _loader(5)}), ckpt_path=tmp_path / "ck" / "last.ckpt")
    second = Recorder()
    trainer(second).fit(Model({"train": lambda: _loader(3)}), ckpt_path=tmp_path / "ck" / "last.ckpt")
    each_once(first.epoch(0)[:12] + second.epoch(0), range(N))


def test_what_counts_as_mid_epoch_and_which_loaders_may_take_another_batch_size():
    """The refusal's edges: one sample into the epoch is mid-epoch, the epoch's start is not; a state from
    before ``finished`` was saved counts as unfinished; another world size (an elastic resume sizes the
    batch itself) and a loader with a controller (it sizes the batch each epoch) take the state."""
    from dali_fast import BatchSizeController

    one = _loader(1)
    it = iter(one)
    next(it)
    after_one = one.state_dict()
    assert after_one["sampler"]["position"] == 1
    counted = _loader(2)
    len(counted)
    with pytest.raises(ValueError, match="cannot resume mid-epoch at batch size 1"):
        counted.load_state_dict(after_one)
    start = _loader(3).state_dict()
    assert start["sampler"]["position"] == 0 and not start["finished"]
    counted.load_state_dict(start)  # nothing delivered yet: any batch size
    _, state = _mid_epoch_state()
    old = {k: v for k, v in state.items() if k != "finished"}  # saved before the key existed
    with pytest.raises(ValueError, match="cannot resume mid-epoch at batch size 3"):
        _refused(old)
    kw = {"image_size": 16, "device": "cpu", "num_workers": 0, "seed": 1}
    reader = IndexReader([jpeg_bytes(20 + i % 5, 18) for i in range(N)])
    two = TorchIterator(reader, 3, rank=0, world_size=2, **kw)
    it = iter(two)
    next(it)
    elastic = TorchIterator(reader, 5, rank=0, world_size=1, **kw)
    len(elastic)
    elastic.load_state_dict(two.state_dict())  # another world size: the elastic rule sets the batch
    assert elastic.batch_size == 6
    ctrl = TorchIterator(reader, 5, controller=BatchSizeController(2, 64), **kw)
    len(ctrl)
    ctrl.load_state_dict(state)  # the controller sizes the batch: nothing refused


def _refused(state: dict) -> None:
    counted = _loader(5)
    len(counted)
    counted.load_state_dict(state)
