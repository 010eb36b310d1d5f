"""The sets `train` trains and evaluates on: a validation set of its own (``--val``, the training set read
whole), or a share held out: records at random, or whole row groups or shards of a streamed set, so that
training still streams (on moto's S3 server: each shard downloaded once an epoch, with a cache smaller
than the data set)."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from builders import IndexReader, jpeg_bytes, make_folder
from elastic_cases import write_hf_parquet

from dali_fast import TorchIterator, open_dataset
from dali_fast.cli import main
from dali_fast.data.base import StreamingSubset, SubsetReader, split
from dali_fast.loaders.order.streaming import StreamingOrder
from dali_fast.train.run import run_train

TINY = {"loader": "torch", "model": "resnet_tiny", "batch_size": 4, "image_size": 16, "num_workers": 0}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """29 images as local Parquet in 9 row groups of 4, 4, 2, 4, 4, 2, 4, 4, 1 rows, read in the streaming
    order (windows of 2 groups); each image's label is its number."""
    root = tmp_path_factory.mktemp("streamed")
    images = [jpeg_bytes(20 + i % 7, 18 + i % 5, (i * 8, 90, 200 - i)) for i in range(29)]
    write_hf_parquet(root / "pq", images, list(range(29)), [str(i) for i in range(29)], files=3, group=4)
    reader = open_dataset(root / "pq", streaming=True, shuffle_window=2)
    assert reader.streaming and np.diff(reader.shard_bounds).tolist() == [4, 4, 2, 4, 4, 2, 4, 4, 1]
    return reader


def test_a_streamed_set_holds_out_whole_row_groups_and_both_sides_still_stream(streamed, monkeypatch):
    bounds = streamed.shard_bounds
    train, held = split(streamed, 0.2, seed=0)
    assert type(train) is StreamingSubset and type(held) is StreamingSubset
    groups = {int(s): set(range(bounds[s], bounds[s + 1])) for s in range(9)}
    assert set(held.indices.tolist()) == set().union(*(groups[s] for s in held.shards.tolist()))  # whole groups
    assert sorted(train.indices.tolist() + held.indices.tolist()) == list(range(29))  # disjoint, and all
    assert np.diff(train.shard_bounds).tolist() == [len(groups[s]) for s in train.shards.tolist()]
    assert split(streamed, 0.2, seed=0)[1].shards.tolist() == held.shards.tolist()  # a pure function of the seed
    scheduled = []
    real = streamed.schedule
    monkeypatch.setattr(streamed, "schedule", lambda order, then=None: (scheduled.append(order), real(order, then)))
    loader = TorchIterator(train, 4, image_size=16, device="cpu", num_workers=0, seed=3)
    assert type(loader.order) is StreamingOrder and loader.order.bounds.tolist() == train.shard_bounds.tolist()
    got = [label for _, labels in loader for label in labels.tolist()]
    assert sorted(got) == sorted(train.indices.tolist())  # the labels are the records' numbers
    assert scheduled[0].tolist() == train.indices[loader.order.indices(0)].tolist()  # the reader's own numbers
    assert scheduled[0].tolist() == got


def test_the_held_out_share_of_whole_shards_is_about_the_share_asked_for(streamed):
    counts = np.diff(streamed.shard_bounds)
    for seed in range(20):
        for holdout in (0.1, 0.2, 0.5):
            _, held = split(streamed, holdout, seed)
            want = round(29 * holdout)
            assert want <= len(held) < want + counts.max()  # enough, and not a whole shard more
    _, most = split(streamed, 0.99, 0)
    assert len(most.shards) == 8  # a shard is always left to train on


def test_a_set_read_at_random_holds_out_records_at_random_as_before():
    reader = IndexReader([jpeg_bytes(20, 18)] * 37)
    train, held = split(reader, 0.2, seed=4)
    perm = np.random.default_rng([4, 99]).permutation(37)
    assert type(train) is SubsetReader and held.indices.tolist() == sorted(perm[:7].tolist())
    assert train.indices.tolist() == sorted(perm[7:].tolist())


def test_a_streamed_set_of_one_shard_cannot_hold_out_whole_shards(tmp_path):
    write_hf_parquet(tmp_path / "pq", [jpeg_bytes(20, 18)] * 5, [0] * 5, ["a"], files=1, group=8)
    reader = open_dataset(tmp_path / "pq", streaming=True)
    with pytest.raises(ValueError) as e:
        split(reader, 0.2)
    assert str(e.value) == (
        "5 records in 1 shard(s): a held-out share of whole shards needs two or more; name a validation set "
        "(--val PATH, TrainConfig.val)"
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An ImageFolder ``train`` (3 classes, 14 images) and ``val`` (3 classes, 5 images)."""
    root = tmp_path_factory.mktemp("sets")
    colors = {"a": (200, 30, 60), "b": (10, 200, 10), "c": (0, 0, 255)}
    for split_name, per in (("train", [5, 5, 4]), ("val", [2, 2, 1])):
        make_folder(
            root / split_name,
            {c: [jpeg_bytes(20 + i, 18 + i, colors[c]) for i in range(n)] for c, n in zip(colors, per, strict=True)},
        )
    return root


def test_train_with_val_trains_on_every_record_and_names_both_sets(folders, tmp_path):
    lines = []
    record = tmp_path / "seen.jsonl"
    rows = run_train(
        open_dataset(folders / "train"), **TINY, epochs=2, drop_last=False, val=str(folders / "val"),
        record_indices=record, emit=lines.append,
    )  # fmt: skip
    assert lines[0] == (
        f"training resnet_tiny on 14 images of {folders / 'train'}, evaluating on 5 images of {folders / 'val'}, "
        "loader=torch, device=cpu"
    )
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    for epoch in (0, 1):
        assert Counter(i for x in seen if x["epoch"] == epoch for i in x["indices"]) == Counter(range(14))
    assert len(rows) == 2 and all(np.isfinite(r["val_loss"]) for r in rows)


def test_the_cli_takes_val_and_says_both_sets_first(folders, tmp_path, capsys):
    args = ["train", str(folders / "train"), "--val", str(folders / "val"), "--loader", "torch", "--epochs", "1"]
    args += ["--model", "resnet_tiny", "--batch-size", "4", "--image-size", "16", "--num-workers", "0"]
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"training resnet_tiny on 14 images of {folders / 'train'}, evaluating on 5 images of ")
    assert main([*args[:3], str(tmp_path / "nothing"), *args[4:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "nothing") in err[0]


def test_a_val_set_whose_classes_differ_is_refused_in_one_line(folders, tmp_path):
    shutil.copytree(folders / "val", tmp_path / "val")
    (tmp_path / "val" / "a").rename(tmp_path / "val" / "aa")  # "aa" sorts where "a" did: label 0 means another class
    (tmp_path / "val" / "b").rename(tmp_path / "val" / "z")  # and label 1 now "c", label 2 "z"
    with pytest.raises(ValueError) as e:  # opened on the training set's class map, which has no "aa"
        run_train(open_dataset(folders / "train"), **TINY, epochs=1, val=tmp_path / "val", emit=lambda _: None)
    assert str(e.value).startswith(
        f"{tmp_path / 'val'}: class 'aa' (of {tmp_path / 'val' / 'aa' / '000.jpg'}) and 1 other class is not among "
        "the 3 declared classes (a, b, c)"
    )
    from dali_fast.train.sets import check_same_classes

    with pytest.raises(ValueError) as e:  # a reader given as it was opened: its own classes are compared
        check_same_classes(open_dataset(folders / "train"), open_dataset(tmp_path / "val"))
    assert str(e.value) == (
        f"the validation set {tmp_path / 'val'} calls label 0 'aa', the training set calls it 'a': their class "
        "lists differ; give both sets the same classes (the same class folders or names)"
    )
    make_folder(tmp_path / "fewer", {"a": [jpeg_bytes(20, 18)], "b": [jpeg_bytes(21, 18)]})  # without its last class
    run_train(open_dataset(folders / "train"), **TINY, epochs=1, val=tmp_path / "fewer", emit=lambda _: None)


def test_a_resume_with_another_val_or_none_is_refused(folders, tmp_path):
    train = open_dataset(folders / "train")
    kw = {**TINY, "epochs": 1, "checkpoint": tmp_path / "ck", "emit": lambda _: None}
    run_train(train, **kw, val=folders / "val")
    other = make_folder(tmp_path / "other", {"a": [jpeg_bytes(30, 18)], "b": [jpeg_bytes(31, 18)]})
    with pytest.raises(
        ValueError, match=r"ck/checkpoint.pt: saved with val='folder:5:\w+', this run has val='folder:2:"
    ):
        run_train(train, **{**kw, "epochs": 2}, val=other, resume=True)
    with pytest.raises(ValueError, match=r"ck/checkpoint.pt: saved with holdout=None, this run has holdout=0.2"):
        run_train(train, **{**kw, "epochs": 2}, resume=True)


# ------------------------------------------------------------------------------------ on moto's S3 server


def test_train_on_a_url_downloads_each_shard_once_an_epoch_with_a_smaller_cache(tmp_path, monkeypatch):
    """12 shards of 4 images, a node cache of 5 shards: one epoch (training and evaluation) downloads each
    shard once. Reading the held-out records at random across every shard, it downloaded shards again and
    again (24 shards and a cache of 9: 142 downloads)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from object_store import S3Server
    from remote_shards import shard_bytes

    server = S3Server()
    try:
        server.client.create_bucket(Bucket="data")
        for s in range(12):
            server.client.put_object(Bucket="data", Key=f"train-{s:06d}.tar", Body=shard_bytes(4 * s, 4)[0])
        monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
        url = "s3://data/train-{000000..000011}.tar"
        biggest = max(len(shard_bytes(4 * s, 4)[0]) for s in range(12))
        opts = {"storage_options": {"endpoint_url": server.endpoint}, "index_dir": tmp_path / "index"}
        open_dataset(url, **opts, cache_dir=tmp_path / "first")  # the indexes, built once per node
        server.counts.reset()
        reader = open_dataset(url, **opts, cache_dir=tmp_path / "cache", cache_limit=5 * biggest, shuffle_window=2)
        lines = []
        run_train(reader, **TINY, epochs=1, emit=lines.append)
        assert lines[0].endswith("evaluating on 12 held out of it (3 whole shards), loader=torch, device=cpu")
        gets = {k.split("/", 1)[1]: v for k, v in server.counts.gets.items()}
        assert gets == {f"train-{s:06d}.tar": 1 for s in range(12)}
        reader.close()
    finally:
        server.stop()
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def test_a_val_set_lacking_a_class_is_numbered_by_the_training_set(folders, tmp_path):
    """A validation folder without class "b" numbers "c" 1 on its own; opened by train on the training set's
    class map, "c" stays 2, as the model learned it."""
    from dali_fast.train.sets import run_sets

    make_folder(tmp_path / "val", {"a": [jpeg_bytes(20, 18)], "c": [jpeg_bytes(21, 18), jpeg_bytes(22, 18)]})
    assert open_dataset(tmp_path / "val").labels.tolist() == [0, 1, 1]  # alone
    sets = run_sets(open_dataset(folders / "train"), tmp_path / "val", 0.2, 0)
    assert sets.val.classes == ["a", "b", "c"] and sets.val.labels.tolist() == [0, 2, 2]


def test_a_resume_on_another_class_map_is_refused_naming_the_class(folders, tmp_path):
    kw = {**TINY, "epochs": 1, "checkpoint": tmp_path / "ck", "emit": lambda _: None}
    run_train(open_dataset(folders / "train"), **kw)
    other = open_dataset(folders / "train", classes=["a", "b", "c", "d"])  # one class more: another map
    with pytest.raises(ValueError) as e:
        run_train(other, **{**kw, "epochs": 2}, resume=True)
    assert str(e.value) == (
        f"{tmp_path / 'ck' / 'checkpoint.pt'}: saved with another class map (3 classes, this run has 4); resume on "
        "data of the same classes (--classes FILE declares them) or use a new --checkpoint folder"
    )


def test_the_epoch_line_counts_skipped_records_and_a_loss_that_is_not_finite(folders, tmp_path):
    import shutil

    shutil.copytree(folders / "train", tmp_path / "train")
    (tmp_path / "train" / "a" / "000.jpg").write_bytes(b"not an image")
    lines: list[str] = []
    run_train(
        open_dataset(tmp_path / "train"), **TINY, epochs=1, val=folders / "val", on_error="skip", emit=lines.append
    )
    assert ", skipped 1 bad record in training, 0 held out" in lines[1]
    from dali_fast.train.lines import epoch_line

    row = {"epoch": 0, "train_loss": float("nan"), "val_loss": float("nan"), "img_per_s": 10.0, "util_kind": "cpu",
           "util_mean": 50.0, "batch_size": 4, "image_size": 16, "ranks": 1, "resumed": False, "decision": None}  # fmt: skip
    assert epoch_line({**row, "target": "float"}).endswith(
        " | the loss is not finite: lower --lr or scale the targets to about unit size"
    )
    assert epoch_line({**row, "target": "class"}).endswith(" | the loss is not finite: lower --lr")
