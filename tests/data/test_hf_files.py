"""Parquet files as Hugging Face ``datasets`` writes them: ``to_parquet`` of images made from files (path
references), a list of ``ClassLabel`` (multi-label), and ``save_to_disk`` folders. Written by ``datasets``
itself."""

from __future__ import annotations

import os

import numpy as np
import pytest
from builders import jpeg_bytes, jpeg_files, one_line

from dali_fast.data.open import open_dataset

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")


def _to_parquet(paths: list[str], labels: list[int], out) -> None:
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    datasets.Dataset.from_dict({"image": paths, "label": labels}, features=features).to_parquet(str(out))


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_to_parquet_path_references_are_read_from_their_files(tmp_path, cache, backend):
    paths = jpeg_files(tmp_path / "imgs")
    _to_parquet(paths, [0, 1, 2, 0, 1, 2], tmp_path / "d.parquet")
    theirs = datasets.Dataset.from_parquet(str(tmp_path / "d.parquet"))
    assert theirs.data.column("image").to_pylist()[0] == {"bytes": None, "path": paths[0]}  # what it wrote
    reader = open_dataset(tmp_path / "d.parquet")
    assert reader.classes == ["a", "b", "c"] and len(reader.refs) == 6
    assert [bytes(reader[i][0]) for i in range(6)] == [open(p, "rb").read() for p in paths]
    from target_sets import loader_class

    loader = loader_class(backend)(reader, 3, image_size=8, train=False, device="cpu")
    assert sorted(int(x) for _, labels in loader for x in labels) == [0, 0, 1, 1, 2, 2]


def test_relative_path_references_resolve_beside_the_file_then_from_here(tmp_path, cache, monkeypatch):
    jpeg_files(tmp_path / "set" / "imgs")
    monkeypatch.chdir(tmp_path / "set")  # datasets reads a relative path from the current folder as it writes
    _to_parquet([f"imgs/{i}.jpg" for i in range(6)], [0] * 6, tmp_path / "set" / "d.parquet")
    monkeypatch.chdir(tmp_path)
    reader = open_dataset(tmp_path / "set" / "d.parquet")  # beside the file, not in the current folder
    assert reader.refs.path(0) == str(tmp_path / "set" / "imgs" / "0.jpg")
    jpeg_files(tmp_path / "elsewhere")
    _to_parquet([f"elsewhere/{i}.jpg" for i in range(6)], [0] * 6, tmp_path / "set" / "e.parquet")
    reader = open_dataset(tmp_path / "set" / "e.parquet")  # datasets' own rule: from the current folder
    assert reader.refs.path(5) == str(tmp_path / "elsewhere" / "5.jpg")


def test_a_missing_path_reference_is_one_line_with_the_fix(tmp_path, cache):
    paths = jpeg_files(tmp_path / "imgs")
    _to_parquet(paths, [0] * 6, tmp_path / "d.parquet")
    os.remove(paths[2])
    with pytest.raises(FileNotFoundError) as e:
        open_dataset(tmp_path / "d.parquet")
    text = one_line(e)
    assert text.startswith(
        f"{tmp_path / 'd.parquet'}: column 'image' holds 6 images as paths to files (Hugging Face's "
        f"{{bytes: null, path}}), and 1 name no file (first: {paths[2]!r}, looked for at {paths[2]}); embed"
    )
    assert "embed_table_storage" in text and "push_to_hub" in text


def test_the_embedding_the_message_names_makes_a_file_that_holds_the_bytes(tmp_path, cache):
    from datasets.table import embed_table_storage

    paths = jpeg_files(tmp_path / "imgs")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    ds = datasets.Dataset.from_dict({"image": paths, "label": [0] * 6}, features=features)
    ds.with_format("arrow").map(embed_table_storage, batched=True).to_parquet(str(tmp_path / "e.parquet"))
    for p in paths:
        os.remove(p)
    reader = open_dataset(tmp_path / "e.parquet")
    assert reader.refs is None and len(reader) == 6 and bytes(reader[0][0])[:3] == b"\xff\xd8\xff"


def test_inspect_counts_path_references(tmp_path, cache):
    from dali_fast.tools.inspect import inspect_dataset

    _to_parquet(jpeg_files(tmp_path / "imgs"), [0] * 6, tmp_path / "d.parquet")
    lines: list[str] = []
    assert inspect_dataset(str(tmp_path / "d.parquet"), emit=lines.append, verify=True) == 0
    assert "paths:    6 of 6 images are paths to files (read from there)" in lines


def test_a_list_of_classlabel_names_the_classes_and_gives_num_classes(tmp_path, cache):
    features = datasets.Features(
        {"image": datasets.Image(), "tags": datasets.Sequence(datasets.ClassLabel(names=["x", "y", "z"]))}
    )
    images = [{"bytes": jpeg_bytes(8, 8 + i), "path": None} for i in range(3)]
    datasets.Dataset.from_dict({"image": images, "tags": [[0, 2], [1], []]}, features=features).to_parquet(
        str(tmp_path / "m.parquet")
    )
    with pytest.raises(ValueError) as e:  # no class label: the hint leads to the one call that works
        open_dataset(tmp_path / "m.parquet")
    assert one_line(e).endswith("'tags' is a list of ClassLabel (3 classes): open it with target='multihot' (label_column='tags' if there are several)")
    reader = open_dataset(tmp_path / "m.parquet", target="multihot")
    assert reader.classes == ["x", "y", "z"] and reader.targets.width == 3
    assert reader.targets.rows([0, 1, 2]).tolist() == [[1, 0, 1], [0, 1, 0], [0, 0, 0]]
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "m.parquet", target="multihot", num_classes=50)
    assert one_line(e) == (
        f"{tmp_path / 'm.parquet'}: num_classes=50, but the column 'tags' is a list of ClassLabel with 3 names; "
        "leave num_classes out, or give 3"
    )


def test_save_to_disk_folders_are_named_with_the_way_to_parquet(tmp_path, cache):
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a"])})
    ds = datasets.Dataset.from_dict({"image": jpeg_files(tmp_path / "imgs", 2), "label": [0, 0]}, features=features)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    for folder in ("saved", "dict"):
        with pytest.raises(ValueError) as e:
            open_dataset(tmp_path / folder)
        assert one_line(e).startswith(f"{tmp_path / folder}: a Hugging Face save_to_disk folder (Arrow files)")
        assert "to_parquet" in one_line(e)
    assert np.asarray(ds["label"]).tolist() == [0, 0]


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_path_references_in_every_row_group_are_read_from_their_files(tmp_path, cache, backend):
    """``to_parquet(batch_size=2)`` writes a row group per 2 rows: each group finds its own references."""
    import pyarrow.parquet as pq

    paths = jpeg_files(tmp_path / "imgs", 7)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    ds = datasets.Dataset.from_dict({"image": paths, "label": [i % 3 for i in range(7)]}, features=features)
    ds.to_parquet(str(tmp_path / "d.parquet"), batch_size=2)
    assert pq.ParquetFile(tmp_path / "d.parquet").metadata.num_row_groups == 4
    reader = open_dataset(tmp_path / "d.parquet")
    files = [open(p, "rb").read() for p in paths]
    assert [bytes(reader[i][0]) for i in range(7)] == files
    assert [bytes(b) for b in reader.read_batch(list(range(7)))[0]] == files
    from target_sets import loader_class

    loader = loader_class(backend)(reader, 3, image_size=8, train=False, device="cpu")
    assert sorted(int(x) for _, labels in loader for x in labels) == [0, 0, 0, 1, 1, 2, 2] and loader.skipped == 0


def test_a_label_outside_its_classlabel_is_named_in_its_own_numbers_under_declared_classes(tmp_path, cache):
    """A ClassLabel column holding 5 of 3 names (``datasets`` refuses to write it; pyarrow rewrites the
    column under the same schema and metadata): with the classes declared in another order, the bad record
    is named by the label it holds in the file, against the file's 3 names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _to_parquet(jpeg_files(tmp_path / "imgs", 3), [0, 1, 2], tmp_path / "ok.parquet")
    table = pq.read_table(tmp_path / "ok.parquet")
    at = table.schema.get_field_index("label")
    table = table.set_column(at, table.schema.field("label"), pa.array([2, 5, 0], table.schema.field("label").type))
    pq.write_table(table, tmp_path / "d.parquet")
    assert b"huggingface" in pq.read_schema(tmp_path / "d.parquet").metadata
    reader = open_dataset(tmp_path / "d.parquet", classes=["c", "b", "a"])
    assert reader.classes == ["c", "b", "a"]
    assert reader.label_problems == {1: "label 5 is not one of the data set's 3 classes (0..2)"}
    assert reader.labels[[0, 2]].tolist() == [0, 2]  # "c" and "a" on the declared order


def test_a_referenced_file_removed_after_opening_is_an_unreadable_record(tmp_path, cache):
    """The file behind a path reference goes away while the set is open: that record has no bytes (None,
    not an empty image) and names the file and the cause; read_batch raises it; a loader skips it."""
    paths = jpeg_files(tmp_path / "imgs")
    _to_parquet(paths, [0, 1, 2, 0, 1, 2], tmp_path / "d.parquet")
    reader = open_dataset(tmp_path / "d.parquet")
    os.remove(paths[4])
    datas, labels, bad = reader.read_batch_checked([3, 4, 5])
    assert datas[1] is None and bytes(datas[0]) == open(paths[3], "rb").read()
    assert bad == {1: f"unreadable: {paths[4]}: No such file or directory"} and labels.tolist() == [0, 1, 2]
    with pytest.raises(OSError, match="unreadable: .*4.jpg: No such file or directory"):
        reader.read_batch([4])
    from dali_fast import TorchIterator

    loader = TorchIterator(reader, 3, image_size=8, train=False, device="cpu", num_workers=0, on_error="skip")
    assert sorted(int(x) for _, labels in loader for x in labels) == [0, 0, 1, 2, 2] and loader.skipped == 1
