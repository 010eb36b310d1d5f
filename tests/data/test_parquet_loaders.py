"""Parquet through everything the other formats go through: both loaders (exactly once on 2 ranks, resume,
bad rows), the same pixels as the same JPEGs in an ImageFolder, pack, inspect, Lightning and train."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from contract import each_once, run_save_load_state
from test_parquet import NAMES, hf_table, sample, write_hf

from dali_fast import open_dataset

pq = pytest.importorskip("pyarrow.parquet")

from dali_fast.data.parquet import ParquetReader  # noqa: E402 (needs pyarrow)

BACKENDS = ["dali", "torch"]


def loader_class(backend: str) -> tuple[type, dict]:
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return DALIIterator, {"num_threads": 2}
    from dali_fast import TorchIterator

    return TorchIterator, {"num_workers": 2}


def folder_as_parquet(folder: Path, out: Path, files: int = 2, group: int = 5) -> Path:
    """The ImageFolder's images, in its order and with its labels, as ``out/data/train-*.parquet``."""
    src = open_dataset(folder)
    images, labels = [bytes(src[i][0]) for i in range(len(src))], src.labels.tolist()
    (out / "data").mkdir(parents=True)
    per = -(-len(images) // files)
    for k in range(files):
        part = slice(k * per, (k + 1) * per)
        table = hf_table(images[part], labels[part], src.classes)
        pq.write_table(table, out / "data" / f"train-{k:05d}-of-{files:05d}.parquet", row_group_size=group)
    return out


@pytest.mark.parametrize("streaming", [False, True], ids=["random", "streaming"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_two_epochs_each_sample_once_and_resume(tmp_path, cache, backend, streaming):
    cls, kw = loader_class(backend)
    write_hf(tmp_path / "snap")
    r = ParquetReader(tmp_path / "snap", streaming=streaming, shuffle_window=2)
    for epoch in (0, 1):
        seen, batches = [], []
        for rank in (0, 1):
            x = cls(r, 4, image_size=16, device="cpu", seed=3, rank=rank, world_size=2, **kw)
            x.set_epoch(epoch)
            n = 0
            for _, labels in x:
                seen += x.last_indices.tolist()
                assert labels.tolist() == [r.labels[i] for i in x.last_indices.tolist()]
                n += 1
            batches.append(n)
            x.close()
        assert batches[0] == batches[1] == 3  # 11 samples a rank (one padded), in batches of 4
        each_once(seen, range(21), padding=1, what=f"epoch {epoch}")
    order = type(cls(r, 4, image_size=16, device="cpu", **kw).order).__name__
    assert order == ("StreamingOrder" if streaming else "EpochSampler")
    run_save_load_state(lambda: cls(r, 4, image_size=16, device="cpu", seed=3, **kw), midpoint=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_rows_raise_named_or_are_skipped_and_counted(tmp_path, cache, backend, caplog):
    cls, kw = loader_class(backend)
    bad = {2: (b"not an image at all", 1), 4: (None, 2), 8: (sample(8), None)}
    write_hf(tmp_path / "snap", bad=bad)
    r = open_dataset(tmp_path / "snap")
    f0 = tmp_path / "snap" / "data" / "train-00000-of-00003.parquet"
    x = cls(r, 21, image_size=16, device="cpu", train=False, **kw)
    with pytest.raises(ValueError, match=rf"record 2 \({f0}:2\).*not an image \(unknown signature"):
        next(iter(x))
    x.close()
    y = cls(r, 5, image_size=16, device="cpu", train=False, on_error="skip", **kw)
    delivered = [label for _, labels in y for label in labels.tolist()]
    good = [i for i in range(21) if i not in bad]
    assert y.skipped == 3 and sorted(delivered) == sorted(int(r.labels[i]) for i in good)
    assert f"{f0}:2" in caplog.text  # the skipped records are logged by name
    y.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_equal_the_same_jpegs_read_as_an_image_folder(tmp_path, cache, photo_folder, backend):
    cls, kw = loader_class(backend)
    folder = tmp_path / "folder"
    subprocess.run(["cp", "-r", str(photo_folder), str(folder)], check=True)
    (sorted(folder.rglob("*.jpg"))[7]).unlink()  # the truncated one (the fixture's)
    snap = folder_as_parquet(folder, tmp_path / "snap")
    a, b = open_dataset(folder), open_dataset(snap)
    assert len(a) == len(b) == 59 and a.classes == b.classes and a.labels.tolist() == b.labels.tolist()
    for train in (False, True):
        xa = cls(a, 16, image_size=32, device="cpu", train=train, seed=5, **kw)
        xb = cls(b, 16, image_size=32, device="cpu", train=train, seed=5, **kw)
        for (ia, la), (ib, lb) in zip(xa, xb, strict=True):
            assert torch.equal(la, lb) and torch.equal(ia, ib)
        xa.close()
        xb.close()


def test_pack_from_parquet_keeps_bytes_labels_names_and_lists_bad_rows(tmp_path, cache):
    from dali_fast import pack
    from dali_fast.data.packed import MemmapReader

    rows = write_hf(tmp_path / "snap", bad={4: (None, 2), 8: (sample(8), None), 12: (sample(12), 9)})
    src = open_dataset(tmp_path / "snap")
    for workers, dst in ((1, "one"), (2, "two")):
        report = pack(tmp_path / "snap", tmp_path / dst, workers=workers, progress=False)
        assert report.records == 18 and report.classes == 4
        assert report.skipped == [
            (src.source(4), "null image"),
            (src.source(8), "null label"),
            (src.source(12), "label 9 is not one of the data set's 4 classes (0..3)"),
        ]
        packed = MemmapReader(tmp_path / dst)
        kept = [i for i in range(21) if i not in (4, 8, 12)]
        assert packed.classes == NAMES and [packed.source(k) for k in range(18)] == [src.source(i) for i in kept]
        assert [(bytes(packed[k][0]), packed[k][1]) for k in range(18)] == [rows[i] for i in kept]
    assert (tmp_path / "one" / "data.bin").read_bytes() == (tmp_path / "two" / "data.bin").read_bytes()
    again = pack(src, tmp_path / "from-reader", progress=False)  # a reader as the source: named by its folder
    assert again.records == 18 and again.dst == tmp_path / "from-reader"
    assert json.loads((tmp_path / "from-reader" / "meta.json").read_text())["source_root"] == str(src.path)


def test_inspect_and_the_cli_on_parquet(tmp_path, cache, capsys):
    from dali_fast.cli import main

    write_hf(tmp_path / "snap", bad={8: (sample(8), None)})
    assert main(["inspect", str(tmp_path / "snap")]) == 0
    out = capsys.readouterr().out.splitlines()
    files = ", ".join(f"train-0000{k}-of-00003.parquet" for k in range(3))
    assert out[0] == f"data set: {tmp_path / 'snap'} (ParquetReader)"
    assert out[1:3] == ["records:  21", "classes:  4 (cat, dog, emu, fox)"]
    assert out[3] == f"parquet:  3 files ({files}), 9 row groups, columns image (image.bytes) and label"
    assert (
        out[4] == f"bad labels: 1 (first: {tmp_path / 'snap' / 'data' / 'train-00001-of-00003.parquet'}:1: null label)"
    )
    assert out[6] == "per class: min 5, max 5"  # the 20 rows with a label, 5 of each class
    assert main(["inspect", str(tmp_path / "nothing-*.parquet")]) == 2
    assert "nothing-*.parquet: the pattern matches no file" in capsys.readouterr().err


@pytest.mark.parametrize("backend", BACKENDS)
def test_lightning_datamodule_on_parquet(tmp_path, cache, backend):
    pl = pytest.importorskip("pytorch_lightning")
    loader_class(backend)
    from dali_fast.lightning import DaliFastDataModule

    write_hf(tmp_path / "snap", "train")
    write_hf(tmp_path / "snap", "test")
    data = tmp_path / "snap" / "data"
    dm = DaliFastDataModule(
        train=str(data / "train-*.parquet"), val=str(data / "test-*.parquet"), batch_size=4, backend=backend,
        image_size=16, device="cpu",
    )  # fmt: skip
    seen: list[int] = []

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3 * 16 * 16, 4)

        def training_step(self, batch, _):
            seen.extend(batch[1].tolist())
            return torch.nn.functional.cross_entropy(self.lin(batch[0].flatten(1)), batch[1])

        def validation_step(self, batch, _):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Model(), datamodule=dm)
    assert sorted(seen) == sorted(i % 4 for i in range(21))
    with pytest.raises(FileNotFoundError, match=r"DaliFastDataModule: val='.*/val-\*\.parquet': .*matches no file"):
        DaliFastDataModule(train=str(data / "train-*.parquet"), val=str(data / "val-*.parquet"))


@pytest.mark.slow
def test_train_resume_after_sigkill_on_parquet_sees_each_sample_once(tmp_path, cache):
    """`dali-fast train DATA.parquet`, killed at its first mid-epoch checkpoint, then `--resume`: each
    training sample of each epoch once (the recorded indices), as on a packed set."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the train tests' own run helpers
    from train_runs import (
        check_epoch_cover,
        index_records,
        kill_at_first_checkpoint,
        train_args,
        train_command,
        train_indices,
    )

    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.train.checkpoint import load_checkpoint

    make_synthetic(tmp_path / "images", images=61, classes=3, seed=2, progress=False)
    data = folder_as_parquet(tmp_path / "images", tmp_path / "snap", files=3, group=4) / "data"
    ck = tmp_path / "ck"
    extra = ["--checkpoint", str(ck), "--checkpoint-every", "3"]
    kill_at_first_checkpoint(
        train_command(1, train_args(data, "torch", tmp_path, "before") + extra), ck / "checkpoint.pt"
    )
    state = load_checkpoint(ck / "checkpoint.pt")
    cut = int(state["step"])
    assert not state["epoch_done"] and 0 < state["ranks"][0]["loader"]["sampler"]["position"] < 49
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    after = subprocess.run(
        train_command(1, train_args(data, "torch", tmp_path, "after") + extra + ["--resume"]),
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert after.returncode == 0, after.stderr[-3000:]
    assert f"resumed from {ck / 'checkpoint.pt'}: epoch {state['epoch']}, step {cut}" in after.stdout
    before, resumed = index_records(tmp_path, "before", 1), index_records(tmp_path, "after", 1)
    train = train_indices(data)
    for epoch in (0, 1):
        got = [i for x in before[0] if x["epoch"] == epoch and x["step"] <= cut for i in x["indices"]]
        got += [i for x in resumed[0] if x["epoch"] == epoch for i in x["indices"]]
        check_epoch_cover({0: got}, train, 1)


def test_train_refuses_a_bad_label_up_front_or_skips_it(tmp_path, cache):
    """With on_error='raise' the label column is checked before any step, naming the row; with 'skip' the
    row is a bad record like any other: training runs and counts it."""
    from dali_fast.train.run import run_train

    write_hf(tmp_path / "snap", bad={12: (sample(12), 9)})
    r = open_dataset(tmp_path / "snap")
    kw = {"loader": "torch", "epochs": 1, "model": "resnet_tiny", "batch_size": 4, "image_size": 16, "num_workers": 0}
    with pytest.raises(
        ValueError, match=rf"^record 12 \({tmp_path / 'snap' / 'data'}/train-00001-of-00003.parquet:5\) "
    ):
        run_train(r, **kw)
    rows = run_train(r, on_error="skip", **kw)
    assert len(rows) == 1


class _Unlabelled:
    """A reader with no label column (labels only through reader[i]) and no folder."""

    def __init__(self, items):
        self.items, self.classes = items, ["a", "b", "c"]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return np.frombuffer(self.items[i], np.uint8), i % 3

    def source(self, i):
        return f"mem://{i}"


@pytest.mark.parametrize("workers", [1, 2])
def test_pack_takes_any_reader_as_its_source(tmp_path, workers):
    from builders import IndexReader, jpeg_bytes

    from dali_fast import pack
    from dali_fast.data.packed import MemmapReader

    images = [jpeg_bytes(40 + i, 30) for i in range(6)]
    for reader, name, labels in (
        (IndexReader(images), "IndexReader", list(range(6))),
        (_Unlabelled(images), "_Unlabelled", [0, 1, 2] * 2),
    ):
        dst = tmp_path / name
        report = pack(reader, dst, workers=workers, progress=False)
        assert (report.dst, report.records, report.classes, report.data_bytes) == (
            dst,
            6,
            len(reader.classes),
            sum(map(len, images)),
        )
        assert report.skipped == [] and report.reencoded == 0
        packed = MemmapReader(dst)
        assert [(bytes(packed[i][0]), packed[i][1], packed.source(i)) for i in range(6)] == [
            (images[i], labels[i], f"mem://{i}.jpg" if name == "IndexReader" else f"mem://{i}") for i in range(6)
        ]
        assert json.loads((dst / "meta.json").read_text())["source_root"] == str(Path(name).resolve())
    small = pack(IndexReader(images), tmp_path / "small", workers=workers, max_side=16, progress=False)
    assert small.reencoded == 6 and max(MemmapReader(tmp_path / "small").read_batch(range(6))[0][0].shape) > 0
    zero = bytearray(images[0])
    at = zero.find(b"\xff\xc0")
    zero[at + 5 : at + 9] = bytes(4)  # a 0x0 frame: the markers pass the structural check; Pillow refuses it
    cut = IndexReader([bytes(zero), *images[1:]])
    assert [p for p, _ in pack(cut, tmp_path / "cut", workers=workers, progress=False).skipped] == ["mem://0.jpg"]
    assert pack(cut, tmp_path / "unverified", workers=workers, verify=False, progress=False).records == 6


def test_read_rows_without_a_reader_says_so():
    from dali_fast.data.pack.sources import read_rows, use_reader

    use_reader(None)
    with pytest.raises(RuntimeError, match=r"^pack's reader is not set in this process \(use_reader\)$"):
        read_rows([0])


def test_open_dataset_refuses_column_names_for_other_formats(tmp_path):
    from builders import jpeg_bytes, one_line

    (tmp_path / "folder" / "a").mkdir(parents=True)
    (tmp_path / "folder" / "a" / "x.jpg").write_bytes(jpeg_bytes())
    for kw in ({"label_column": "cls"}, {"image_column": "jpg"}):
        with pytest.raises(ValueError) as e:
            open_dataset(tmp_path / "folder", **kw)
        assert one_line(e).endswith("name the columns of Parquet files; this is not one")
