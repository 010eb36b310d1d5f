"""One class map for every split: declared (``classes=``, a class list file) or derived from the training
set, put on each format's own labels by name, and a dictionary column's order kept. The files are
written by the tools users write them with: pandas, Polars, Hugging Face ``datasets``, folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builders import jpeg_bytes, make_folder, one_line

from dali_fast.data.classes import MAX_CLASSES, class_map, classes_key, read_classes_file
from dali_fast.data.open import open_dataset

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

NAMES = ["bird", "cat", "dog", "fish"]


def _split(labels: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"image": [jpeg_bytes(8 + i % 4, 8) for i in range(len(labels))], "label": labels})


def test_a_validation_split_without_one_class_keeps_the_training_indices(tmp_path, cache):
    """pandas writes class names as a string column: each split alone numbers its names sorted, so a split
    without 'cat' puts 'fish' at 2, not 3. Declared from the training set, every name keeps its index."""
    _split(["bird", "cat", "dog", "fish"] * 3).to_parquet(tmp_path / "train.parquet")
    _split(["bird", "dog", "fish", "fish"]).to_parquet(tmp_path / "val.parquet")
    train = open_dataset(tmp_path / "train.parquet")
    alone = open_dataset(tmp_path / "val.parquet")
    assert alone.classes == ["bird", "dog", "fish"]  # what the split alone holds
    val = open_dataset(tmp_path / "val.parquet", classes=train.classes)
    assert train.classes == val.classes == NAMES
    assert [val.classes[k] for k in val.labels.tolist()] == ["bird", "dog", "fish", "fish"]
    assert val.labels.tolist() == [0, 2, 3, 3]


def test_a_validation_class_not_in_training_is_one_line(tmp_path, cache):
    _split(["bird", "cat"] * 2).to_parquet(tmp_path / "train.parquet")
    _split(["bird", "frog"]).to_parquet(tmp_path / "val.parquet")
    train = open_dataset(tmp_path / "train.parquet")
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "val.parquet", classes=train.classes)
    assert one_line(e) == (
        f"{tmp_path / 'val.parquet'}: class 'frog' (of {tmp_path / 'val.parquet'}:1) is not among the 2 declared "
        "classes (bird, cat); a class every split shares gets one index: add it to the list, or leave its samples out"
    )


def test_a_pandas_categorical_keeps_its_categories_order_unused_ones_included(tmp_path, cache):
    order = ["dog", "fish", "cat", "bird"]  # the writer's order, not sorted; bird has no sample
    frame = _split(["fish", "cat", "cat", "dog", "fish", "fish"])
    frame["label"] = pd.Categorical(frame["label"], categories=order)
    frame.to_parquet(tmp_path / "c.parquet", row_group_size=4)
    reader = open_dataset(tmp_path / "c.parquet")
    assert reader.classes == order
    assert [order[k] for k in reader.labels.tolist()] == ["fish", "cat", "cat", "dog", "fish", "fish"]
    assert reader.labels.tolist() == pd.read_parquet(tmp_path / "c.parquet")["label"].cat.codes.tolist()


def test_a_polars_enum_keeps_its_order(tmp_path, cache):
    pl = pytest.importorskip("polars")
    order = ["z", "b", "a"]
    frame = pl.DataFrame(
        {"image": [jpeg_bytes(9, 9)] * 4, "label": pl.Series(["b", "a", "b", "a"], dtype=pl.Enum(order))}
    )
    frame.write_parquet(tmp_path / "e.parquet")
    reader = open_dataset(tmp_path / "e.parquet")
    assert reader.classes == order and reader.labels.tolist() == [1, 2, 1, 2]


def test_hugging_face_classlabel_keeps_its_order_and_a_split_takes_the_training_map(tmp_path, cache):
    datasets = pytest.importorskip("datasets")
    feature = datasets.ClassLabel(names=["zebra", "ant", "moth"])
    for split, labels in (("train", [0, 1, 2, 0]), ("test", [2, 2])):
        images = [{"bytes": jpeg_bytes(8, 8 + i), "path": None} for i in range(len(labels))]
        ds = datasets.Dataset.from_dict(
            {"image": images, "label": labels},
            features=datasets.Features({"image": datasets.Image(), "label": feature}),
        )
        ds.to_parquet(str(tmp_path / f"{split}.parquet"))
    train = open_dataset(tmp_path / "train.parquet")
    test = open_dataset(tmp_path / "test.parquet", classes=train.classes)
    assert train.classes == test.classes == ["zebra", "ant", "moth"] and test.labels.tolist() == [2, 2]


def test_an_image_folder_split_lacking_a_folder(tmp_path, cache):
    make_folder(tmp_path / "train", {c: [jpeg_bytes()] for c in NAMES})
    make_folder(tmp_path / "val", {c: [jpeg_bytes()] for c in ("bird", "dog", "fish")})
    train = open_dataset(tmp_path / "train")
    val = open_dataset(tmp_path / "val", classes=train.classes)
    assert val.classes == NAMES and val.labels.tolist() == [0, 2, 3]
    assert open_dataset(tmp_path / "val").labels.tolist() == [0, 1, 2]  # alone: numbered by what it holds


def test_packs_shards_and_bare_labels_on_a_declared_map(tmp_path, cache):
    from builders import write_shards

    from dali_fast.data.pack.packed import pack

    make_folder(tmp_path / "val", {c: [jpeg_bytes()] for c in ("cat", "fish")})
    pack(tmp_path / "val", tmp_path / "packed", progress=False)
    packed = open_dataset(tmp_path / "packed", classes=NAMES)
    assert packed.classes == NAMES and packed.labels.tolist() == [1, 3]
    assert [packed[i][1] for i in range(2)] == [1, 3]
    assert packed.read_batch_checked([0, 1])[1].tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"class 'fish' \(of .*\) is not among the 2 declared classes"):
        open_dataset(tmp_path / "packed", classes=["cat", "dog"])
    write_shards(tmp_path / "shards")  # bare labels 0..: the declared list names them
    bare = open_dataset(tmp_path / "shards")
    named = open_dataset(tmp_path / "shards", classes=[f"c{k}" for k in range(len(bare.classes) + 2)])
    assert named.labels.tolist() == bare.labels.tolist() and named.classes[0] == "c0"


def test_class_list_files(tmp_path):
    (tmp_path / "lines.txt").write_text("cat\n dog \n\nfish\n")
    assert read_classes_file(tmp_path / "lines.txt") == ["cat", "dog", "fish"]
    (tmp_path / "list.json").write_text(json.dumps(["b", "a"]))
    assert read_classes_file(tmp_path / "list.json") == ["b", "a"]
    (tmp_path / "map.json").write_text(json.dumps({"a": 1, "b": 0}))  # torchvision's class_to_idx
    assert read_classes_file(tmp_path / "map.json") == ["b", "a"]
    (tmp_path / "gap.json").write_text(json.dumps({"a": 0, "b": 2}))
    with pytest.raises(ValueError, match=r"gap.json: class 'b' has index 2, where 1 was expected"):
        read_classes_file(tmp_path / "gap.json")
    (tmp_path / "twice.txt").write_text("a\nb\na\n")
    with pytest.raises(ValueError, match=r"twice.txt: class 'a' is listed twice \(indices 0 and 2\)"):
        read_classes_file(tmp_path / "twice.txt")
    with pytest.raises(FileNotFoundError, match="no such class list"):
        read_classes_file(tmp_path / "missing.txt")


def test_class_map_rules():
    labels = np.array([2, 0, -1, 5])  # -1 and 5 are bad labels of a 3-class reader: they stay bad
    classes, remap = class_map(["c", "a", "b"], labels, ["a", "b", "c", "d"], where="w", source=str)
    assert classes == ["a", "b", "c", "d"] and remap.tolist() == [2, 0, 1]
    assert class_map(["a", "b"], np.array([0, 1]), ["a", "b"], where="w", source=str) == (["a", "b"], None)
    assert class_map(None, np.array([0, 3]), None, where="w", source=str)[0] == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match=r"label 3, beyond the 2 declared classes \(0..1\)"):
        class_map(None, np.array([0, 3]), ["x", "y"], where="w", source=str)
    with pytest.raises(ValueError, match=f"more than {MAX_CLASSES:,}"):
        class_map(None, np.array([0, 2**40]), None, where="w", source=str)


def test_class_lists_are_checked_in_one_line_each(monkeypatch):
    from dali_fast.data import classes as cm

    assert cm.check_classes(("a", "b")) == ["a", "b"]
    for given, says in (
        ("abc", "w: a list of class names, not str"),
        (None, "w: a list of class names, not NoneType"),
        (["a", 3], "w: class 3 is not a name; every class is a non-empty string"),
        (["", "a"], "w: class '' is not a name; every class is a non-empty string"),
        ([], "w: no class names; list one name per class, in index order"),
    ):
        with pytest.raises(ValueError) as e:
            cm.check_classes(given, "w")
        assert str(e.value) == says
    monkeypatch.setattr(cm, "MAX_CLASSES", 3)
    assert cm.check_classes(["a", "b", "c"], "w") == ["a", "b", "c"]  # exactly the most
    with pytest.raises(ValueError, match="^w: 4 classes, more than 3$"):
        cm.check_classes(["a", "b", "c", "d"], "w")
    assert cm.classes_of_labels(np.array([0, 2]), str) == ["0", "1", "2"]
    with pytest.raises(ValueError, match=r"^1: label 5 would make 6 classes, more than 3; a label is a class index"):
        cm.classes_of_labels(np.array([1, 5, 0]), str)  # source(1): where the largest label is
    assert cm.classes_of_labels(np.array([], np.int64), str) == [] and cm.classes_of_labels(np.array([-1]), str) == []


def test_class_list_files_edges(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffcat\ndog\n".encode())  # a BOM, as spreadsheets write
    assert read_classes_file(tmp_path / "bom.txt") == ["cat", "dog"]
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError) as e:
        read_classes_file(tmp_path / "latin.txt")
    assert str(e.value).startswith(f"{tmp_path / 'latin.txt'}: cannot read the class list (") and "UTF-8" in str(e.value)
    (tmp_path / "bad.json").write_text("[1, ")
    with pytest.raises(ValueError) as e:
        read_classes_file(tmp_path / "bad.json")
    assert str(e.value).startswith(f"{tmp_path / 'bad.json'}: not valid JSON (") and str(e.value).endswith(
        "; give a JSON list of names, or one name per line"
    )
    (tmp_path / "dup.json").write_text('["a", "a"]')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'dup.json'}: class 'a' is listed twice"):
        read_classes_file(tmp_path / "dup.json")
    (tmp_path / "flag.json").write_text('{"a": 0, "b": true}')
    with pytest.raises(ValueError) as e:
        read_classes_file(tmp_path / "flag.json")
    assert str(e.value) == f"{tmp_path / 'flag.json'}: a JSON object maps each class name to its index (an integer)"
    (tmp_path / "empty_name.json").write_text('{"": 0}')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'empty_name.json'}: class '' is not a name"):
        read_classes_file(tmp_path / "empty_name.json")


def test_index_names_are_bare_labels_whatever_the_list_declares():
    """A reader whose own classes are "0".."K-1" (bare labels) keeps its labels; the list names them."""
    classes, remap = class_map(["0", "1", "2"], np.array([2, 0]), ["cat", "dog", "fish"], where="w", source=str)
    assert classes == ["cat", "dog", "fish"] and remap is None
    classes, remap = class_map(["1", "0"], np.array([0, 1]), ["0", "1"], where="w", source=str)  # named "1", "0"
    assert remap.tolist() == [1, 0]


def test_the_largest_label_at_the_limit_and_the_default_place_in_messages(monkeypatch):
    from dali_fast.data import classes as cm

    monkeypatch.setattr(cm, "MAX_CLASSES", 3)
    assert cm.classes_of_labels(np.array([2]), str) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="^0: label 3 would make 4 classes, more than 3"):
        cm.classes_of_labels(np.array([3]), str)
    with pytest.raises(ValueError, match="^classes: a list of class names, not str$"):
        cm.check_classes("abc")


def test_the_class_map_s_key_is_the_same_from_release_to_release():
    """Loader states keep this key, so a state saved by one release resumes in the next: its exact value,
    the digest of the names' UTF-8 bytes joined by newlines, a folder name that is not UTF-8 (as
    ``os.listdir`` gives it, with surrogates) by its own bytes."""
    import hashlib
    import os

    assert classes_key(["cat", "dog"]) == "2:f8657f6e8b39" == "2:" + hashlib.sha1(b"cat\ndog").hexdigest()[:12]
    assert classes_key([os.fsdecode(b"caf\xe9"), "dog"]) == "2:ca8d71ab0ff5"
    assert hashlib.sha1(b"caf\xe9\ndog").hexdigest()[:12] == "ca8d71ab0ff5"
    assert classes_key([]) == "0:da39a3ee5e6b"
