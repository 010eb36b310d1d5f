"""The Parquet index at its edges: which list column is the targets, what a caller omitting ``lists`` gets, what the
saved index file holds (names, identities, int64 arrays), null and empty target lists, and a string
label column without a single label."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_parquet import sample

from dali_fast import open_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from dali_fast.data.parquet import ParquetReader  # noqa: E402 (needs pyarrow)
from dali_fast.data.parquet_columns import Columns, find_columns  # noqa: E402
from dali_fast.data.parquet_index import ParquetIndex, build_index, index_key, local_identity  # noqa: E402


def test_the_target_list_column_is_a_numeric_list_found_by_name(tmp_path):
    fixed = pa.schema([("image", pa.binary()), ("tags", pa.list_(pa.int8(), 3))])
    assert find_columns(fixed, None, None, "w", lists=True) == Columns("image", None, "tags", "list", None)
    # two list columns: "labels" is taken before "label"
    two = pa.schema([("image", pa.binary()), ("label", pa.list_(pa.int64())), ("labels", pa.list_(pa.float32()))])
    assert find_columns(two, None, None, "w", lists=True).label == "labels"
    words = pa.schema([("image", pa.binary()), ("labels", pa.list_(pa.string()))])
    with pytest.raises(ValueError) as e:
        find_columns(words, None, None, "w", lists=True)
    assert str(e.value) == (
        "w: no target list column (list<int> or list<float>) named labels/label/labels/cls/class/target/category "
        "among image: binary, labels: list<item: string>; name it with label_column="
    )
    # `datasets` writes the feature of a list column as a list ([Value]): it names no classes
    listed = pa.schema(
        [("image", pa.binary()), ("labels", pa.list_(pa.int64()))],
        metadata={
            "huggingface": json.dumps({"info": {"features": {"labels": [{"dtype": "int64", "_type": "Value"}]}}})
        },
    )
    assert find_columns(listed, None, None, "w", lists=True) == Columns("image", None, "labels", "list", None)


def test_a_caller_that_omits_lists_gets_class_labels(tmp_path):
    files = [("a.parquet", "1|2"), ("b.parquet", "3|4")]
    assert index_key(files, None, None) == index_key(files, None, None, False) != index_key(files, None, None, True)
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"image": [sample(i) for i in range(4)], "label": [2, 0, 1, 2]}), path)
    index = build_index([(str(path), local_identity(path))], lambda k: pq.ParquetFile(path), image_column=None,
                        label_column=None)  # fmt: skip
    assert index.columns == Columns("image", None, "label", "int", None)
    assert index.labels.tolist() == [2, 0, 1, 2] and len(index.target_values) == len(index.target_ends) == 0


def test_the_saved_index_names_its_files_and_keeps_int64_arrays(tmp_path, cache):
    paths = [tmp_path / f"part-{k}.parquet" for k in range(2)]
    for k, p in enumerate(paths):
        pq.write_table(
            pa.table({"image": [sample(k * 5 + i) for i in range(5)], "label": [k] * 5}), p, row_group_size=2
        )
    r = ParquetReader([str(p) for p in paths])
    saved = ParquetIndex.load(r.index_file)
    assert saved.files == r.files == [str(p.resolve()) for p in paths]
    assert saved.identities == [local_identity(p) for p in paths]
    with np.load(r.index_file) as z:
        assert z["group_rows"].dtype == z["group_bytes"].dtype == z["labels"].dtype == np.int64
        assert z["group_rows"].tolist() == [2, 2, 1, 2, 2, 1] and z["labels"].tolist() == [0] * 5 + [1] * 5


def test_null_and_empty_target_lists(tmp_path, cache):
    path = tmp_path / "t.parquet"
    lists = pa.array([[], None, [], []], pa.list_(pa.int64()))
    pq.write_table(pa.table({"image": [sample(i) for i in range(4)], "labels": lists}), path)
    r = open_dataset(path, target="multihot", num_classes=3)
    assert r.label_problems == {1: "null target list"}
    with np.load(r.index_file) as z:
        assert z["labels"].dtype == np.int64 and z["labels"].tolist() == [0, -1, 0, 0]
        assert z["target_values"].dtype == np.float64 and z["target_values"].shape == (0,)
        assert z["target_ends"].tolist() == [0, 0, 0, 0]
    assert r.targets.rows(np.array([0, 2, 3])).tolist() == [[0.0] * 3] * 3


def test_a_string_label_column_with_no_label_opens_with_every_row_null(tmp_path, cache):
    path = tmp_path / "s.parquet"
    table = pa.table({"image": [sample(i) for i in range(3)], "label": pa.array([None] * 3, pa.string())})
    pq.write_table(table, path)
    r = open_dataset(path)
    assert r.columns.label_kind == "str" and r.classes == []
    assert r.labels.tolist() == [-1, -1, -1] and r.label_problems == {k: "null label" for k in range(3)}
