"""WebDataset shards: brace patterns, the tar walk, and what a sample is (WebDataset's rules, per shard)."""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from builders import jpeg_bytes, tar_of, write_shards

from dali_fast import open_dataset
from dali_fast.data.shards import expand_shards, scan_tar
from dali_fast.data.webdataset import WebDatasetReader

wds = pytest.importorskip("webdataset")


def test_missing_labels_other_members_and_a_truncated_shard_are_counted_or_named(tmp_path, cache):
    extra = {3: {"cls": None}, 4: {"txt": b"a caption"}, 9: {"txt": b"x"}}
    root = tmp_path / "shards"
    root.mkdir()
    samples = []
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(10):
            image = jpeg_bytes(30 + i, 20)
            sample = {"__key__": f"s{i}", "jpg": image, **{k: v for k, v in extra.get(i, {}).items() if v is not None}}
            if i != 3:
                sample["cls"] = b"1"
            sink.write(sample)
            samples.append(image)
    with wds.TarWriter(str(root / "b.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"t{i}", "jpg": jpeg_bytes(40, 30 + i), "cls": b"2"})
    blob = (root / "b.tar").read_bytes()
    last = scan_tar(root / "b.tar")[0][-1]
    last_offset, last_size = last.offset, last.size
    (root / "b.tar").write_bytes(blob[: last_offset + last_size // 2])  # cut in the middle of the last image
    r = WebDatasetReader(root)
    assert len(r) == 9 + 3  # a.tar: all but the unlabelled s3; b.tar: the three whole samples
    assert r.skipped == [(f"{root / 'a.tar'}:s3", "no label (.cls, or .json with the label key)")]  # samples only
    assert r.damaged == [
        (
            str(root / "b.tar"),
            f"truncated: the file ends inside member t3.jpg (at byte {last_offset + last_size // 2} of the "
            f"{last_offset + last_size} it needs); that sample and any after it are lost",
        )
    ]
    assert r.ignored == Counter({"txt": 2})
    assert [bytes(r[i][0]) for i in range(9)] == [samples[i] for i in range(10) if i != 3]
    with pytest.raises(ValueError) as e:
        WebDatasetReader(root / "a.tar", on_error="raise")
    assert str(e.value).startswith(f"{root / 'a.tar'}:s3: no label") and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        WebDatasetReader(root / "b.tar", on_error="raise")
    assert str(e.value).startswith(f"{root / 'b.tar'}: truncated")


def test_json_labels_under_another_key(tmp_path, cache):
    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"k{i}", "jpg": jpeg_bytes(), "json": json.dumps({"class_id": i + 5}).encode()})
    assert WebDatasetReader(root, label_key="class_id").labels.tolist() == [5, 6, 7]
    assert open_dataset(root, label_key="class_id").labels.tolist() == [5, 6, 7]  # open_dataset passes it on
    with pytest.raises(ValueError, match="no samples with an image and a label"):
        WebDatasetReader(root)  # the default key "label" is not there: every sample is left out, and said


def test_brace_patterns_and_missing_shards(tmp_path):
    for name in ("x-000.tar", "x-001.tar", "y-000.tar"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in expand_shards(str(tmp_path / "x-{000..001}.tar"))] == ["x-000.tar", "x-001.tar"]
    assert [p.name for p in expand_shards(str(tmp_path / "{x,y}-000.tar"))] == ["x-000.tar", "y-000.tar"]
    with pytest.raises(FileNotFoundError) as e:
        expand_shards(str(tmp_path / "x-{000..003}.tar"))
    assert str(e.value) == f"{tmp_path / 'x-002.tar'} and 1 more: no such shard"


def test_scan_tar_reads_member_offsets(tmp_path):
    import tarfile

    write_shards(tmp_path / "s")
    path = tmp_path / "s" / "train-000001.tar"
    members, problem = scan_tar(path)
    with tarfile.open(path) as tf:
        theirs = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
    assert [(m.name, m.offset, m.size) for m in members if m.kind == "file"] == theirs and problem is None


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    return tar_of(path, members, tarfile.USTAR_FORMAT)


def test_a_key_that_comes_back_later_is_another_sample_as_webdataset_yields_it(tmp_path, cache, caplog):
    a, b, c = jpeg_bytes(30, 20), jpeg_bytes(31, 20), jpeg_bytes(32, 20)
    shard = _tar(
        tmp_path / "dup.tar",
        [("k.jpg", a), ("k.cls", b"1"), ("other.jpg", b), ("other.cls", b"2"), ("k.jpg", c), ("k.cls", b"3")],
    )
    theirs = [(s["__key__"], int(s["cls"])) for s in wds.WebDataset(str(shard), shardshuffle=False)]
    r = WebDatasetReader(shard)
    assert [(r.source(i).rpartition(":")[2].partition(".")[0], int(r.labels[i])) for i in range(len(r))] == theirs
    assert [bytes(r[i][0]) for i in range(len(r))] == [a, b, c] and r.skipped == []
    # Two members of one extension in one run of a key: which is meant cannot be told; named, never dropped silently.
    shard = _tar(tmp_path / "twice.tar", [("k.jpg", a), ("k.jpg", c), ("k.cls", b"1"), ("j.jpg", b), ("j.cls", b"0")])
    r = WebDatasetReader(shard)
    assert len(r) == 1 and r.skipped == [
        (f"{shard}:k", "two .jpg members under one key, one after the other; keep one of them")
    ]
    with pytest.raises(ValueError, match=r"twice.tar:k: two .jpg members under one key"):
        WebDatasetReader(shard, on_error="raise")


def test_pack_counts_what_a_duplicate_key_leaves_out(tmp_path, cache):
    from dali_fast.data.pack.packed import pack

    shard = _tar(
        tmp_path / "s.tar",
        [
            ("k.jpg", jpeg_bytes()),
            ("k.jpg", jpeg_bytes(40, 30)),
            ("k.cls", b"1"),
            ("j.jpg", jpeg_bytes(50, 20)),
            ("j.cls", b"0"),
        ],
    )
    report = pack(shard, tmp_path / "p", progress=False)
    assert report.records == 1 and report.skipped == [
        (f"{shard}:k", "two .jpg members under one key, one after the other; keep one of them")
    ]
    assert "left out 1" in report.summary()


@pytest.mark.parametrize("how", ["copy -p over it (same inode, new ctime)", "a restored file (new inode)"])
def test_a_shard_replaced_with_the_same_size_and_mtime_is_indexed_again(tmp_path, cache, how):
    import os
    import shutil

    shard = _tar(tmp_path / "s.tar", [("a.jpg", jpeg_bytes()), ("a.cls", b"1")])
    assert WebDatasetReader(shard).labels.tolist() == [1]
    stat = shard.stat()
    other = _tar(tmp_path / "other.tar", [("a.jpg", jpeg_bytes()), ("a.cls", b"7")])
    assert other.stat().st_size == stat.st_size
    if how.startswith("copy"):
        shutil.copyfile(other, shard)  # rewritten in place, then its mtime set back as cp -p does
    else:
        os.replace(other, shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_size == stat.st_size and shard.stat().st_mtime_ns == stat.st_mtime_ns
    assert WebDatasetReader(shard).labels.tolist() == [7]


@pytest.mark.parametrize("cls", [b"-1", b"1.5", b"cat", b"99999999999"])
def test_a_label_that_is_not_a_class_index_is_named_with_its_shard_key_and_value(tmp_path, cache, cls):
    shard = _tar(
        tmp_path / "s.tar", [("a.jpg", jpeg_bytes()), ("a.cls", cls), ("b.jpg", jpeg_bytes()), ("b.cls", b"0")]
    )
    with pytest.raises(ValueError) as e:
        WebDatasetReader(shard, on_error="raise")
    assert str(e.value).startswith(
        f"{shard}:a: label {cls.decode()!r}".replace("'-1'", "-1").replace("'99999999999'", "99999999999")
    )
    assert "\n" not in str(e.value) and "whole number from 0" in str(e.value)
    r = WebDatasetReader(shard)  # skip: counted and named
    assert len(r) == 1 and r.skipped[0][0] == f"{shard}:a"


def test_json_labels_must_be_whole_numbers(tmp_path, cache):
    shard = _tar(tmp_path / "ok.tar", [("a.jpg", jpeg_bytes()), ("a.json", b'{"label": "3"}')])
    assert WebDatasetReader(shard, on_error="raise").labels.tolist() == [3]  # a number written as text is one
    shard = _tar(tmp_path / "s.tar", [("a.jpg", jpeg_bytes()), ("a.json", b'{"label": 1.5}')])
    with pytest.raises(ValueError, match=r"s.tar:a: label 1.5 in its .json 'label'"):
        WebDatasetReader(shard, on_error="raise")


def test_pack_of_a_negative_label_is_one_line_exit_2_and_a_label_jump_is_named(tmp_path, cache, capsys, caplog):
    from dali_fast.cli import main
    from dali_fast.data.pack.packed import pack

    shard = _tar(tmp_path / "neg.tar", [("a.jpg", jpeg_bytes()), ("a.cls", b"-1")])
    assert main(["pack", str(shard), str(tmp_path / "p")]) == 2  # was an OverflowError traceback
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("dali-fast pack: error:") and not (tmp_path / "p").exists()
    assert any("1 x label -1 in its .cls" in m and "(first: " + str(shard) + ":a)" in m for m in caplog.messages)
    assert any(m.startswith("1 sample left out of 1 shard: 1 x ") for m in caplog.messages)  # not "1 samples"
    shard = _tar(
        tmp_path / "one.tar", [("a.jpg", jpeg_bytes()), ("a.cls", b"-1"), ("b.jpg", jpeg_bytes()), ("b.cls", b"0")]
    )
    report = pack(shard, tmp_path / "q", progress=False)
    assert report.records == 1 and report.skipped[0][0] == f"{shard}:a" and "label -1" in report.skipped[0][1]
    members = [
        (f"k{i}.{ext}", data) for i in range(3) for ext, data in (("jpg", jpeg_bytes()), ("cls", str(i).encode()))
    ]
    shard = _tar(tmp_path / "jump.tar", [*members, ("big.jpg", jpeg_bytes()), ("big.cls", b"99999")])
    with caplog.at_level("WARNING"):
        r = WebDatasetReader(shard)
    assert len(r.classes) == 100000
    assert any(
        "the largest label is 99999 (" in m and "jump.tar:big.jpg" in m and "4 have samples" in m
        for m in caplog.messages
    )
    caplog.clear()
    with caplog.at_level("WARNING"):
        WebDatasetReader(_tar(tmp_path / "dense.tar", members))
    assert not any("largest label" in m for m in caplog.messages)
