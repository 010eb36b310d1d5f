"""Parquet read in place: the Hugging Face layout and flat columns, written by pyarrow here, read back
exactly; the index from the footers, cached and never reused for changed bytes; bad rows named."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from builders import hf_table, jpeg_bytes, one_line, png_bytes

from dali_fast import open_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from dali_fast.data.parquet import ParquetReader  # noqa: E402 (needs pyarrow)

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["cat", "dog", "emu", "fox"]
FILES, PER_FILE, GROUP = 3, 7, 3  # 21 rows: 3 files of 7 rows, row groups of 3, 3 and 1


def sample(i: int) -> bytes:
    """Row ``i``'s image: distinct bytes, a PNG every fifth row."""
    return png_bytes(20 + i, 10 + i % 7, "RGB") if i % 5 == 0 else jpeg_bytes(30 + i, 20 + i % 7)


def write_hf(root: Path, split: str = "train", *, bad: dict | None = None, names=NAMES) -> list[tuple[bytes, int]]:
    """``root/data/{split}-0000k-of-00003.parquet`` (a snapshot's layout); ``bad``: {row: (image, label)}
    overrides. Returns (image, label) of every row, in order."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    rows = [(sample(i), i % 4) for i in range(FILES * PER_FILE)]
    for i, row in (bad or {}).items():
        rows[i] = row
    for k in range(FILES):
        part = rows[k * PER_FILE : (k + 1) * PER_FILE]
        table = hf_table([r[0] for r in part], [r[1] for r in part], names)
        pq.write_table(table, root / "data" / f"{split}-{k:05d}-of-{FILES:05d}.parquet", row_group_size=GROUP)
    return rows


def test_hf_layout_reads_back_exactly_with_class_names_and_sources(tmp_path, cache):
    rows = write_hf(tmp_path / "snap")
    r = open_dataset(tmp_path / "snap")  # a snapshot's root: its data/*.parquet
    assert isinstance(r, ParquetReader) and len(r) == 21 and r.classes == NAMES
    assert r.group_rows.tolist() == [3, 3, 1] * 3 and r.shard_bounds[-1] == 21
    assert r.labels.tolist() == [lab for _, lab in rows]
    for i, (image, label) in enumerate(rows):
        data, got = r[i]
        assert bytes(data) == image and got == label
    first = tmp_path / "snap" / "data" / "train-00000-of-00003.parquet"
    assert r.source(0) == f"{first}:0"
    assert r.source(9) == f"{tmp_path / 'snap' / 'data' / 'train-00001-of-00003.parquet'}:2"
    assert r.source(-1) == f"{tmp_path / 'snap' / 'data' / 'train-00002-of-00003.parquet'}:6"
    datas, labels, bad = r.read_batch_checked([20, 0, 7, 7, 13, -1])
    assert bad == {} and [bytes(d) for d in datas] == [rows[i][0] for i in (20, 0, 7, 7, 13, 20)]
    assert labels.dtype == np.int64 and labels.tolist() == [rows[i][1] for i in (20, 0, 7, 7, 13, 20)]
    assert not datas[0].flags.owndata and not datas[0].flags.writeable  # a view into the row group's buffer
    for spec in (
        tmp_path / "snap" / "data",
        str(tmp_path / "snap" / "data" / "train-{00000..00002}-of-00003.parquet"),
        str(tmp_path / "snap" / "data" / "train-*.parquet"),
    ):
        same = open_dataset(spec)
        assert len(same) == 21 and bytes(same[20][0]) == rows[20][0] and same.fingerprint == r.fingerprint
    one = open_dataset(first)
    assert len(one) == 7 and one.classes == NAMES and r.fingerprint != one.fingerprint
    with pytest.raises(IndexError, match="record 21 out of range for a data set of 21 records"):
        r.read_batch_checked([0, 21])


def test_a_folder_of_several_splits_is_refused_and_a_pattern_picks_one(tmp_path, cache):
    write_hf(tmp_path / "snap", "train")
    write_hf(tmp_path / "snap", "test")
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "snap")
    assert one_line(e) == (
        f"{tmp_path / 'snap'}: holds the files of several splits: test (3 files), train (3 files); open one "
        f"split with a pattern, e.g. open_dataset('{tmp_path / 'snap' / 'data' / 'test'}-*.parquet')"
    )
    assert len(open_dataset(str(tmp_path / "snap" / "data" / "test-*.parquet"))) == 21
    with pytest.raises(FileNotFoundError, match=r"val-\*\.parquet: the pattern matches no file$"):
        open_dataset(str(tmp_path / "snap" / "data" / "val-*.parquet"))
    with pytest.raises(FileNotFoundError, match=r"/train-00003-of-00003\.parquet: no such Parquet file$"):
        open_dataset(str(tmp_path / "snap" / "data" / "train-{00002..00003}-of-00003.parquet"))


def test_flat_columns_found_by_name_or_named_and_classes_from_the_labels(tmp_path, cache):
    images = [sample(i) for i in range(10)]
    flat = pa.table({"key": [f"k{i}" for i in range(10)], "jpg": images, "cls": pa.array([i % 3 for i in range(10)])})
    pq.write_table(flat, tmp_path / "flat.parquet", row_group_size=4)
    r = open_dataset(tmp_path / "flat.parquet")
    assert (r.columns.image, r.columns.image_field, r.columns.label) == ("jpg", None, "cls")
    assert r.classes == ["0", "1", "2"] and [bytes(r[i][0]) for i in range(10)] == images
    # a second binary column: "jpg" is an image's name, "thumb" is not; two unnamed ones are refused
    with_thumb = flat.append_column("thumb", pa.array(images[::-1]))
    pq.write_table(with_thumb, tmp_path / "thumb.parquet")
    assert bytes(open_dataset(tmp_path / "thumb.parquet")[0][0]) == images[0]
    two = with_thumb.rename_columns(["key", "full", "cls", "thumb"]).append_column("width", pa.array(range(10)))
    pq.write_table(two, tmp_path / "two.parquet")
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "two.parquet")
    assert one_line(e) == (
        f"{tmp_path / 'two.parquet'}: 2 image-like columns (full, thumb) (binary, or struct<bytes: binary, path: "
        "string>) among key: string, full: binary, cls: int64, thumb: binary, width: int64; name it with image_column="
    )
    named = open_dataset(tmp_path / "two.parquet", image_column="thumb", label_column="width")
    assert named.classes == [str(k) for k in range(10)] and named.labels.tolist() == list(range(10))
    assert bytes(named[0][0]) == images[9]
    for kw, says in (
        ({"image_column": "jpeg"}, "image_column='jpeg' is not a column; the columns are key: string, full: binary"),
        ({"image_column": "key"}, "image_column='key' is string; an image column is binary, or a struct"),
        ({"image_column": "full", "label_column": "thumb"}, "label_column='thumb' is binary; a label column holds"),
    ):
        with pytest.raises(ValueError) as e:
            open_dataset(tmp_path / "two.parquet", **kw)
        assert one_line(e).startswith(f"{tmp_path / 'two.parquet'}: {says}")
    nolabel = pa.table({"image": images, "width": list(range(10))})
    pq.write_table(nolabel, tmp_path / "nolabel.parquet")
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "nolabel.parquet")
    assert one_line(e).endswith("among image: binary, width: int64; name it with label_column=")
    # string labels: the class names, sorted; a list column is not a class label
    words = pa.table({"image": images, "label": [["b", "a", "c"][i % 3] for i in range(10)]})
    pq.write_table(words, tmp_path / "words.parquet")
    w = open_dataset(tmp_path / "words.parquet")
    assert w.classes == ["a", "b", "c"] and w.labels.tolist() == [[1, 0, 2][i % 3] for i in range(10)]
    tags = pa.table({"image": images, "label": [[i % 3] for i in range(10)]})
    pq.write_table(tags, tmp_path / "tags.parquet")
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "tags.parquet", label_column="label")
    assert "label_column='label' is list<element: int64>; a label column holds one class per row" in one_line(e)
    (tmp_path / "folder" / "a").mkdir(parents=True)
    (tmp_path / "folder" / "a" / "x.jpg").write_bytes(images[1])
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "folder", image_column="jpg")
    assert one_line(e) == (
        f"{tmp_path / 'folder'}: image_column= and label_column= name the columns of Parquet files; this is not one"
    )


def test_bad_rows_are_named_by_file_and_row(tmp_path, cache, caplog):
    bad = {2: (b"not an image at all", 1), 4: (None, 2), 8: (sample(8), None), 12: (sample(12), 9)}
    rows = write_hf(tmp_path / "snap", bad=bad)
    r = open_dataset(tmp_path / "snap")
    f0, f1 = (tmp_path / "snap" / "data" / f"train-0000{k}-of-00003.parquet" for k in (0, 1))
    assert f"2 rows of 21 rows: a null label or one outside the 4 classes (first: {f1}:1: null label)" in caplog.text
    datas, labels, why = r.read_batch_checked(list(range(21)))
    assert why == {
        2: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)",
        4: "null image",
        8: "null label",
        12: "label 9 is not one of the data set's 4 classes (0..3)",
    }
    assert datas[4] is None and bytes(datas[2]) == rows[2][0] and labels[8] == -1 and labels[12] == 9
    assert [bytes(datas[i]) for i in range(21) if i not in why] == [rows[i][0] for i in range(21) if i not in why]
    assert r.label_problems == {8: "null label", 12: "label 9 is not one of the data set's 4 classes (0..3)"}
    assert r.source(4) == f"{f0}:4" and r.source(12) == f"{f1}:5"
    assert bytes(r[4][0]) == b"" and r[8][1] == -1  # the plain read: an empty image, the null label as -1


def test_a_damaged_row_group_is_a_bad_record_and_the_others_still_read(tmp_path, cache):
    rows = write_hf(tmp_path / "snap")
    r = open_dataset(tmp_path / "snap")
    f2 = tmp_path / "snap" / "data" / "train-00002-of-00003.parquet"
    md = pq.ParquetFile(f2).metadata
    col = md.row_group(1).column(0)  # image.bytes of rows 3-5 of the last file (records 17-19)
    blob = bytearray(f2.read_bytes())
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    blob[start : start + col.total_compressed_size] = b"\x07" * col.total_compressed_size
    stat = f2.stat()
    f2.write_bytes(bytes(blob))
    os.utime(f2, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    datas, _, bad = r.read_batch_checked([0, 17, 20])
    assert list(bad) == [1] and bad[1].startswith(f"unreadable: row group 1 of {f2}: ")
    assert bytes(datas[0]) == rows[0][0] and bytes(datas[2]) == rows[20][0] and datas[1] is None
    with pytest.raises(OSError, match="unreadable: row group 1 of"):
        r.read_batch([17])


def test_a_row_group_is_read_once_and_serves_every_row_of_it(tmp_path, cache, monkeypatch):
    write_hf(tmp_path / "snap")
    r = open_dataset(tmp_path / "snap")
    loads = []
    real = ParquetReader._load
    monkeypatch.setattr(ParquetReader, "_load", lambda self, g: loads.append(g) or real(self, g))
    r.read_batch_checked([0, 1, 2, 3, 20])  # groups 0, 1 and 8
    assert sorted(loads) == [0, 1, 8]
    r.read_batch_checked([2, 1, 0, 5, 4, 20])  # all kept in the LRU
    assert sorted(loads) == [0, 1, 8] and r.cache_stats()["hits"] == 3
    small = ParquetReader(tmp_path / "snap", row_group_cache=0)  # raised to two of the largest row group
    assert small.row_group_cache == 2 * int(small.group_bytes.max()) and small.streaming
    loads.clear()
    small.read_batch_checked([0, 3, 6, 0])  # three groups needed at once: each read once for the batch
    assert sorted(loads) == [0, 1, 2]


def test_the_index_is_cached_and_never_reused_for_changed_bytes(tmp_path, cache, monkeypatch):
    import dali_fast.data.parquet_index as pi

    write_hf(tmp_path / "snap")
    first = open_dataset(tmp_path / "snap")
    assert first.index_file.is_file() and first.index_file.parent == cache / "parquet-index"
    monkeypatch.setattr(pi, "build_index", lambda *a, **k: pytest.fail("indexed again"))
    again = open_dataset(tmp_path / "snap")
    assert again.index_file == first.index_file and np.array_equal(again.labels, first.labels)
    assert again.classes == NAMES and again.source(9) == first.source(9) and again.group_rows.tolist() == [3, 3, 1] * 3
    # The same size and modification time, other labels (a restore, `cp -p`): a new index all the same.
    f1 = tmp_path / "snap" / "data" / "train-00001-of-00003.parquet"
    stat = f1.stat()
    relabelled = [i % 4 for i in range(7, 14)][::-1]
    pq.write_table(hf_table([sample(i) for i in range(7, 14)], relabelled, NAMES), f1, row_group_size=GROUP)
    assert f1.stat().st_size == stat.st_size
    os.utime(f1, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.undo()
    changed = open_dataset(tmp_path / "snap")
    assert changed.index_file != first.index_file
    assert changed.labels[7:14].tolist() == relabelled != first.labels[7:14].tolist()


def test_reader_pickles_for_workers_and_reads_in_the_child(tmp_path, cache):
    rows = write_hf(tmp_path / "snap")
    r = open_dataset(tmp_path / "snap")
    r.read_batch_checked([3, 4])
    back = pickle.loads(pickle.dumps(r))
    assert back.cache_stats()["bytes"] == 0  # its own row groups
    assert [bytes(back[i][0]) for i in (3, 20)] == [rows[3][0], rows[20][0]] and back.classes == NAMES
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked DataLoader worker: reads on its own, with its own LRU
        ok = r.cache_stats()["bytes"] == 0 and bytes(r[5][0]) == rows[5][0]
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


def test_the_order_follows_the_set_size(tmp_path, cache):
    write_hf(tmp_path / "snap")
    r = ParquetReader(tmp_path / "snap")
    assert not r.streaming and r.shuffle_window == 9  # a small set fits in the row-group cache: random access
    big = ParquetReader(tmp_path / "snap", row_group_cache=2 * int(r.total_bytes) // 3)
    assert big.streaming and 1 <= big.shuffle_window < 9
    assert ParquetReader(tmp_path / "snap", streaming=True, shuffle_window=2).shuffle_window == 2
    with pytest.raises(ValueError, match="shuffle_window=0: must be a positive number of row groups"):
        ParquetReader(tmp_path / "snap", shuffle_window=0)


def test_without_pyarrow_the_package_imports_and_parquet_is_one_line(tmp_path, cache):
    write_hf(tmp_path / "snap")
    (tmp_path / "folder" / "a").mkdir(parents=True)
    (tmp_path / "folder" / "a" / "x.jpg").write_bytes(jpeg_bytes())
    code = f"""
import sys
sys.modules["pyarrow"] = None  # as if it were not installed
import dali_fast
from dali_fast import open_dataset
assert len(open_dataset({str(tmp_path / "folder")!r})) == 1
try:
    open_dataset({str(tmp_path / "snap")!r})
except ImportError as e:
    assert isinstance(e, ValueError)
    print(e)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "reading Parquet needs pyarrow: pip install 'dali-fast[parquet]'\n"


def test_the_fingerprint_follows_the_contents_not_where_the_files_are(tmp_path, cache):
    """A copy that keeps names and mtimes (another node's mount, `cp -p`) resumes; other labels do not."""
    import shutil

    write_hf(tmp_path / "snap")
    r = open_dataset(tmp_path / "snap")
    shutil.copytree(tmp_path / "snap", tmp_path / "copy")  # copy2: names and mtimes kept, new inodes
    copy = open_dataset(tmp_path / "copy")
    assert copy.index_file != r.index_file and copy.fingerprint == r.fingerprint
    write_hf(tmp_path / "other", names=NAMES, bad={3: (sample(3), 0)})  # one label differs
    for f in (tmp_path / "other" / "data").iterdir():  # the same names and mtimes as the first set
        os.utime(f, ns=(0, (tmp_path / "snap" / "data" / f.name).stat().st_mtime_ns))
    assert open_dataset(tmp_path / "other").fingerprint != r.fingerprint


def test_bad_target_arguments_are_refused_before_any_index_is_built(tmp_path, cache):
    write_hf(tmp_path / "snap")
    for kw, message in [
        ({"target": "multihot", "num_classes": 0}, "num_classes=0: must be a positive integer"),
        ({"target": "float", "num_classes": 3}, "num_classes=3 is for target='multihot'"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            ParquetReader(tmp_path / "snap", cache_dir=tmp_path / "index", **kw)
        assert not (tmp_path / "index").exists()  # refused before the files were read
    ParquetReader(tmp_path / "snap", cache_dir=tmp_path / "index")
    assert (tmp_path / "index").is_dir()  # where a reader that is built keeps its index
