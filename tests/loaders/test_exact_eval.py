"""Exact distributed evaluation: an evaluation loader repeats no sample across ranks (so ranks may differ by
one, and ``len()`` is per rank), `gather_outputs` puts every rank's per-sample outputs back in data set order
(on a real gloo group), and ``train``'s held-out accuracy on 2 torchrun ranks equals one process's."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch
from builders import IndexReader, jpeg_bytes
from contract import each_once

from dali_fast import gather_outputs
from dali_fast.loaders.order.streaming import StreamingOrder


def reader97() -> IndexReader:
    """97 records (a prime: 2 ranks cannot share it evenly), labelled by index."""
    colors = [(200, 30, 60), (10, 200, 10), (0, 0, 255)]
    return IndexReader([jpeg_bytes(24 + i % 7, 20 + i % 3, colors[i % 3]) for i in range(97)])


@pytest.fixture(scope="module")
def r97() -> IndexReader:
    return reader97()


def make(backend: str, reader, batch_size: int, **kw):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return DALIIterator(reader, batch_size, image_size=16, device="cpu", **kw)
    from dali_fast import TorchIterator

    return TorchIterator(reader, batch_size, image_size=16, device="cpu", num_workers=0, **kw)


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_97_records_on_2_ranks_each_exactly_once_in_evaluation(r97, backend):
    seen, lengths, batches = [], [], []
    for rank in range(2):
        loader = make(backend, r97, 8, train=False, rank=rank, world_size=2)
        labels = [y for _, ys in loader for y in ys.tolist()]
        seen.append(labels)
        lengths.append(len(loader.order))
        batches.append(len(loader))
        assert labels == sorted(labels) == list(range(rank, 97, 2))  # the data set's order, every 2nd record
        loader.close()
    assert lengths == [49, 48] and batches == [7, 6]  # per rank: len() is this rank's own
    each_once(seen[0] + seen[1], range(97))  # 97 delivered, not 98
    assert len(seen[0]) + len(seen[1]) == 97


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_training_keeps_equal_batches_and_even_is_the_switch(r97, backend):
    """Training pads to equal batches (DDP needs them); ``even=True`` gives an evaluation loop with a
    collective per batch equal batches too, ``even=False`` a training loop none; ``drop_last`` cuts."""
    for kw, delivered, per in (
        ({"train": True}, 98, [49, 49]),
        ({"train": False, "even": True}, 98, [49, 49]),
        ({"train": True, "even": False}, 97, [49, 48]),
        ({"train": False, "drop_last": True}, 96, [48, 48]),
    ):
        got = []
        for rank in range(2):
            loader = make(backend, r97, 16, rank=rank, world_size=2, **kw)
            assert len(loader.order) == per[rank], kw
            got += [i for _ in loader for i in loader.last_indices.tolist()]
            loader.close()
        assert len(got) == delivered, kw
        assert sum(c - 1 for c in Counter(got).values()) == max(0, delivered - 97), kw


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_a_rank_with_nothing_to_evaluate_yields_nothing(backend):
    reader = IndexReader([jpeg_bytes(20, 20) for _ in range(3)])
    shares = []
    for rank in range(4):
        loader = make(backend, reader, 2, train=False, rank=rank, world_size=4)
        shares.append([y for _, ys in loader for y in ys.tolist()])
        assert len(loader) == (rank < 3)
        loader.close()
    assert shares == [[0], [1], [2], []]


def test_the_streaming_order_evaluates_in_contiguous_runs_without_repeats():
    bounds = np.array([0, 8, 16, 24, 31])
    runs = [
        StreamingOrder(bounds, shuffle=False, even=False, rank=r, world_size=3).indices().tolist() for r in range(3)
    ]
    assert [len(r) for r in runs] == [11, 10, 10]
    assert sorted(sum(runs, [])) == list(range(31))
    padded = [StreamingOrder(bounds, shuffle=False, rank=r, world_size=3).indices() for r in range(3)]
    assert [len(r) for r in padded] == [11, 11, 11]


def test_the_baseline_evaluates_without_repeats_under_ddp(r97, monkeypatch):
    from torch.utils.data import DistributedSampler

    from dali_fast.loaders.baseline import RankShare, make_baseline_loader

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = make_baseline_loader(r97, 8, train=False, image_size=16, num_workers=0)
    assert isinstance(loader.sampler, RankShare) and list(loader.sampler) == list(range(1, 97, 2))
    assert len(loader.sampler) == 48 and [y for _, ys in loader for y in ys.tolist()] == list(range(1, 97, 2))
    loader.sampler.set_epoch(3)  # what a DDP loop calls: the same order
    assert list(loader.sampler) == list(range(1, 97, 2))
    train = make_baseline_loader(r97, 8, train=True, image_size=16, num_workers=0)
    assert isinstance(train.sampler, DistributedSampler) and len(train.sampler) == 49
    cut = make_baseline_loader(r97, 8, train=False, drop_last=True, image_size=16, num_workers=0)
    assert isinstance(cut.sampler, DistributedSampler) and len(cut.sampler) == 48


# ---------------------------------------------------------------------------------------- gather_outputs


def test_gather_outputs_in_one_process_orders_and_keeps_each_index_once():
    rows = torch.tensor([[5.0, 0.5], [1.0, 0.1], [3.0, 0.3], [1.0, 0.1]])
    got = gather_outputs(rows, np.array([5, 1, 3, 1]))
    assert torch.equal(got, torch.tensor([[1.0, 0.1], [3.0, 0.3], [5.0, 0.5]]))
    flags = gather_outputs(torch.tensor([True, False, True]), torch.tensor([2, 0, 1]))
    assert flags.dtype == torch.bool and flags.tolist() == [False, True, True]
    assert gather_outputs(torch.zeros(0, 4), []).shape == (0, 4)
    with pytest.raises(ValueError) as e:
        gather_outputs(torch.zeros(3), [0, 1])
    assert str(e.value) == "3 rows of outputs but 2 indices: give the data set index of each row"


def _evaluate(loader) -> tuple[torch.Tensor, np.ndarray]:
    """Per-sample outputs of an evaluation pass (the label and the image's mean) and their indices."""
    rows, seen = [], []
    for images, labels in loader:
        rows.append(torch.stack([labels.double(), images.double().mean(dim=(1, 2, 3))], 1))
        seen.append(loader.last_indices.copy())
    return torch.cat(rows), np.concatenate(seen)


def _gather_on_a_rank(rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        reader, out = reader97(), {}
        for even in (False, True):  # the rows of a padded loader's repeat are kept once
            loader = make("torch", reader, 8, train=False, even=even)  # the rank from the process group
            rows, seen = _evaluate(loader)
            out[f"even={even}"] = (gather_outputs(rows, seen), len(seen))
        flags = torch.tensor([rank == 0] * (3 - 3 * rank), dtype=torch.bool)  # rank 1 holds no rows at all
        out["flags"] = gather_outputs(flags, [5, 1, 1][: len(flags)])
        try:
            gather_outputs(torch.zeros(2, 1 + rank), [0, 1])  # rows of another shape on rank 1
        except ValueError as e:
            out["refused"] = str(e)
        torch.save(out, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_gather_outputs_across_two_gloo_ranks_equals_one_process(r97, tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_gather_on_a_rank, args=(r, 2, str(tmp_path / "init"), str(tmp_path / "out")))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    single, _ = _evaluate(make("torch", r97, 8, train=False, rank=0, world_size=1))
    got = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    for even, counts in ((False, [49, 48]), (True, [49, 49])):
        assert [g[f"even={even}"][1] for g in got] == counts
        for g in got:  # every rank has all 97 rows, in data set order, each once: the one-process result
            rows = g[f"even={even}"][0]
            assert rows[:, 0].tolist() == list(range(97))
            torch.testing.assert_close(rows, single, rtol=1e-6, atol=0)
    assert [g["flags"].tolist() for g in got] == [[True, True], [True, True]]
    said = (
        "gather_outputs: the ranks' rows differ in dtype or shape (rank 0: torch.float32 [1], rank 1: "
        "torch.float32 [2]); give every rank the same kind of rows"
    )
    assert [g["refused"] for g in got] == [said, said]


# ------------------------------------------------------------------------------- train on torchrun


@pytest.mark.slow
def test_train_s_held_out_accuracy_on_two_ranks_equals_one_process_s(tmp_path):
    """2 torchrun ranks train one epoch, then evaluate the 23 held-out images (12 + 11); the same weights
    evaluated by one process give the same accuracy (and loss). Before, 24 were counted (one twice) and
    rank 1 used its own BatchNorm statistics."""
    from train_runs import skip_without_enough_gpus, train_command, train_env

    from dali_fast.data.base import split
    from dali_fast.data.open import open_dataset
    from dali_fast.data.pack.packed import pack
    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.loaders.factory import make_loader
    from dali_fast.train.checkpoint import load_checkpoint
    from dali_fast.train.trainer import Trainer
    from dali_fast.transforms.recipe import Recipe

    skip_without_enough_gpus(2)
    make_synthetic(tmp_path / "images", images=116, classes=3, seed=3, progress=False)
    pack(tmp_path / "images", tmp_path / "packed", progress=False)
    args = [
        "train", str(tmp_path / "packed"), "--loader", "torch", "--epochs", "1", "--model", "resnet_tiny",
        "--image-size", "32", "--batch-size", "5", "--num-workers", "0",
        "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.run(train_command(2, args), env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((tmp_path / "out" / "train.json").read_text())["rows"][0]
    assert row["ranks"] == 2
    _, held_out = split(open_dataset(tmp_path / "packed"), 0.2, 0)
    assert len(held_out) == 23
    trainer = Trainer("resnet_tiny", 3, amp=False)
    trainer.load_state_dict(load_checkpoint(tmp_path / "ck" / "checkpoint.pt")["trainer"])
    kw = {"image_size": 32, "seed": 0, "num_workers": 0, "recipe": Recipe(image_size=32)}
    loss, acc = trainer.evaluate(make_loader(held_out, 5, backend="torch", train=False, rank=0, world_size=1, **kw))
    assert row["val_acc"] == acc and 0 < acc < 1  # correct / 23 on both sides
    assert row["val_loss"] == pytest.approx(loss, rel=1e-5)


LIGHTNING_DDP = """
import json, os, sys
sys.path.insert(0, {helpers!r})
import pytorch_lightning as pl
from framework_loaders import loader, reader
from lightning_parts import Model, Recorder, leave_group
backends, out = sys.argv[1].split(","), sys.argv[2]
data = reader()
for backend in backends:  # one launch, one process group, a Trainer per backend
    rec = Recorder()
    model = Model({{"train": lambda: loader(backend, data, batch_size=4),
                    "val": lambda: loader(backend, data, batch_size=4, train=False)}})
    t = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, num_sanity_val_steps=0,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[rec])
    t.fit(model)
    with open(os.path.join(out, f"{{backend}}-rank{{t.global_rank}}.json"), "w") as f:
        json.dump({{"val": rec.val, "batches": t.num_val_batches}}, f)
leave_group()
"""


@pytest.mark.slow
def test_lightning_ddp_validation_sees_each_record_once_with_unequal_ranks(tmp_path):
    """Lightning's DDP validation (through the DDP-wrapped model while fitting) over 37 records on 2 ranks:
    19 and 18, nothing repeated, and no rank waits for the other."""
    import importlib.util
    import sys
    from pathlib import Path

    pytest.importorskip("pytorch_lightning")
    backends = [b for b in ("torch", "dali") if b != "dali" or importlib.util.find_spec("nvidia.dali")]
    script = tmp_path / "ddp_val.py"
    script.write_text(LIGHTNING_DDP.format(helpers=str(Path(__file__).parents[1] / "helpers")))
    env = {"PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(script), ",".join(backends), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for backend in backends:
        ranks = [json.loads((tmp_path / f"{backend}-rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["batches"] for r in ranks] == [[5], [5]]  # 19 and 18 records in batches of 4
        shares = [[i for batch in r["val"] for i in batch] for r in ranks]
        assert [len(s) for s in shares] == [19, 18], backend
        each_once(shares[0] + shares[1], range(37))


@pytest.mark.parametrize("backend", ["torch", "dali"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_gather_outputs_with_skipped_records_follows_the_documented_recipe(backend, prefetch):
    """``last_indices`` names the yielded rows: a record skipped as undecodable (here one the structural
    check refuses and one that fails only to decode) is not among them, so the rows and the indices line up,
    whichever batch the backend was working on when it skipped it."""
    import odd_images

    items = [jpeg_bytes(24 + i % 7, 20 + i % 3) for i in range(21)]
    items[4] = b"not an image at all"
    import io

    from builders import photo
    from PIL import Image

    big = io.BytesIO()
    Image.fromarray(photo(200, 260)).save(big, "JPEG", quality=90)  # 12 KiB and more: damage fits in its scan
    items[13] = odd_images.damaged_scans(big.getvalue())["zeroed_4k"]
    reader = IndexReader(items)
    kw = {"prefetch": prefetch} if backend == "dali" else {}
    loader = make(backend, reader, 4, train=False, on_error="skip", **kw)
    rows, seen = _evaluate(loader)
    got = gather_outputs(rows, seen)
    skipped = (4, 13) if backend == "torch" else (4,)  # DALI's decoder decodes through the damaged scan
    assert loader.skipped == len(skipped)
    assert got[:, 0].long().tolist() == [i for i in range(21) if i not in skipped]  # each label is its index
