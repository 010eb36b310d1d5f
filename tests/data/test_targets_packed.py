"""The packed format's version 3: a fixed-width target block per index row, byte for byte, covered by the
index crc and the row's crc32; version 2 packs still open; a newer version is refused with what to do."""

from __future__ import annotations

import json
import pickle
import zlib

import numpy as np
import pytest
from builders import jpeg_bytes, make_folder, one_line
from target_sets import K, N, row, sample_of, write_folder

from dali_fast import open_dataset, pack
from dali_fast.data.format import (
    DATA_FILE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    INDEX_FILE,
    RECORD_DTYPE,
    decode_targets,
    encode_targets,
    record_dtype,
    target_block_bytes,
)
from dali_fast.data.packed import MemmapReader, PackedTargets


def _header(dst):
    return np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)[0]


def _set_header(dst, **fields) -> None:
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    for k, v in fields.items():
        header[k] = v
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(header.tobytes())


@pytest.fixture
def packs(tmp_path):
    """A multi-hot and a float pack of the same 13 images, and the folder they came from."""
    out = {}
    for kind in ("multihot", "float"):
        src = write_folder(tmp_path / f"src-{kind}", kind)
        report = pack(src, tmp_path / kind, progress=False, target=kind, num_classes=K if kind == "multihot" else None)
        out[kind] = (tmp_path / kind, report, src)
    return out


def test_the_target_block_layout(packs):
    assert FORMAT_VERSION == 3
    assert [
        target_block_bytes(k, w)
        for k, w in [("class", 9), ("multihot", 1), ("multihot", 64), ("multihot", 65), ("float", 3)]
    ] == [0, 8, 8, 16, 12]
    assert record_dtype("class", 0) is RECORD_DTYPE and record_dtype("multihot", 5).itemsize == 40
    assert record_dtype("float", 3).names == (*RECORD_DTYPE.names, "target") and record_dtype("float", 3).itemsize == 44
    rows = np.array([[1, 0, 0, 1, 1, 0, 0, 0, 1], [0] * 8 + [1]], np.float32)
    blocks = encode_targets(rows, "multihot", 9)
    assert blocks.tolist() == [[0b00011001, 1, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]  # little-endian bits
    assert decode_targets(blocks, "multihot", 9).tolist() == rows.tolist()
    floats = encode_targets(np.array([[1.5, -2.0]], np.float32), "float", 2)
    assert floats.tobytes() == np.array([1.5, -2.0], "<f4").tobytes()
    assert decode_targets(floats, "float", 2).dtype == np.float32 and decode_targets(floats, "float", 2).tolist() == [
        [1.5, -2.0]
    ]


@pytest.mark.parametrize("kind", ["multihot", "float"])
def test_pack_writes_the_header_rows_and_crcs_exactly(packs, kind):
    dst, report, src = packs[kind]
    width = K if kind == "multihot" else 3
    assert (report.records, report.target, report.target_width, report.skipped) == (N, kind, width, [])
    assert report.summary().startswith(f"packed 13 records of 2 classes with {kind} targets of width {width} (")
    header = _header(dst)
    block = target_block_bytes(kind, width)
    assert (int(header["version"]), int(header["record_size"]), int(header["classes"])) == (3, 32 + block, 2)
    assert (int(header["target_kind"]), int(header["target_width"])) == ({"multihot": 1, "float": 2}[kind], width)
    meta = json.loads((dst / "meta.json").read_text())
    assert (meta["format_version"], meta["target"], meta["target_width"]) == (3, kind, width)
    raw = (dst / INDEX_FILE).read_bytes()
    assert len(raw) == 64 + N * (32 + block) and int(header["index_crc32"]) == zlib.crc32(raw[64:])
    rows = np.frombuffer(raw[64:], dtype=record_dtype(kind, width))
    data = (dst / DATA_FILE).read_bytes()
    sources = MemmapReader(dst, target="class").source
    for i, r in enumerate(rows):
        written = row(sample_of(sources(i)), kind)
        assert bytes(r["target"]) == encode_targets(written[None], kind, width)[0].tobytes()
        payload = data[int(r["offset"]) : int(r["offset"]) + int(r["length"])]
        assert int(r["crc32"]) == zlib.crc32(bytes(r["target"]), zlib.crc32(payload))  # the image, then its target
    reader = MemmapReader(dst)
    assert (reader.version, reader.stored_target, reader.target_kind) == (3, kind, kind)
    assert repr(reader) == f"MemmapReader({str(dst)!r}, records=13, classes=2, target={kind!r})"
    assert isinstance(reader.targets, PackedTargets) and len(reader.targets) == N and reader.targets.width == width
    np.testing.assert_array_equal(
        reader.targets.rows(range(N)), np.stack([row(sample_of(reader.source(i)), kind) for i in range(N)])
    )
    assert reader.targets.check(range(N)) == {} and reader.verify() == [] and reader.index_intact()
    assert reader.targets.rows([]).shape == (0, width) and reader.targets.rows([]).dtype == np.float32


@pytest.mark.parametrize("kind", ["multihot", "float"])
def test_a_flipped_byte_in_a_target_block_is_caught(packs, kind):
    dst, _, _ = packs[kind]
    reader = MemmapReader(dst)
    at = 64 + 4 * reader.records.dtype.itemsize + 32  # record 4's target block
    raw = bytearray((dst / INDEX_FILE).read_bytes())
    raw[at] ^= 0x02
    (dst / INDEX_FILE).write_bytes(bytes(raw))
    damaged = MemmapReader(dst)  # opening reads the header only
    assert damaged.verify() == [4] and not damaged.index_intact()
    assert damaged.targets.rows([4]).tolist() != [row(sample_of(reader.source(4)), kind).tolist()]


def test_a_version_2_pack_still_opens(small_folder, tmp_path):
    """A version-2 pack is a version-3 class pack byte for byte but for the version: its 8 reserved bytes
    (now the target kind and width) are zero, and its rows have no target block."""
    pack(small_folder, tmp_path / "v3", progress=False)
    pack(small_folder, tmp_path / "v2", progress=False)
    _set_header(tmp_path / "v2", version=2)
    v3, v2 = (tmp_path / "v3" / INDEX_FILE).read_bytes(), (tmp_path / "v2" / INDEX_FILE).read_bytes()
    assert v2[:8] == v3[:8] and v2[8:12] == (2).to_bytes(4, "little") and v2[12:] == v3[12:]
    reader = open_dataset(tmp_path / "v2")
    assert (reader.version, reader.target_kind, reader.targets, len(reader)) == (2, "class", None, 7)
    assert reader.classes == ["cat", "dog", "emu"] and reader.labels.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert bytes(reader[3][0]) == (small_folder / "dog" / "000.jpg").read_bytes()
    assert reader.verify() == [] and reader.index_intact()
    _set_header(tmp_path / "v2", target_kind=1, target_width=5)  # version 2 never reads those bytes
    again = MemmapReader(tmp_path / "v2")
    assert (again.stored_target, again.target_kind) == ("class", "class")
    with pytest.raises(ValueError) as e:
        MemmapReader(tmp_path / "v2", target="multihot", num_classes=5)
    assert one_line(e) == (
        f"{tmp_path / 'v2'}: packed with class targets, target='multihot' was asked for; open it with "
        "target='class', or pack it again from a source with multihot targets"
    )


def test_a_version_4_header_is_refused_with_what_to_do(packs):
    dst, _, _ = packs["multihot"]
    _set_header(dst, version=4)
    with pytest.raises(ValueError) as e:
        open_dataset(dst)
    assert one_line(e) == (
        f"{dst / INDEX_FILE}: format version 4, written by a newer dali_fast; this one reads versions 2 to 3: "
        "upgrade dali_fast (pip install -U dali-fast) to read it"
    )


def test_what_a_pack_with_targets_opens_as(packs, tmp_path):
    dst, _, src = packs["multihot"]
    as_class = open_dataset(dst, target="class")  # the class folders' labels, as stored beside the targets
    assert (as_class.target_kind, as_class.targets, as_class.stored_target) == ("class", None, "multihot")
    assert as_class.labels.tolist() == [0] * 7 + [1] * 6
    assert repr(as_class) == f"MemmapReader({str(dst)!r}, records=13, classes=2)"
    assert open_dataset(dst, target="multihot", num_classes=K).target_kind == "multihot"
    for kw, message in [
        ({"target": "float"}, f"{dst}: packed with multihot targets, target='float' was asked for; open it with "
         "target='multihot' or 'class', or pack it again from a source with float targets"),
        ({"target": "multihot", "num_classes": 4}, f"{dst}: packed with multihot targets of 5 classes, num_classes=4 "
         "was asked for; pass num_classes=5 or leave it out"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            open_dataset(dst, **kw)
        assert one_line(e) == message
    for kw, message in [
        ({"target": "multihot", "num_classes": 0}, "num_classes=0: must be a positive integer"),
        ({"target": "float", "num_classes": 5}, "num_classes=5 is for target='multihot' (the width of its rows); "
         "class targets take the data set's classes and float targets the length of their lists"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            MemmapReader(dst, **kw)
        assert one_line(e) == message
    for opened in (as_class, MemmapReader(dst)):  # workers reopen it as it was opened
        back = pickle.loads(pickle.dumps(opened))
        assert (back.target_kind, back.path) == (opened.target_kind, dst)
    _set_header(dst, target_kind=7)
    with pytest.raises(ValueError) as e:
        open_dataset(dst)
    assert one_line(e) == f"{dst / INDEX_FILE}: target kind code 7 is not one of [0, 1, 2]; pack the data set again"
    _set_header(dst, target_kind=1, target_width=70)  # 16 bytes of bits per row, not 8
    with pytest.raises(ValueError) as e:
        open_dataset(dst)
    assert one_line(e) == f"{dst / INDEX_FILE}: record size 40 != 48"


def test_pack_from_shards_with_targets_and_through_the_cli(tmp_path, cache, capsys):
    from test_targets import write_shards

    from dali_fast.cli import main

    shards = write_shards(tmp_path / "shards", "float", "object")
    assert main(["pack", str(shards), str(tmp_path / "p"), "--target", "float", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("packed 13 records of 3 classes with float targets of width 3 (")
    reader = open_dataset(tmp_path / "p")
    assert reader.labels.tolist() == [i % 3 for i in range(N)]  # the .cls labels, kept
    np.testing.assert_array_equal(reader.targets.rows(range(N)), np.stack([row(i, "float") for i in range(N)]))
    assert main(["pack", str(shards), str(tmp_path / "q"), "--num-classes", "3"]) == 2
    assert "num_classes=3 is for target='multihot'" in capsys.readouterr().err


def test_inspect_shows_the_labels_of_each_class(packs, tmp_path, capsys):
    from dali_fast.cli import main

    dst, _, src = packs["multihot"]
    assert main(["inspect", str(dst), "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # samples 0..12: every fourth has none; the others have {i % 5, (2i + 1) % 5}
    counts = np.stack([row(i, "multihot") for i in range(N)]).sum(axis=0).astype(int).tolist()
    per = ", ".join(f"{k}: {c}" for k, c in enumerate(counts))
    assert lines[5:] == [
        f"targets:  multihot, 5 classes, {sum(counts) / N:.2f} labels per record, 4 records with none",
        f"labels per class: {per}",
        f"labels per class: min {min(counts)} (class {counts.index(min(counts))}), max {max(counts)} (class {counts.index(max(counts))})",
        "verify:   all 13 records match their crc32 and decode (JPEGs strictly: libjpeg-turbo reports no damage)",
    ]
    bad = write_folder(tmp_path / "bad", "multihot", lists={0: [9]})
    assert main(["inspect", str(bad), "--target", "multihot", "--num-classes", "5"]) == 0
    assert ", 1 with a bad target (skipped or refused by the loaders)" in capsys.readouterr().out
    assert main(["inspect", str(packs["float"][0])]) == 0
    assert "targets:  float, 3 numbers per record, from -39 to 12" in capsys.readouterr().out
    assert main(["inspect", str(src)]) == 0  # class targets: no target lines
    assert "targets:" not in capsys.readouterr().out


def test_pack_leaves_out_images_without_a_row(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(20, 20), jpeg_bytes(21, 20)]})
    (src / "a" / "notes.txt").write_text("x")
    (src / "labels.csv").write_text("a/001.jpg,1\n")
    report = pack(src, tmp_path / "p", target="multihot", num_classes=2, progress=False)
    assert report.records == 1 and report.skipped == [(str(src / "a" / "000.jpg"), "no row in labels.csv")]
    assert report.ignored == [(str(src / "a" / "notes.txt"), "not an image file (by its name)")]  # not an image
    assert open_dataset(tmp_path / "p").targets.rows([0]).tolist() == [[0.0, 1.0]]


def test_pack_class_targets_as_before_and_list_problems_named(small_folder, tmp_path, monkeypatch):
    import os
    from pathlib import Path

    pack(small_folder, tmp_path / "default", progress=False)
    pack(small_folder, tmp_path / "class", progress=False, target="class")  # no labels.csv needed
    assert (tmp_path / "class" / INDEX_FILE).read_bytes() == (tmp_path / "default" / INDEX_FILE).read_bytes()
    for kw, message in [
        ({"target": "multihot", "num_classes": 0}, "num_classes=0: must be a positive integer"),
        ({"num_classes": 3}, "num_classes=3 is for target='multihot' (the width of its rows); class targets take "
         "the data set's classes and float targets the length of their lists"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            pack(small_folder, tmp_path / "refused", progress=False, **kw)
        assert one_line(e) == message and not (tmp_path / "refused").exists()
    src = write_folder(tmp_path / "src", "float", lists={8: [1.0]})
    with pytest.raises(ValueError) as e:
        pack(src, tmp_path / "bad", target="float", progress=False)
    assert one_line(e) == (
        f"record 8 ({src / 'b' / 'img08.jpg'}) has 1 target number, most records have 3 (1 record differ): float "
        "targets need the same count for every sample; fix its list"
    )
    real_scandir = os.scandir

    def scandir(path="."):  # class folder b cannot be listed
        if Path(path).name == "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    ok = write_folder(tmp_path / "ok", "float")
    (ok / "labels.csv").write_text("\n".join(f"a/img{i:02d}.jpg,1,2,3" for i in range(1, 7)) + "\n")
    report = pack(ok, tmp_path / "p", target="float", progress=False)
    assert report.records == 6 and report.skipped == [
        (str(ok / "b"), "folder cannot be listed: Permission denied"),
        (str(ok / "a" / "img00.jpg"), "no row in labels.csv"),
    ]
