"""The tar walk reads what `tarfile` and webdataset read: shards written by webdataset's `ShardWriter`
(tarfile's default PAX format) and by `tarfile` in each format, with long and non-ASCII names; and every
member that forms no sample is named by its rule, never dropped in silence."""

from __future__ import annotations

import io
import logging
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from builders import jpeg_bytes, tar_of

from dali_fast.data import shards
from dali_fast.data.open import open_dataset
from dali_fast.data.tar import scan_tar
from dali_fast.data.webdataset import WebDatasetReader

wds = pytest.importorskip("webdataset")

LONG = "n" * 90 + "/very_long_folder_name_that_goes_on/"  # with a key, a member name over 100 bytes


def _keys(n: int) -> list[str]:
    """1 key in 10 over 100 bytes, and classes named in Japanese, as people name their folders."""
    names = ["猫", "犬", "鳥", "魚"]
    return [f"{LONG}{i:04d}" if i % 10 == 3 else f"{names[i % 4]}/{i:04d}" for i in range(n)]


def _write_shardwriter(folder: Path, n: int = 400) -> dict[str, tuple[bytes, int]]:
    folder.mkdir()
    truth = {}
    with wds.ShardWriter(str(folder / "s-%06d.tar"), maxcount=150, verbose=0) as sink:
        for i, key in enumerate(_keys(n)):
            image = jpeg_bytes(8 + i % 5, 8, (i % 256, 7, 9))
            sink.write({"__key__": key, "jpg": image, "cls": i % 4})
            truth[key] = (image, i % 4)
    return truth


def _theirs(spec: str) -> dict[str, tuple[bytes, int]]:
    """What webdataset's own reader yields: key -> (image bytes, label)."""
    return {s["__key__"]: (s["jpg"], int(s["cls"])) for s in wds.WebDataset(spec, shardshuffle=False)}


def _ours(reader) -> dict[str, tuple[bytes, int]]:
    out = {}
    for i in range(len(reader)):
        member = reader.source(i).split(".tar:", 1)[1]
        out[member.rpartition(".")[0]] = (bytes(reader[i][0]), int(reader.labels[i]))
    return out


def test_shardwriter_shards_with_long_and_non_ascii_keys_read_as_webdataset_reads_them(tmp_path, cache):
    truth = _write_shardwriter(tmp_path / "shards")
    spec = str(tmp_path / "shards" / "s-{000000..000002}.tar")
    theirs = _theirs(spec)
    assert theirs == truth  # webdataset reads every sample back, its key whole
    reader = open_dataset(spec)
    assert len(reader) == 400 and reader.skipped == [] and _ours(reader) == truth
    assert reader.classes == ["0", "1", "2", "3"]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tarfile_in_each_format_long_and_non_ascii_names(tmp_path, cache, fmt):
    names = [f"{k}.{ext}" for k in _keys(40) for ext in ("jpg", "cls")]
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=fmt, encoding="utf-8") as tf:
        for k, name in enumerate(names):
            data = jpeg_bytes(8, 8, (k, 1, 2)) if name.endswith(".jpg") else str(k % 3).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if fmt != tarfile.USTAR_FORMAT:  # a link with a long target: GNU writes a K header, PAX a linkpath
            link = tarfile.TarInfo("a_link.jpg")
            link.type, link.linkname = tarfile.SYMTYPE, "x" * 150 + ".jpg"
            tf.addfile(link)
    with tarfile.open(path) as tf:
        expected = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
    members, problem = scan_tar(path)
    assert problem is None
    assert [(m.name, m.offset, m.size) for m in members if m.kind == "file"] == expected
    reader = WebDatasetReader(path, cache_dir=tmp_path / "c")
    assert _ours(reader) == _theirs(str(path))
    assert len(reader) == 40 and reader.skipped == []
    assert reader.ignored == (Counter({"(symbolic link)": 1}) if fmt != tarfile.USTAR_FORMAT else Counter())


def test_a_pax_global_header_and_a_non_utf8_name(tmp_path, cache):
    """A global header (tarfile writes one for ``pax_headers=``) moves every offset after it; a name that
    is not UTF-8 keeps its bytes, as `tarfile` keeps them."""
    path = tmp_path / "g.tar"
    image = jpeg_bytes()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "made by a test"}) as tf:
        for name, data in (("a.jpg", image), ("a.cls", b"1"), ("b\udce9.jpg", image), ("b\udce9.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tf:
        expected = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
    assert [(m.name, m.offset, m.size) for m in scan_tar(path)[0]] == expected
    reader = WebDatasetReader(path, cache_dir=tmp_path / "c")
    assert [reader.source(i).rpartition(":")[2] for i in range(2)] == ["a.jpg", "b\udce9.jpg"]


def test_an_index_saved_by_the_old_walk_is_not_used(tmp_path, cache, monkeypatch):
    """The index's version is in its key: an index an older walk saved (here one that lost samples) is
    never read back for the shard; the shard is indexed again."""
    import numpy as np

    from dali_fast.data import webdataset

    _write_shardwriter(tmp_path / "shards", 20)
    spec = str(tmp_path / "shards" / "s-000000.tar")
    monkeypatch.setattr(webdataset, "INDEX_VERSION", 5)
    old = WebDatasetReader(spec)
    with np.load(old.index_file) as z:  # what the old walk would have kept: fewer samples
        arrays = {k: z[k][:3] if k in ("shard_of", "offset", "size", "labels") else z[k] for k in z.files}
    np.savez(old.index_file, **arrays)
    assert len(WebDatasetReader(spec)) == 3  # under the old version's key, the saved index is read
    monkeypatch.undo()
    assert len(WebDatasetReader(spec)) == 20


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    return tar_of(path, members)


def test_members_that_form_no_sample_are_named_by_rule(tmp_path, cache, caplog):
    image = jpeg_bytes()
    path = _tar(
        tmp_path / "mixed.tar",
        [
            ("n01440764/img.001.jpg", image),  # a dotted key: its key is n01440764/img, its extension 001.jpg
            ("n01440764/img.001.cls", b"1"),
            ("orphan.cls", b"2"),  # a label without an image
            ("notes.txt", b"a caption of nothing"),  # other extensions only
            ("README", b"no dot"),  # no key
            ("__meta__/info.json", b"{}"),  # passed over, as webdataset passes over it
            ("good.jpg", image),
            ("good.cls", b"0"),
            ("good.txt", b"its caption"),  # read by no one, but part of a sample: counted
        ],
    )
    with caplog.at_level(logging.WARNING):
        reader = WebDatasetReader(path, cache_dir=tmp_path / "c")
    assert len(reader) == 1 and reader.source(0) == f"{path}:good.jpg"
    assert reader.skipped == [
        (f"{path}:README", shards.NO_KEY),
        (f"{path}:n01440764/img.001.jpg", shards.DOTTED),
        (f"{path}:orphan", shards.NO_IMAGE),
        (f"{path}:notes.txt", shards.OTHER_ONLY),
    ]
    assert reader.ignored == Counter({"txt": 1, "(metadata)": 1})
    said = [m for m in caplog.messages if "left out of 1 shard" in m]
    assert said == [
        f"4 samples left out of 1 shard: 1 x {shards.NO_KEY} (first: {path}:README); "
        f"1 x {shards.DOTTED} (first: {path}:n01440764/img.001.jpg); 1 x {shards.NO_IMAGE} (first: {path}:orphan); "
        f"1 x {shards.OTHER_ONLY} (first: {path}:notes.txt)"
    ]


def test_a_shard_of_dotted_keys_only_says_what_it_found(tmp_path, cache):
    image = jpeg_bytes()
    # webdataset's rule makes one key (cls/img) of all five: each image its writer meant is named
    members = [(f"cls/img.{i:03d}.{ext}", data) for i in range(5) for ext, data in (("jpg", image), ("cls", b"1"))]
    path = _tar(tmp_path / "dotted.tar", members)
    with pytest.raises(ValueError) as e:
        WebDatasetReader(path, cache_dir=tmp_path / "c")
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}: no samples with an image and a label in 1 shard; left out: ")
    first = f"{path}:cls/img.000.jpg, {path}:cls/img.001.jpg, {path}:cls/img.002.jpg, ..."
    assert text.endswith(f"left out: 5 x {shards.DOTTED} (first: {first})")


def test_inspect_lists_what_forms_no_sample(tmp_path, cache):
    from dali_fast.tools.inspect import inspect_dataset

    image = jpeg_bytes()
    path = _tar(
        tmp_path / "s.tar",
        [("a.jpg", image), ("a.cls", b"0"), ("a.txt", b"x"), ("b.002.jpg", image), ("b.002.cls", b"0")],
    )
    lines: list[str] = []
    assert inspect_dataset(str(path), emit=lines.append) == 0
    assert f"skipped:  1: 1 x {shards.DOTTED} (first: {path}:b.002.jpg)" in lines
    assert "not read: 1 .txt" in lines


def test_a_label_of_two_to_the_31_is_refused_in_one_line_not_allocated(tmp_path, cache):
    image = jpeg_bytes()
    path = _tar(tmp_path / "big.tar", [("a.jpg", image), ("a.cls", b"0"), ("b.jpg", image), ("b.cls", b"2147483647")])
    with pytest.raises(ValueError) as e:
        WebDatasetReader(path, cache_dir=tmp_path / "c")
    assert str(e.value) == (
        f"{path}:b.jpg: label 2147483647 would make 2,147,483,648 classes, more than 10,000,000; a label is a "
        "class index 0..K-1: fix that label"
    )
    with pytest.raises(ValueError) as e:  # declared classes: the label is beyond them, named the same way
        WebDatasetReader(path, cache_dir=tmp_path / "c", classes=["zero", "one"])
    assert str(e.value) == (
        f"{path}: {path}:b.jpg has label 2147483647, beyond the 2 declared classes (0..1); declare every class "
        "of the data set (the training set's list)"
    )


def test_one_shard_named_by_a_brace_pattern(tmp_path, cache):
    _tar(tmp_path / "s-000000.tar", [("a.jpg", jpeg_bytes()), ("a.cls", b"0")])
    reader = open_dataset(str(tmp_path / "s-{000000..000000}.tar"))
    assert len(reader) == 1 and reader.shards == [tmp_path / "s-000000.tar"]


def test_a_cls_and_a_json_label_that_disagree_are_named(tmp_path, cache):
    """ShardWriter writes a .cls and a .json side by side; when both give a class index and they differ,
    which is meant cannot be told: the sample is left out and named (a class name in the .json is not an
    index, and is not compared)."""
    image = jpeg_bytes()
    with wds.ShardWriter(str(tmp_path / "s-%06d.tar"), maxcount=10, verbose=0) as sink:
        sink.write({"__key__": "same", "jpg": image, "cls": 3, "json": {"label": 3}})
        sink.write({"__key__": "other", "jpg": image, "cls": 3, "json": {"label": 5}})
        sink.write({"__key__": "named", "jpg": image, "cls": 1, "json": {"label": "cat"}})
    reader = WebDatasetReader(tmp_path / "s-000000.tar", cache_dir=tmp_path / "c")
    assert [reader.source(i).rpartition(":")[2] for i in range(len(reader))] == ["same.jpg", "named.jpg"]
    assert reader.skipped == [
        (f"{tmp_path / 's-000000.tar'}:other", "its .cls says 3 and its .json 'label' says 5; keep one label")
    ]
