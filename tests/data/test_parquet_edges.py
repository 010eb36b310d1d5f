"""Parquet edge cases: how columns and class names are found, what the saved index keeps, row groups read as
several chunks or with 64-bit offsets, and the one-line refusals of bad arguments and bad files."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from builders import one_line
from test_parquet import NAMES, hf_table, sample, write_hf

from dali_fast import open_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from dali_fast.data.parquet import ParquetReader  # noqa: E402 (needs pyarrow)
from dali_fast.data.parquet_columns import Columns, find_columns, hf_features  # noqa: E402
from dali_fast.data.parquet_group import RowGroup  # noqa: E402


def with_features(table: pa.Table, features: dict) -> pa.Table:
    return table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})


def test_the_hugging_face_features_pick_the_columns_and_name_the_classes(tmp_path, cache):
    images = [sample(i) for i in range(6)]
    # Two binary columns and two integer ones, none with a telling name: the features decide.
    table = pa.table({"a": images[::-1], "b": images, "x": [i % 3 for i in range(6)], "y": [5] * 6})
    pq.write_table(
        with_features(table, {"b": {"_type": "Image"}, "x": {"num_classes": 3, "_type": "ClassLabel"}}),
        tmp_path / "f.parquet",
    )
    r = open_dataset(tmp_path / "f.parquet")
    assert (r.columns.image, r.columns.label, r.columns.names) == ("b", "x", ("0", "1", "2"))
    assert r.classes == ["0", "1", "2"] and bytes(r[1][0]) == images[1]
    # a named label column that is not the ClassLabel one has no names from it; "label" is found by name
    named = pa.table({"image": images, "label": [i % 2 for i in range(6)], "other": [1] * 6})
    pq.write_table(
        with_features(named, {"other": {"names": ["p", "q"], "_type": "ClassLabel"}}), tmp_path / "g.parquet"
    )
    assert open_dataset(tmp_path / "g.parquet", label_column="label").classes == ["0", "1"]
    assert open_dataset(tmp_path / "g.parquet").classes == ["p", "q"]
    for raw in (b"not json", b'{"info": []}', b'{"info": {"features": []}}', b"[]"):
        schema = pa.schema([("image", pa.binary()), ("label", pa.int64())], metadata={"huggingface": raw})
        assert hf_features(schema) == {}
        assert find_columns(schema, None, None, "w").names is None
    large = pa.schema([("image", pa.struct([("bytes", pa.large_binary())])), ("cls", pa.int8())])
    assert find_columns(large, None, None, "w") == Columns("image", "bytes", "cls", "int", None)
    other = pa.schema([("image", pa.struct([("bytes", pa.string())])), ("cls", pa.int8())])
    with pytest.raises(
        ValueError, match=r"^w: no image column \(binary, or struct<bytes: binary, path: string>\) among image"
    ):
        find_columns(other, None, None, "w")
    dictionary = pa.schema([("jpg", pa.binary()), ("label", pa.dictionary(pa.int32(), pa.string()))])
    assert find_columns(dictionary, None, None, "w").label_kind == "str"


def test_the_saved_index_keeps_columns_names_and_files(tmp_path, cache, monkeypatch):
    import dali_fast.data.parquet_index as pi

    images = [sample(i) for i in range(8)]
    words = pa.table(
        {"image": pa.array(images).dictionary_encode().dictionary_decode(), "label": ["b", "a", None, "c"] * 2}
    )
    pq.write_table(words, tmp_path / "w.parquet", row_group_size=3)
    first = open_dataset(tmp_path / "w.parquet")
    monkeypatch.setattr(pi, "build_index", lambda *a, **k: pytest.fail("indexed again"))
    again = open_dataset(tmp_path / "w.parquet")
    assert again.columns == first.columns and again.classes == first.classes == ["a", "b", "c"]
    assert again.labels.tolist() == first.labels.tolist() == [1, 0, -1, 2] * 2 and again.files == first.files
    assert again.group_rows.tolist() == [3, 3, 2] and again.group_file.dtype == np.int32
    assert again.group_bytes.dtype == np.int64 and again.label_problems == {2: "null label", 6: "null label"}
    monkeypatch.undo()
    hf = tmp_path / "hf"
    write_hf(hf)
    a = ParquetReader(hf, cache_dir=tmp_path / "elsewhere")
    assert a.index_file.parent == tmp_path / "elsewhere" and ParquetReader(
        hf, cache_dir=tmp_path / "elsewhere"
    ).columns.names == tuple(NAMES)
    assert ParquetReader(hf, label_column="label").index_file != a.index_file  # the columns asked for are in the key
    assert ParquetReader(hf, image_column="image").index_file != a.index_file


def test_an_index_that_cannot_be_saved_is_said_once_and_the_set_still_opens(tmp_path, caplog):
    write_hf(tmp_path / "snap")
    (tmp_path / "ro").write_text("a file, not a folder")
    with caplog.at_level(logging.WARNING, logger="dali_fast.data.parquet_index"):
        r = ParquetReader(tmp_path / "snap", cache_dir=tmp_path / "ro")
    assert len(r) == 21
    [said] = [x.getMessage() for x in caplog.records]
    assert (
        f"{tmp_path / 'ro'}')" in said
        and said.startswith(f"cannot save the Parquet index to {r.index_file} (")
        and said.endswith("); set DALI_FAST_CACHE to a writable folder")
    )


def test_files_with_other_columns_bad_arguments_and_no_rows_are_refused_in_one_line(tmp_path, cache):
    write_hf(tmp_path / "snap")
    odd = tmp_path / "snap" / "data" / "train-00003-of-00003.parquet"
    pq.write_table(pa.table({"image": [sample(1)], "label": ["cat"]}), odd)
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "snap")
    assert one_line(e).startswith(f"{odd}: its columns differ from the first file's (Columns(")
    assert one_line(e).endswith("a data set's files share one schema: open them separately")
    odd.unlink()
    for kw, says in (
        ({"row_group_cache": -1}, "row_group_cache=-1: must be >= 0 bytes"),
        ({"shuffle_window": 1.5}, "shuffle_window=1.5: must be a positive number of row groups"),
    ):
        with pytest.raises(ValueError) as e:
            ParquetReader(tmp_path / "snap", **kw)
        assert one_line(e) == says
    assert ParquetReader(tmp_path / "snap", shuffle_window=1).shuffle_window == 1
    with pytest.raises(ValueError, match="^no Parquet files given$"):
        ParquetReader([])
    files = sorted((tmp_path / "snap" / "data").iterdir())
    listed = ParquetReader([str(f) for f in files[:2]])
    assert len(listed) == 14 and listed.path == files[0].parent
    empty = tmp_path / "empty.parquet"
    pq.write_table(hf_table([], [], NAMES), empty)
    with pytest.raises(ValueError) as e:
        open_dataset(empty)
    assert one_line(e) == f"{empty}: no rows in 1 Parquet file"
    with pytest.raises(FileNotFoundError) as e:
        open_dataset(str(tmp_path / "snap" / "data" / "train-{00001..00004}-of-00003.parquet"))
    assert (
        one_line(e) == f"{tmp_path / 'snap' / 'data' / 'train-00003-of-00003.parquet'} and 1 more: no such Parquet file"
    )
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match=r"d: no \.parquet files in this folder or in its data/ folder$"):
        ParquetReader(tmp_path / "d")
    (tmp_path / "mixed").mkdir()
    for name in ("train-00000-of-00001.parquet", "extra.parquet"):
        pq.write_table(hf_table([sample(0)], [0], NAMES), tmp_path / "mixed" / name)
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "mixed")
    assert one_line(e).startswith(
        f"{tmp_path / 'mixed'}: holds the files of several splits: (other) (1 file), train (1 file);"
    )
    assert one_line(e).endswith(f"open_dataset('{tmp_path / 'mixed' / 'train'}-*.parquet')")


def test_a_row_group_of_several_chunks_sliced_wide_or_empty_reads_back_exactly(tmp_path):
    images = [sample(i) for i in range(7)]
    narrow = pa.array([*images[:3], None, *images[3:]])
    sliced = narrow.slice(2)  # an offset into the offsets buffer
    for column, want in (
        (pa.chunked_array([narrow]), [*images[:3], None, *images[3:]]),
        (pa.chunked_array([sliced]), [images[2], None, *images[3:]]),
        (
            pa.chunked_array([narrow.slice(0, 2), sliced]),
            [images[0], images[1], images[2], None, *images[3:]],
        ),
        (pa.chunked_array([pa.array(images, pa.large_binary())]), images),
        (pa.chunked_array([], pa.binary()), []),
        (pa.chunked_array([pa.array([None, None], pa.binary())]), [None, None]),
    ):
        group = RowGroup(column, None)
        got = [None if why == "null image" else bytes(group.view(k)) for k, why in enumerate(group.reasons)]
        assert got == want
        assert group.reasons == ["null image" if w is None else None for w in want]
        assert group.nbytes == group.data.nbytes + group.offsets.nbytes and not group.data.flags.writeable
    rows = pa.array([{"bytes": images[0]}, None, {"bytes": None}], pa.struct([("bytes", pa.binary())]))
    assert RowGroup(pa.chunked_array([rows]), "bytes").reasons == [None, "null image", "null image"]


def test_classes_from_the_labels_leave_out_null_and_negative_ones(tmp_path, cache):
    table = pa.table({"image": [sample(i) for i in range(5)], "label": pa.array([0, 2, None, -4, 1])})
    pq.write_table(table, tmp_path / "n.parquet")
    r = open_dataset(tmp_path / "n.parquet")
    assert r.classes == ["0", "1", "2"]
    assert r.label_problems == {2: "null label", 3: "label -4 is not one of the data set's 3 classes (0..2)"}
    datas, labels = r.read_batch([2, 3])
    assert labels.tolist() == [-1, -4] and [bytes(d) for d in datas] == [sample(2), sample(3)]
    _, _, bad = r.read_batch_checked(np.array([[0], [3]]))  # any shape of indices, as one batch
    assert bad == {1: "label -4 is not one of the data set's 3 classes (0..2)"}


def test_the_boundaries_of_the_classes_the_order_and_the_window(tmp_path, cache, caplog):
    write_hf(tmp_path / "snap", bad={5: (sample(5), 4)})  # 4 names: label 4 is the first outside them
    r = ParquetReader(tmp_path / "snap")
    assert r.label_problems == {5: "label 4 is not one of the data set's 4 classes (0..3)"}
    b = int(r.group_bytes.max())
    assert not ParquetReader(tmp_path / "snap", row_group_cache=r.total_bytes).streaming  # it fits exactly
    assert ParquetReader(tmp_path / "snap", row_group_cache=0).shuffle_window == 1  # the cache: 2 row groups
    assert ParquetReader(tmp_path / "snap", row_group_cache=4 * b + 1).shuffle_window == 2
    assert r.read_batch([4])[0][0].dtype == np.uint8 and r.__getstate__()["_meta"] == {}
    zeros = pa.table({"image": [sample(i) for i in range(3)], "label": [0, 0, 0]})
    pq.write_table(zeros, tmp_path / "zeros.parquet")
    assert open_dataset(tmp_path / "zeros.parquet").classes == ["0"]
    sparse = pa.table({"image": [sample(i) for i in range(3)], "label": [None, 0, 150]})
    pq.write_table(sparse, tmp_path / "sparse.parquet")
    with caplog.at_level(logging.WARNING, logger="dali_fast.data.shards"):
        assert len(open_dataset(tmp_path / "sparse.parquet").classes) == 151
    assert f"the largest label is 150 ({tmp_path / 'sparse.parquet'}:2)" in caplog.text
    bare = pa.table({"image": [sample(1)], "label": [0]})
    pq.write_table(with_features(bare, {"label": {"_type": "ClassLabel"}}), tmp_path / "bare.parquet")
    assert open_dataset(tmp_path / "bare.parquet").columns.names is None
    middle = pa.array([sample(0), None, sample(1), sample(2)]).slice(1, 2)
    group = RowGroup(pa.chunked_array([middle]), None)
    assert group.reasons == ["null image", None] and bytes(group.view(1)) == sample(1)


def test_the_column_errors_name_the_keyword_and_the_choices(tmp_path, cache):
    images = [sample(i) for i in range(3)]
    table = pa.table({"image": images, "label": [0.5, 1.5, 2.5], "cls": [0, 1, 2]})
    pq.write_table(table, tmp_path / "t.parquet")
    assert open_dataset(tmp_path / "t.parquet").columns.label == "cls"  # "label" is a float column: not a label
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "t.parquet", label_column="nope")
    assert one_line(e) == (
        f"{tmp_path / 't.parquet'}: label_column='nope' is not a column; the columns are image: binary, "
        "label: double, cls: int64"
    )
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "t.parquet", image_column="cls")
    assert one_line(e) == (
        f"{tmp_path / 't.parquet'}: image_column='cls' is int64; an image column is binary, or a struct with a "
        "binary 'bytes' field (the Hugging Face Image feature)"
    )
    pq.write_table(pa.table({"image": images, "w": [1, 2, 3]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "n.parquet")
    assert one_line(e) == (
        f"{tmp_path / 'n.parquet'}: no label column (a ClassLabel, or an integer or string column named "
        "label/labels/cls/class/target/category) among image: binary, w: int64; name it with label_column="
    )


def test_labels_stored_as_a_dictionary_patterns_of_patterns_and_files_that_lack_a_column(tmp_path, cache):
    images = [sample(i) for i in range(4)]
    words = pa.table({"image": images, "label": pa.array(["b", "a", "b", "c"]).dictionary_encode()})
    pq.write_table(words, tmp_path / "d.parquet")
    r = open_dataset(tmp_path / "d.parquet")
    # a dictionary column keeps its dictionary's order (here the order of first appearance), not sorted names
    assert r.columns.label_kind == "str" and r.classes == ["b", "a", "c"] and r.labels.tolist() == [0, 1, 0, 2]
    flat = pa.table({"key": ["k" * 1000] * 4, "jpg": images, "cls": [0, 1, 0, 1]})
    pq.write_table(flat, tmp_path / "f.parquet", row_group_size=2)
    f = open_dataset(tmp_path / "f.parquet")  # the image is the second column: its bytes, not the first's
    assert f.group_bytes.tolist() == [
        pq.ParquetFile(tmp_path / "f.parquet").metadata.row_group(g).column(1).total_uncompressed_size for g in (0, 1)
    ]
    write_hf(tmp_path / "snap", "train")
    write_hf(tmp_path / "snap", "test")
    both = open_dataset(str(tmp_path / "snap" / "data" / "{train,test}-*.parquet"))
    assert len(both) == 42 and both.source(21) == f"{tmp_path / 'snap' / 'data' / 'test-00000-of-00003.parquet'}:0"
    lacking = tmp_path / "snap" / "data" / "train-00003-of-00003.parquet"
    pq.write_table(pa.table({"image": [sample(1)]}), lacking)
    with pytest.raises(ValueError) as e:
        open_dataset(str(tmp_path / "snap" / "data" / "train-*.parquet"))
    assert one_line(e).startswith(f"{lacking}: label_column='label' is not a column; the columns are image: binary")
    (tmp_path / "two").mkdir()
    for name in ("a.parquet", "b.parquet", "train-00000-of-00001.parquet"):
        pq.write_table(hf_table([sample(0)], [0], NAMES), tmp_path / "two" / name)
    with pytest.raises(ValueError, match=r"several splits: \(other\) \(2 files\), train \(1 file\);"):
        open_dataset(tmp_path / "two")


def test_without_pyarrow_the_error_says_how_to_install_it(monkeypatch):
    import sys

    from dali_fast.data.parquet_index import ParquetUnavailable, pyarrow_parquet

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ParquetUnavailable) as e:
        pyarrow_parquet()
    assert one_line(e) == "reading Parquet needs pyarrow: pip install 'dali-fast[parquet]'"
    assert isinstance(e.value, ImportError) and isinstance(e.value, ValueError)


def test_a_row_group_reads_its_path_references_and_names_what_is_wrong(tmp_path):
    """Rows whose image is a path reference: the file's bytes, their verdict, and a file that cannot be read
    named with its path; the group's size counts them."""
    (tmp_path / "good.jpg").write_bytes(sample(0))
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [{"bytes": sample(1), "path": None}, None, None, None, {"bytes": sample(2), "path": None}]
    refs = {1: str(tmp_path / "gone.jpg"), 2: str(tmp_path / "good.jpg"), 3: str(tmp_path / "bad.jpg")}
    group = RowGroup(pa.chunked_array([pa.array(rows, image_type)]), "bytes", refs)
    assert [bytes(group.view(r)) for r in (0, 2, 4)] == [sample(1), sample(0), sample(2)]
    assert group.reasons == [
        None,
        f"unreadable: {tmp_path / 'gone.jpg'}: No such file or directory",  # and the rows after it still read
        None,
        "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)",
        None,
    ]
    assert group.nbytes == group.data.nbytes + group.offsets.nbytes + len(sample(0)) + len(b"not an image")
