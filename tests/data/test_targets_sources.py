"""Targets from the newer sources and sinks: Parquet list columns (found or named, the wrong kind of column
refused in one line, a null list or a bad index a bad record), packs and WebDataset shards written from them
(the lists read back exactly), and a reader's own targets (target= with a reader refused)."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest
from builders import jpeg_bytes, one_line
from target_sets import K, N, row, write_folder, write_parquet, written

from dali_fast import TorchIterator, open_dataset, pack
from dali_fast.data.pack.webdataset import pack_shards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_a_parquet_list_column_is_found_or_named_and_its_rows_are_the_lists(tmp_path, cache):
    path = write_parquet(tmp_path / "train.parquet", "multihot")
    reader = open_dataset(path, target="multihot", num_classes=K)  # found: the list column named labels
    assert reader.columns.label == "labels" and reader.columns.label_kind == "list"
    assert reader.classes == ["0"] and reader.labels.tolist() == [0] * N  # no class column: every label 0
    np.testing.assert_array_equal(reader.targets.rows(np.arange(N)), np.stack([row(i, "multihot") for i in range(N)]))
    table = pq.read_table(path).append_column("tags", pa.array([[1.5, -2.0]] * N, pa.list_(pa.float32())))
    table = table.append_column("cls", pa.array([i % 3 for i in range(N)], pa.int64()))
    pq.write_table(table, tmp_path / "two.parquet")
    floats = open_dataset(tmp_path / "two.parquet", target="float", label_column="tags")
    np.testing.assert_array_equal(floats.targets.rows([0, 12]), np.array([[1.5, -2.0]] * 2, np.float32))
    plain = open_dataset(tmp_path / "two.parquet")  # class targets: the integer column, lists left alone
    assert plain.columns.label == "cls" and plain.labels.tolist() == [i % 3 for i in range(N)]
    where = tmp_path / "two.parquet"
    for kw, says in (
        ({"label_column": "tags"}, "label_column='tags' is list<element: float>; a label column holds one class per "
         "row, as an integer or a class name (a list column is read with target='multihot' or 'float')"),
        ({"label_column": "cls", "target": "float"}, "label_column='cls' is int64; a target list column holds a "
         "list of class indices or numbers per row (list<int> or list<float>)"),
    ):  # fmt: skip
        with pytest.raises(ValueError) as e:
            open_dataset(where, **kw)
        assert one_line(e) == f"{where}: {says}"
    images = pa.array([jpeg_bytes()] * 2, pa.binary())
    pq.write_table(pa.table({"image": images, "cls": pa.array([0, 1])}), tmp_path / "none.parquet")
    with pytest.raises(ValueError, match=r"none.parquet: no target list column \(list<int> or list<float>\) named"):
        open_dataset(tmp_path / "none.parquet", target="multihot", num_classes=K)


def test_a_null_list_and_a_bad_index_in_parquet_are_bad_records(tmp_path, cache):
    lists = [written(i, "multihot") for i in range(N)]
    lists[2], lists[5] = None, [1, K]  # a null list; an index outside the classes
    table = pa.table(
        {"image": [jpeg_bytes(20 + i, 16) for i in range(N)], "labels": pa.array(lists, pa.list_(pa.int64()))}
    )
    pq.write_table(table, tmp_path / "t.parquet")
    reader = open_dataset(tmp_path / "t.parquet", target="multihot", num_classes=K)
    loader = TorchIterator(reader, 4, train=False, image_size=16, num_workers=0, on_error="skip")
    seen = []
    for _, targets in loader:
        idx = loader.last_indices.tolist()  # the yielded rows: the skipped records are not among them
        np.testing.assert_array_equal(targets.numpy(), np.stack([row(i, "multihot") for i in idx]))
        seen += idx
    assert sorted(seen) == [i for i in range(N) if i not in (2, 5)]
    assert loader.skipped == 2
    with pytest.raises(Exception, match=r"^record 2 \(.*t\.parquet:2\): null target list; remove or re-pack it"):
        list(TorchIterator(reader, N, train=False, image_size=16, num_workers=0, on_error="raise"))
    report = pack(tmp_path / "t.parquet", tmp_path / "packed", progress=False, target="multihot", num_classes=K)
    assert report.records == N - 2 and sorted(why for _, why in report.skipped) == [
        f"class index {K} is outside 0..{K - 1} (num_classes={K})",
        "null target list",
    ]


def test_a_null_float_list_is_a_bad_record_and_an_overflow_is_named(tmp_path, cache):
    """A null list makes its row bad, as for multi-hot (it refused the whole set); a number that float32,
    the rows' type, cannot hold is named as such, not as 'not finite'."""
    lists = [[float(i), -1.0] for i in range(6)]
    lists[1], lists[4] = None, [1e39, 0.0]
    table = pa.table({"image": [jpeg_bytes(20 + i, 16) for i in range(6)], "v": pa.array(lists, pa.list_(pa.float64()))})
    pq.write_table(table, tmp_path / "f.parquet")
    reader = open_dataset(tmp_path / "f.parquet", target="float", label_column="v")
    assert reader.targets.width == 2
    assert reader.targets.bad == {
        1: "null target list",
        4: "target [1e+39, 0.0] holds 1e+39, beyond float32's range (+-3.403e+38): scale the targets",
    }
    loader = TorchIterator(reader, 4, train=False, image_size=16, num_workers=0, on_error="skip")
    rows = [t for _, t in loader]
    assert loader.skipped == 2
    np.testing.assert_array_equal(np.concatenate(rows)[:, 0], [0.0, 2.0, 3.0, 5.0])


@pytest.mark.parametrize("kind", ["multihot", "float"])
def test_written_shards_carry_the_lists_as_json(tmp_path, cache, kind):
    opened = {"target": kind, "num_classes": K if kind == "multihot" else None}
    report = pack_shards(
        write_folder(tmp_path / "src", kind), tmp_path / "out", shuffle=False, progress=False, **opened
    )
    assert report.samples == N
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        docs = [json.loads(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".json")]
        assert not [m for m in tar.getmembers() if m.name.endswith(".cls")]
    assert docs == [{"labels": written(i, kind)} for i in range(N)]  # multihot: [] for a sample of no class
    back = open_dataset(tmp_path / "out", **opened)
    np.testing.assert_array_equal(back.targets.rows(np.arange(N)), np.stack([row(i, kind) for i in range(N)]))


def test_a_reader_packs_its_own_targets_and_refuses_others(tmp_path, cache):
    reader = open_dataset(write_folder(tmp_path / "src", "float"), target="float")
    message = "target= and num_classes= are for a path; a reader packs its own targets (open it with them)"
    for write in (pack, pack_shards):
        with pytest.raises(ValueError) as e:
            write(reader, tmp_path / "never", target="float", progress=False)
        assert one_line(e) == message
    report = pack(reader, tmp_path / "packed", progress=False)
    assert (report.target, report.target_width, report.records) == ("float", 3, N)
    packed = open_dataset(tmp_path / "packed")
    names = [packed.source(i) for i in range(N)]
    np.testing.assert_array_equal(
        packed.targets.rows(np.arange(N)),
        np.stack([reader.targets.rows([names.index(reader.source(i))])[0] for i in range(N)]),
    )


def test_the_command_writes_shards_with_the_lists(tmp_path, cache):
    from dali_fast.cli import main

    src = write_folder(tmp_path / "src", "multihot")
    argv = ["pack", str(src), str(tmp_path / "out"), "--format", "webdataset", "--no-shuffle", "--target", "multihot"]
    assert main([*argv, "--num-classes", str(K)]) == 0
    back = open_dataset(tmp_path / "out", target="multihot", num_classes=K)
    np.testing.assert_array_equal(back.targets.rows(np.arange(N)), np.stack([row(i, "multihot") for i in range(N)]))


def test_targets_of_parquet_at_a_url_are_refused_before_any_download():
    with pytest.raises(ValueError) as e:
        open_dataset("s3://bucket/train-*.parquet", target="multihot", num_classes=K)
    assert one_line(e) == (
        "s3://bucket/train-*.parquet: multi-hot and float targets of Parquet at a URL are not read yet; copy the "
        "files to a local folder and open that, or pack them (dali-fast pack --target) and open the pack"
    )


def test_float32_s_largest_number_is_in_range_and_a_nan_row_is_shown_as_the_rows_hold_it(tmp_path, cache):
    """float32's largest finite number fits the rows: a row holding it and a NaN is named for the NaN;
    the row is shown in float32, the type the rows are (0.1 as float32 holds)."""
    top = float(np.finfo(np.float32).max)
    lists = [[0.5, 0.5], [top, float("nan")], [0.1, float("inf")], [-top, 0.0]]
    table = pa.table({"image": [jpeg_bytes(20 + i, 16) for i in range(4)], "v": pa.array(lists, pa.list_(pa.float64()))})
    pq.write_table(table, tmp_path / "f.parquet")
    reader = open_dataset(tmp_path / "f.parquet", target="float", label_column="v")
    assert reader.targets.bad == {
        1: f"target [{top!r}, nan] holds a number that is not finite",
        2: f"target [{float(np.float32(0.1))!r}, inf] holds a number that is not finite",
    }
