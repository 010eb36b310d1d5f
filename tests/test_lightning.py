"""dali_fast under a real PyTorch Lightning Trainer (no mocks): both iterators, the DataModule, DDP, resume.

The data set's label is the record index, so the labels a callback sees name the samples exactly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from contract import each_once

pl = pytest.importorskip("pytorch_lightning")
from framework_loaders import N, loader, reader  # noqa: E402
from lightning_parts import Model, Recorder  # noqa: E402

from dali_fast.lightning import DaliFastDataModule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["dali", "torch"]


def trainer(recorder, **kw):
    kw.setdefault("max_epochs", 2)
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *kw.pop("callbacks", [])],
        **kw,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_validate_test_predict(backend):
    data = reader()
    model = Model(
        {
            "train": lambda: loader(backend, data),
            "val": lambda: loader(backend, data, train=False),
            "test": lambda: loader(backend, data, train=False),
            "predict": lambda: loader(backend, data, train=False),
        }
    )
    rec = Recorder()
    t = trainer(rec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model)
    assert not [w for w in caught if "shuffl" in str(w.message)]  # validation runs in order
    first, second = rec.epoch(0), rec.epoch(1)
    each_once(first, range(N))
    each_once(second, range(N))
    assert first != second  # a new order each epoch
    sanity, per_epoch = rec.val[:2], rec.val[2:]
    assert [i for b in per_epoch for i in b] == list(range(N)) * 2  # in order, whole, after each epoch
    assert [i for b in sanity for i in b] == list(range(16))
    t.test(model)
    preds = t.predict(model)
    t.validate(model)
    assert [i for b in rec.test for i in b] == list(range(N))
    assert [i for b in rec.predict for i in b] == list(range(N)) and sum(len(p) for p in preds) == N
    assert [i for b in rec.val[-5:] for i in b] == list(range(N))


@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_val_check_interval_and_totals(backend):
    data = reader()
    model = Model({"train": lambda: loader(backend, data), "val": lambda: loader(backend, data, train=False)})
    rec = Recorder()
    t = trainer(rec, max_epochs=1, num_sanity_val_steps=0)
    t.fit(model)
    assert t.num_training_batches == 5 and t.num_val_batches == [5]  # len(loader): the progress bar's totals
    rec = Recorder()
    t = trainer(rec, max_epochs=2, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(model)
    assert [len(rec.epoch(e)) for e in (0, 1)] == [16, 16] and len(rec.val) == 2
    rec = Recorder()
    t = trainer(rec, max_epochs=1, val_check_interval=0.5, num_sanity_val_steps=0, limit_val_batches=1)
    t.fit(model)
    assert len(rec.val) == 2  # validation twice in the epoch


class Preempted(Exception):
    """The job dies here (a preempted node, an out-of-memory kill)."""


class CrashAfter(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Preempted


def _crash_and_resume(make_train, tmp_path) -> tuple[list[int], list[int], Recorder, Recorder]:
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    model = Model({"train": make_train})
    first = Recorder()
    t = trainer(
        first, max_epochs=2, callbacks=[ckpt, CrashAfter(7)], enable_checkpointing=True, default_root_dir=tmp_path
    )
    with pytest.raises(Preempted):
        t.fit(model)  # epoch 0: 5 batches; epoch 1: stops after step 7, the last checkpoint is at step 6
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 6 and saved["epoch"] == 1
    second = Recorder()
    t2 = trainer(second, max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path / "second")
    t2.fit(Model({"train": make_train}), ckpt_path=tmp_path / "last.ckpt")
    before = [i for ep, labels in first.train[:6] if ep == 1 for i in labels]  # what the checkpoint covers
    return before, second.epoch(1), first, second


@pytest.mark.parametrize("backend", BACKENDS)
def test_crash_after_a_mid_epoch_checkpoint_then_resume_sees_each_sample_once(backend, tmp_path):
    data = reader()
    before, after, _, second = _crash_and_resume(lambda: loader(backend, data), tmp_path)
    assert len(before) == 8  # one batch of epoch 1 was in the checkpoint
    each_once(before + after, range(N), what="the epoch over both runs")
    assert second.epoch(0) == []  # epoch 0 was not run again


def test_plain_dataloader_in_the_same_crash_repeats_and_skips(tmp_path):
    """The yardstick: the same scenario with torch's DataLoader, measured, not assumed."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.zeros(N, 3, 16, 16), torch.arange(N))
    before, after, _, _ = _crash_and_resume(lambda: DataLoader(data, batch_size=8, shuffle=True), tmp_path)
    counts = Counter(before + after)
    repeated = sum(c - 1 for c in counts.values() if c > 1)
    skipped = N - len(counts)
    (tmp_path / "plain.json").write_text(json.dumps({"repeated": repeated, "skipped": skipped}))
    assert repeated > 0 or skipped > 0, "the plain DataLoader resumed exactly; the comparison no longer holds"


@pytest.mark.parametrize("backend", BACKENDS)
def test_datamodule_one_line(backend, tmp_path):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    from dali_fast import pack
    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.lightning import DaliFastDataModule

    make_synthetic(tmp_path / "img", images=24, classes=3, progress=False)
    pack(tmp_path / "img", tmp_path / "packed", progress=False)
    dm = DaliFastDataModule(
        train=tmp_path / "packed", val=tmp_path / "img", batch_size=6, backend=backend, image_size=16, device="cpu"
    )
    model = Model()
    model.lin = torch.nn.Linear(3 * 16 * 16, 3)
    rec = Recorder()
    trainer(rec, max_epochs=1, num_sanity_val_steps=0).fit(model, datamodule=dm)
    assert len(rec.epoch(0)) == 24 and sum(len(b) for b in rec.val) == 24
    with pytest.raises(ValueError, match="at least one data set"):
        DaliFastDataModule()
    from dali_fast.transforms.recipe import Recipe

    recipe = Recipe(image_size=24, auto_augment="randaugment", random_erasing=0.25)
    dm = DaliFastDataModule(train=tmp_path / "packed", batch_size=6, backend=backend, recipe=recipe, device="cpu")
    made = dm.train_dataloader()
    assert made.recipe is recipe and made.image_size == 24  # the recipe reaches the loader as given
    dm.teardown("fit")


def test_datamodule_checks_paths_when_made_and_refuses_a_stage_without_data(tmp_path):
    """A wrong path is refused by the constructor (not at its stage, later), in one line naming the split;
    trainer.test()/validate()/predict()/fit() without that stage's data set raise instead of running 0 batches."""
    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.lightning import DaliFastDataModule

    make_synthetic(tmp_path / "img", images=12, classes=3, progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "note.txt").write_text("x")
    refused = [
        ({"train": tmp_path / "img", "val": tmp_path / "nope"}, FileNotFoundError, f"val={str(tmp_path / 'nope')!r}"),
        ({"test": str(tmp_path / "shards-{000..001}.tar")}, FileNotFoundError, "the pattern matches no file"),
        ({"train": tmp_path / "empty"}, ValueError, "not a data set"),
        ({"predict": tmp_path / "note.txt"}, ValueError, "not a data set"),
        ({"train": 3}, ValueError, "pass a data set path"),
    ]
    for kw, error, text in refused:
        with pytest.raises(error) as e:
            DaliFastDataModule(**kw, backend="torch")
        assert str(e.value).startswith("DaliFastDataModule: ") and text in str(e.value) and "\n" not in str(e.value)
    dm = DaliFastDataModule(train=tmp_path / "img", batch_size=4, backend="torch", image_size=16, device="cpu")
    model = Model()
    model.lin = torch.nn.Linear(3 * 16 * 16, 3)
    for stage, split in (("test", "test"), ("validate", "val"), ("predict", "predict")):
        with pytest.raises(ValueError) as e:
            getattr(trainer(Recorder()), stage)(model, datamodule=dm)
        assert str(e.value) == (
            f"DaliFastDataModule has no {split} data set, so trainer.{stage}() has nothing to run; "
            f"pass {split}=PATH to DaliFastDataModule"
        )
    only_val = DaliFastDataModule(val=tmp_path / "img", backend="torch", image_size=16, device="cpu")
    with pytest.raises(ValueError, match=r"^DaliFastDataModule has no train data set, so trainer.fit\(\)"):
        trainer(Recorder(), max_epochs=1).fit(model, datamodule=only_val)
    rec = Recorder()  # fitting without val= is fine: no validation
    trainer(rec, max_epochs=1, num_sanity_val_steps=0).fit(model, datamodule=dm)
    assert len(rec.epoch(0)) == 12 and rec.val == []
    dm.teardown("fit")


class SizeRecorder(Recorder):
    """Also the image side of each training and validation batch."""

    def __init__(self):
        super().__init__()
        self.train_sides: list[tuple[int, int]] = []
        self.val_sides: set[int] = set()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        self.train_sides.append((trainer.current_epoch, batch[0].shape[-1]))

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        super().on_validation_batch_end(trainer, module, outputs, batch, batch_idx, dataloader_idx)
        self.val_sides.add(batch[0].shape[-1])


class PooledModel(Model):
    """Any image size: the mean colour of the image, then a linear layer."""

    def __init__(self, classes):
        super().__init__()
        self.lin = torch.nn.Linear(3, classes)

    def forward(self, x):
        return self.lin(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_datamodule_progressive_resizing(backend, tmp_path):
    """Lightning's own set_epoch calls drive the schedule: each training epoch at its size, each sample once;
    validation at the recipe's image_size."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    from dali_fast import Progressive, Recipe
    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.lightning import DaliFastDataModule

    make_synthetic(tmp_path / "img", images=24, classes=3, progress=False)
    ramp = Progressive(16, 32, start_epoch=0, end_epoch=2, step=8)
    recipe = Recipe(image_size=40, resolution=ramp)
    dm = DaliFastDataModule(
        train=tmp_path / "img", val=tmp_path / "img", batch_size=6, backend=backend, recipe=recipe, device="cpu"
    )
    rec = SizeRecorder()
    trainer(rec, max_epochs=3, num_sanity_val_steps=0).fit(PooledModel(3), datamodule=dm)
    for epoch in range(3):
        assert sorted(rec.epoch(epoch)) == sorted(i for i in range(3) for _ in range(8))  # 24 images, 3 classes
        assert {side for e, side in rec.train_sides if e == epoch} == {ramp(epoch)}
    assert [ramp(e) for e in range(3)] == [16, 24, 32] and rec.val_sides == {40}


DDP_SCRIPT = """
import json, os, sys
sys.path.insert(0, {helpers!r})
import pytorch_lightning as pl, torch
from framework_loaders import loader, reader
from lightning_parts import Model, Recorder, leave_group
backends, out = sys.argv[1].split(","), sys.argv[2]
data = reader()
for backend in backends:  # one launch, one process group, a Trainer per backend
    rec = Recorder()
    model = Model({{"train": lambda: loader(backend, data, batch_size=4)}})
    t = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[rec])
    t.fit(model)
    with open(os.path.join(out, f"{{backend}}-rank{{t.global_rank}}.json"), "w") as f:
        json.dump({{"epochs": [rec.epoch(0), rec.epoch(1)], "world": t.world_size}}, f)
leave_group()
"""


@pytest.mark.slow
def test_ddp_two_processes_shard_each_epoch(tmp_path):
    backends = [b for b in BACKENDS if b != "dali" or importlib.util.find_spec("nvidia.dali")]
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT.format(helpers=str(ROOT / "tests" / "helpers")))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(script), ",".join(backends), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for backend in backends:
        check_ddp_shards([json.loads((tmp_path / f"{backend}-rank{r}.json").read_text()) for r in (0, 1)])


def check_ddp_shards(ranks: list[dict]) -> None:
    """Two ranks, two epochs: equal shards (DDP must not hang), disjoint but for one padded sample."""
    assert all(r["world"] == 2 for r in ranks)
    for e in (0, 1):
        shards = [r["epochs"][e] for r in ranks]
        assert len(shards[0]) == len(shards[1]) == 19  # equal: DDP must not hang
        each_once(shards[0] + shards[1], range(N), padding=1)  # one padded sample
        counts = Counter(shards[0] + shards[1])
        assert not set(shards[0]) & set(shards[1]) - {i for i, c in counts.items() if c > 1}
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]


def test_datamodule_restores_its_loader_where_lightning_counts_the_epoch_as_not_started(tmp_path):
    """Two preemptions: the first right after the checkpoint of epoch 0's last batch (step 10), the second two
    batches into epoch 1 (checkpoint at step 12). Restored from the first, Lightning 2.6 skips epoch 1's start
    in its counters, so restored from the second it takes epoch 1 as not started and does not restore the
    loader: the epoch came again from its first sample (8 samples twice). The DataModule restores its
    training loader itself, from its own state in the checkpoint: epoch 1 holds each sample once."""
    data = reader()

    class Stop(pl.Callback):
        def __init__(self, step):
            self.step = step

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == self.step:
                raise Preempted

    def run(stop, ckpt_path):
        rec = Recorder()
        keep = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
        module = DaliFastDataModule(train=data, batch_size=4, backend="torch", image_size=16, seed=1, num_workers=0)
        t = trainer(rec, callbacks=[keep, *([Stop(stop)] if stop else [])], enable_checkpointing=True,
                    default_root_dir=tmp_path)  # fmt: skip
        with contextlib.suppress(Preempted):
            t.fit(Model(), datamodule=module, ckpt_path=ckpt_path)
        return rec

    run(11, None)  # epoch 0: 10 batches (the last of 1 sample); checkpoints at 2, 4, ..., 10
    second = run(13, next(tmp_path.glob("*step=10.ckpt")))
    third = run(None, next(tmp_path.glob("*step=12.ckpt")))
    each_once(second.epoch(1)[:8] + third.epoch(1), range(N), what="epoch 1 over the last two runs")
