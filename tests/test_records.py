import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import jpeg_bytes, make_folder

from dali_fast.records import (
    DATA_FILE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    INDEX_FILE,
    QUICK_MIN,
    RECORD_DTYPE,
    ImageFolderReader,
    MemmapReader,
    check_encoded,
    open_dataset,
    pack,
)
from dali_fast.synthetic import make_synthetic


def source_items(root: Path):
    """(bytes, label) of every image, in ImageFolder order."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    out = []
    for label, c in enumerate(classes):
        for f in sorted((root / c).iterdir()):
            out.append((f.read_bytes(), label, str(f.relative_to(root))))
    return classes, out


def test_pack_roundtrip_exact_bytes_and_labels(small_folder, tmp_path):
    dst = tmp_path / "packed"
    report = pack(small_folder, dst, progress=False)
    classes, items = source_items(small_folder)
    assert report.records == len(items) == 7 and report.skipped == []
    r = MemmapReader(dst)
    assert r.classes == classes == ["cat", "dog", "emu"]
    assert len(r) == 7
    for i, (data, label, rel) in enumerate(items):
        view, lab = r[i]
        assert view.dtype == np.uint8 and bytes(view) == data
        assert lab == label
        assert r.source(i) == rel
    views, labels = r.read_batch([6, 0, 3])
    assert [bytes(v) for v in views] == [items[6][0], items[0][0], items[3][0]]
    assert labels.tolist() == [items[6][1], items[0][1], items[3][1]]
    assert r.verify() == []
    assert r[-1][1] == items[-1][1]
    with pytest.raises(IndexError):
        r[7]


def test_memmap_views_are_zero_copy_and_read_only(small_folder, tmp_path):
    pack(small_folder, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    view, _ = r[1]
    assert not view.flags.owndata and not view.flags.writeable


def test_reader_pickles_by_path(small_folder, tmp_path):
    import pickle

    pack(small_folder, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    blob = pickle.dumps(r)
    assert len(blob) < 500  # the path, not the data
    r2 = pickle.loads(blob)
    assert bytes(r2[2][0]) == bytes(r[2][0])


def test_flipped_byte_found_by_verify(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    r = MemmapReader(dst)
    off = int(r.records[4]["offset"]) + 10
    del r
    _flip_byte(dst / DATA_FILE, off, 0xFF)
    assert MemmapReader(dst).verify() == [4]


def _flip_byte(path: Path, at: int, mask: int) -> None:
    """XOR the byte at offset ``at`` of ``path`` with ``mask`` (a bit flip on disk)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_truncated_data_file(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    size = (dst / DATA_FILE).stat().st_size
    os.truncate(dst / DATA_FILE, size - 5)
    with pytest.raises(ValueError) as e:
        open_dataset(dst)
    msg = _one_line(e)
    assert "data.bin" in msg and "truncated" in msg and str(size) in msg


def test_truncated_index_file(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    os.truncate(dst / INDEX_FILE, (dst / INDEX_FILE).stat().st_size - 3)
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert "index.bin" in _one_line(e) and "truncated" in str(e.value)


def test_wrong_magic(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(b"NOTMAGIC")
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert "index.bin" in _one_line(e) and "magic" in str(e.value)


def test_future_version_names_both(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    header["version"] = FORMAT_VERSION + 6
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(header.tobytes())
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    msg = _one_line(e)
    assert f"version {FORMAT_VERSION + 6}" in msg and f"version {FORMAT_VERSION}" in msg


def test_missing_index(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    (dst / INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(dst)
    assert "index.bin" in _one_line(e) and "missing" in str(e.value)


def test_bad_images_left_out_and_reported(tmp_path):
    good = jpeg_bytes(40, 40)
    src = make_folder(tmp_path / "src", {"a": [good, good[: len(good) // 2]], "b": [b"", os.urandom(300), good]})
    # names: a/000.jpg good, a/001.jpg truncated, b/000.jpg empty, b/001.jpg random, b/002.jpg good
    report = pack(src, tmp_path / "p", progress=False)
    assert report.records == 2
    reasons = dict(report.skipped)
    assert set(reasons) == {str(src / "a/001.jpg"), str(src / "b/000.jpg"), str(src / "b/001.jpg")}
    assert "empty" in reasons[str(src / "b/000.jpg")]
    assert "undecodable" in reasons[str(src / "a/001.jpg")]
    r = MemmapReader(tmp_path / "p")
    assert [r.source(i) for i in range(2)] == ["a/000.jpg", "b/002.jpg"]
    assert [r[i][1] for i in range(2)] == [0, 1]


def test_no_verify_still_rejects_structurally_bad(tmp_path):
    good = jpeg_bytes(40, 40)
    src = make_folder(tmp_path / "src", {"a": [good, good[:100], b""]})
    report = pack(src, tmp_path / "p", verify=False, progress=False)
    assert report.records == 1 and len(report.skipped) == 2


def test_max_side_reencodes(tmp_path):
    from PIL import Image

    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(300, 100), jpeg_bytes(50, 40)]})
    report = pack(src, tmp_path / "p", max_side=120, progress=False)
    assert report.reencoded == 1
    r = MemmapReader(tmp_path / "p")
    import io

    assert Image.open(io.BytesIO(bytes(r[0][0]))).size == (120, 40)
    assert bytes(r[1][0]) == (src / "a/001.jpg").read_bytes()


def test_pack_refuses_existing_dst(small_folder, tmp_path):
    (tmp_path / "p").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        pack(small_folder, tmp_path / "p", progress=False)


@pytest.mark.slow
def test_killed_pack_leaves_no_dst(tmp_path):
    src = tmp_path / "src"
    make_synthetic(src, images=30, classes=3, progress=False)
    for f in list(src.rglob("*.jpg")):  # 300 full-size images, quickly: pack has real work to be killed in
        for k in range(1, 10):
            (f.parent / f"{f.stem}_{k}.jpg").write_bytes(f.read_bytes())
    dst = tmp_path / "packed"
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from dali_fast import pack; pack({str(src)!r}, {str(dst)!r}, progress=False)"]
    )
    # kill as soon as the temporary folder has data in it
    deadline = time.time() + 60
    while time.time() < deadline:
        tmps = list(tmp_path.glob(".packed.tmp-*/data.bin"))
        if tmps and tmps[0].stat().st_size > 0:
            break
        time.sleep(0.01)
    assert tmps, "pack did not start writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    # the next pack removes the dead run's leftovers and completes
    report = pack(src, dst, progress=False, verify=False)
    assert report.records == 300
    assert list(tmp_path.glob(".packed.tmp-*")) == []


def test_image_folder_reader_same_interface(small_folder, tmp_path):
    pack(small_folder, tmp_path / "p", progress=False)
    a, b = ImageFolderReader(small_folder), open_dataset(tmp_path / "p")
    assert isinstance(open_dataset(small_folder), ImageFolderReader)
    assert a.classes == b.classes and len(a) == len(b)
    for i in range(len(a)):
        assert bytes(a[i][0]) == bytes(b[i][0]) and a[i][1] == b[i][1]
    assert Path(a.source(0)).is_file()


def test_open_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such data set"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "x.jpg").write_bytes(jpeg_bytes())
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "flat")
    assert _one_line(e) == (
        f"{tmp_path / 'flat'}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )


def test_check_encoded():
    good = jpeg_bytes()
    assert check_encoded(good) is None
    assert check_encoded(np.frombuffer(good, np.uint8)) is None
    assert "empty" in check_encoded(b"")
    assert "truncated JPEG" in check_encoded(good[:-200])
    assert "not a JPEG or PNG" in check_encoded(b"hello world")
    from conftest import png_bytes

    png = png_bytes()
    assert check_encoded(png) is None
    assert "truncated PNG" in check_encoded(png[:-20])


def test_reencoded_pack_passes_verify(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(300, 100), jpeg_bytes(50, 40)], "b": [jpeg_bytes(90, 400)]})
    report = pack(src, tmp_path / "p", max_side=64, progress=False)
    assert report.reencoded == 2  # 50x40 already fits
    r = MemmapReader(tmp_path / "p")
    assert r.verify() == []
    assert [int(x) for x in r.records["crc32"]] == [zlib.crc32(bytes(r[i][0])) for i in range(3)]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_verify_finds_a_flipped_byte_anywhere_in_a_record(tmp_path, where):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(120, 90), jpeg_bytes(100, 80)]})
    dst = tmp_path / "p"
    pack(src, dst, progress=False)
    r = MemmapReader(dst)
    offset, length = int(r.records[1]["offset"]), int(r.records[1]["length"])
    assert length > 1000
    at = offset + {"first": 0, "middle": length // 2, "last": length - 1}[where]
    del r
    _flip_byte(dst / DATA_FILE, at, 0x01)
    assert MemmapReader(dst).verify() == [1]


def test_reader_indexing_edges_and_batch_reads(small_folder, tmp_path):
    report = pack(small_folder, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    n = len(r)
    assert bytes(r[-1][0]) == bytes(r[n - 1][0]) and r.source(-1) == r.source(n - 1)
    for bad in (n, -n - 1):
        with pytest.raises(IndexError) as e:
            r[bad]
        assert str(e.value) == f"record {bad} out of range for a data set of {n} records"
    views, labels = r.read_batch([4, 0, 4])
    assert labels.dtype == np.int64 and labels.tolist() == [r[4][1], r[0][1], r[4][1]]
    assert [bytes(v) for v in views] == [bytes(r[4][0]), bytes(r[0][0]), bytes(r[4][0])]
    assert r.labels.dtype == np.int64 and r.labels.tolist() == [r[i][1] for i in range(n)]
    assert repr(r) == f"MemmapReader({str(tmp_path / 'p')!r}, records={n}, classes=3)"
    mib = report.data_bytes / 2**20
    assert report.summary() == (
        f"packed {n} records of 3 classes ({mib:.1f} MiB) into {tmp_path / 'p'} in {report.seconds:.1f}s; "
        "re-encoded 0, left out 0"
    )


def test_a_class_folder_that_cannot_be_listed_is_named_not_dropped(tmp_path, monkeypatch, caplog):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes()], "b": [jpeg_bytes(), jpeg_bytes(40, 30)]})
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path).name == "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with caplog.at_level("WARNING"):
        reader = ImageFolderReader(src)
    assert reader.classes == ["a", "b"] and len(reader) == 1  # labels keep their meaning
    assert reader.skipped == [(str(src / "b"), "folder cannot be listed: Permission denied")]
    assert any(str(src / "b") in r.getMessage() for r in caplog.records)
    report = pack(src, tmp_path / "p", progress=False)
    assert (str(src / "b"), "folder cannot be listed: Permission denied") in report.skipped


def test_non_utf8_file_names_are_packed_and_named(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    name = os.fsdecode(b"caf\xe9.jpg")  # Latin-1 bytes, not UTF-8
    (src / "a" / name).write_bytes(jpeg_bytes())
    report = pack(src, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    assert report.records == 1 and r.source(0) == os.path.join("a", name)


def test_labels_outside_the_classes_are_bad_records():
    from dali_fast.records import read_checked

    class Labelled:
        classes = ["a", "b"]

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.frombuffer(jpeg_bytes(), np.uint8), [0, 2, -1][i]

        def source(self, i):
            return f"mem://{i}"

    r = Labelled()
    assert read_checked(r, 0)[2] is None
    assert read_checked(r, 1)[2] == "label 2 is not one of the data set's 2 classes (0..1)"
    assert read_checked(r, 2)[2] == "label -1 is not one of the data set's 2 classes (0..1)"


# ----------------------------------------------------------------------------- the index and labels are protected


def _rewrite_label(dst: Path, record: int, label: int, fix_crc: bool) -> None:
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    rows = np.fromfile(dst / INDEX_FILE, dtype=RECORD_DTYPE, offset=HEADER_DTYPE.itemsize)
    rows["label"][record] = label
    if fix_crc:
        header["index_crc32"] = zlib.crc32(rows.tobytes())
    with open(dst / INDEX_FILE, "wb") as f:
        f.write(header.tobytes() + rows.tobytes())


def test_a_changed_label_fails_verify(small_folder, tmp_path, capsys):
    from dali_fast.cli import main

    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    assert MemmapReader(dst).index_intact()
    _rewrite_label(dst, 2, 1, fix_crc=False)  # record 2 is a "cat" (0); now it says "dog"
    assert not MemmapReader(dst).index_intact()
    assert main(["inspect", str(dst), "--verify"]) == 1
    assert "the index does not match its checksum" in capsys.readouterr().out


def test_a_label_outside_the_classes_is_refused_in_one_line(small_folder, tmp_path):
    from dali_fast.cli import main

    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    _rewrite_label(dst, 4, 4_000_000_000, fix_crc=True)  # even with a matching checksum
    r = MemmapReader(dst)
    with pytest.raises(ValueError) as e:
        _ = r.labels
    assert _one_line(e) == (
        f"{dst / INDEX_FILE}: record 4 has label 4000000000, but there are 3 classes; "
        "check it with `dali-fast inspect --verify` and pack the data set again"
    )
    assert main(["inspect", str(dst)]) == 2  # one line, no 30 GiB bincount
    from dali_fast.records import read_checked

    assert read_checked(r, 4)[2] == "label 4000000000 is not one of the data set's 3 classes (0..2)"


@pytest.mark.parametrize(
    "meta, says",
    [
        ('{"classes": ["cat", "dog"]}', "lists 2 classes, the index was written for 3"),
        ("{}", "has no 'classes' list of names"),
        ("not json at all", "not valid JSON"),
        ('{"classes": [1, 2, 3]}', "has no 'classes' list of names"),
        ('["a", "b", "c"]', "has no 'classes' list of names"),
    ],
)
def test_meta_json_must_match_the_index(small_folder, tmp_path, meta, says):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    (dst / "meta.json").write_text(meta)
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert _one_line(e).startswith(f"{dst / 'meta.json'}: ") and says in str(e.value)


def test_a_version_1_pack_is_refused_with_what_to_do(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    header["version"] = 1
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(header.tobytes())
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert _one_line(e) == (
        f"{dst / INDEX_FILE}: format version 1 (an older dali_fast, whose labels were not checksummed), "
        "this dali_fast reads version 2; pack the data set again with `dali-fast pack`"
    )


def test_fingerprint_tells_data_sets_apart(small_folder, tmp_path):
    pack(small_folder, tmp_path / "a", progress=False)
    pack(small_folder, tmp_path / "b", progress=False)
    assert MemmapReader(tmp_path / "a").fingerprint == MemmapReader(tmp_path / "b").fingerprint
    _rewrite_label(tmp_path / "b", 0, 1, fix_crc=True)  # same size, one label different
    assert MemmapReader(tmp_path / "a").fingerprint != MemmapReader(tmp_path / "b").fingerprint


def _seg(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


SOI, EOI = b"\xff\xd8", b"\xff\xd9"
APP0 = _seg(0xE0, b"JFIF\x00" + bytes(9))
SOS = _seg(0xDA, bytes(10))


@pytest.mark.parametrize(
    "data, reason",
    [
        (SOI + APP0 + SOS + b"\x12\x34" + EOI, None),
        (SOI + APP0 + b"\xff\xff\xff" + SOS + b"\x12" + EOI, None),  # fill bytes before a marker
        (SOI + b"\xff\x01" + b"\xff\xd0" + APP0 + SOS + EOI, None),  # TEM, RST0: markers without a length
        (SOI + APP0 + SOS + b"\x12\x34" + EOI + b"trailer" * 300, None),  # data after the image
        (SOI + _seg(0xE1, b"Exif" + SOI + EOI) + SOS + b"\x12", "truncated JPEG (no end-of-image marker)"),
        (SOI + APP0 + SOS + b"\x12\x34", "truncated JPEG (no end-of-image marker)"),
        (SOI + APP0 + EOI, "corrupt JPEG (end of image before any scan)"),
        (SOI + APP0 + b"\x00\x11" + SOS + EOI, f"corrupt JPEG (no marker at byte {2 + len(APP0)})"),
        (SOI + b"\xff\xe0\x00\x01" + SOS + EOI, "corrupt JPEG (segment length 1 at byte 2)"),
        (SOI + b"\xff\xe0\x00\x40abc", "truncated JPEG (ends inside its headers)"),
        (SOI + b"\xff\xe0\x00", "truncated JPEG (ends inside its headers)"),
        (SOI + b"\xff", "truncated JPEG (ends inside its headers)"),
        (SOI + APP0, "truncated JPEG (ends inside its headers)"),
    ],
)
def test_jpeg_structure_check(data, reason):
    assert check_encoded(data) == reason


def _chunk(kind: bytes, body: bytes = b"") -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


PNG_SIG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "data, reason",
    [
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + _chunk(b"IDAT", b"xx") + _chunk(b"IEND"), None),
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + _chunk(b"IEND") + b"trailer", None),
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + _chunk(b"IDAT", b"xx"), "truncated PNG (no IEND chunk)"),
        (PNG_SIG + _chunk(b"IHDR", bytes(13))[:-3], "truncated PNG (a chunk runs past the end)"),
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + bytes(11), "truncated PNG (no IEND chunk)"),
        (PNG_SIG + _chunk(b"IDAT", b"x" * 40)[:30] + _chunk(b"IEND"), "truncated PNG (a chunk runs past the end)"),
        (PNG_SIG + _chunk(b"ID1T", b"x") + _chunk(b"IEND"), "corrupt PNG (bad chunk type b'ID1T' at byte 8)"),
        (PNG_SIG, "truncated PNG (no IEND chunk)"),
    ],
)
def test_png_structure_check(data, reason):
    assert check_encoded(data) == reason


def test_check_encoded_takes_every_buffer_kind():
    good = jpeg_bytes()
    for form in (good, bytearray(good), memoryview(good), np.frombuffer(good, np.uint8)):
        assert check_encoded(form) is None
    assert check_encoded(np.zeros(0, np.uint8)) == "empty record"
    assert check_encoded(b"\xff\xd8\x00rest") == "not a JPEG or PNG (unknown signature)"


def test_two_packs_to_one_destination_say_so(small_folder, tmp_path, monkeypatch):
    import dali_fast.records as records

    dst = tmp_path / "p"
    real_rename = os.rename

    def rename(src, target):
        if Path(target) == dst:  # another pack finished first
            dst.mkdir()
            (dst / "index.bin").write_bytes(b"theirs")
            raise OSError(39, "Directory not empty")
        return real_rename(src, target)

    monkeypatch.setattr(records.os, "rename", rename)
    with pytest.raises(FileExistsError) as e:
        pack(small_folder, dst, progress=False)
    assert _one_line(e) == f"{dst}: appeared while packing (another pack to the same place?); this pack is discarded"
    assert (dst / "index.bin").read_bytes() == b"theirs" and list(tmp_path.glob(".p.tmp-*")) == []


def test_damaged_paths_file_does_not_hide_the_real_error(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    size = (dst / "paths.bin").stat().st_size
    (dst / "paths.bin").write_bytes(b"\xff\xfe" * (size // 2) + b"\xff" * (size % 2))  # not UTF-8
    r = MemmapReader(dst)
    assert isinstance(r.source(0), str)  # readable for a message, no UnicodeDecodeError


def test_pack_summary_is_printed_once(small_folder, tmp_path, capsys, caplog):
    from dali_fast.cli import main

    (small_folder / "cat" / "notes.txt").write_text("x")
    with caplog.at_level("INFO"):
        assert main(["pack", str(small_folder), str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    logged = [r.getMessage() for r in caplog.records]
    assert out.count("packed 7 records") == 1 and not any("packed 7 records" in m for m in logged)
    assert sum("notes.txt" in m for m in logged) == 1 and "notes.txt" not in out  # named once


# ----------------------------------------------------------------------------- every damage, its exact line


def _set_header(dst: Path, **fields) -> None:
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    for k, v in fields.items():
        header[k] = v
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(header.tobytes())


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: os.truncate(d / INDEX_FILE, 63), "{d}/index.bin: truncated header (63 bytes); pack the data set again"),
        (lambda d: os.truncate(d / INDEX_FILE, 64 + 32 * 7 - 1),
         "{d}/index.bin: 287 bytes, expected 288 for 7 records (truncated?); pack the data set again"),
        (lambda d: _set_header(d, record_size=40), "{d}/index.bin: record size 40 != 32"),
        (lambda d: _set_header(d, count=8), "{d}/index.bin: 288 bytes, expected 320 for 8 records (truncated?); pack the data set again"),
        (lambda d: _set_header(d, version=3),
         "{d}/index.bin: format version 3, this dali_fast reads version 2; pack the data set again with this version"),
        (lambda d: os.truncate(d / DATA_FILE, 10),
         "{d}/data.bin: 10 bytes, the index says {size} (truncated or modified); pack the data set again"),
        (lambda d: (d / "paths.bin").write_bytes(b"x"), "{d}/paths.bin: size does not match the index; pack the data set again"),
        (lambda d: (d / "meta.json").unlink(),
         "{d}/meta.json: missing; {d} is not a complete packed data set, pack it again with `dali-fast pack SRC {d}`"),
    ],
)  # fmt: skip
def test_damaged_pack_exact_one_line(small_folder, tmp_path, damage, message):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    size = (dst / DATA_FILE).stat().st_size
    damage(dst)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        MemmapReader(dst)
    assert _one_line(e) == message.format(d=dst, size=size)


def test_index_and_data_maps_are_read_only(small_folder, tmp_path):
    pack(small_folder, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    assert not r.records.flags.writeable and not r.data.flags.writeable
    assert r.records.shape == (7,) and r.records.dtype == RECORD_DTYPE


def test_a_pack_whose_every_image_is_bad_opens_empty(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [b"", b"junk"]})
    report = pack(src, tmp_path / "p", progress=False)
    assert report.records == 0 and report.data_bytes == 0 and len(report.skipped) == 2
    r = MemmapReader(tmp_path / "p")
    assert len(r) == 0 and r.records.dtype == RECORD_DTYPE and r.data.dtype == np.uint8
    assert r.verify() == [] and r.index_intact() and r.labels.tolist() == []


def test_pack_report_meta_and_header_exactly(tmp_path, caplog):
    import datetime

    src = make_folder(tmp_path / "src", {"b": [jpeg_bytes(40, 30)], "a": [jpeg_bytes(30, 40), b"junk"]})
    (src / "a" / "readme.txt").write_text("x")
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        report = pack(src, tmp_path / "deep" / "er" / "p", progress=False)  # missing parents are made
    elapsed = time.perf_counter() - t0
    dst = tmp_path / "deep" / "er" / "p"
    assert (report.records, report.classes, report.reencoded) == (2, 2, 0)
    assert report.data_bytes == (dst / DATA_FILE).stat().st_size and 0 < report.seconds <= elapsed
    assert report.skipped == [
        (str(src / "a" / "readme.txt"), "not a .jpg/.jpeg/.png file"),
        (str(src / "a" / "001.jpg"), "undecodable: UnidentifiedImageError: cannot identify image file the record"),
    ]
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [f"left out {p}: {why}" for p, why in report.skipped]
    meta = json.loads((dst / "meta.json").read_text())
    created = meta.pop("created")
    assert meta == {
        "format_version": 2,
        "classes": ["a", "b"],
        "source_root": str(src.resolve()),
        "records": 2,
        "skipped": 2,
    }
    assert datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z")
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)[0]
    assert (int(header["shard_size"]), int(header["reserved"]), int(header["classes"])) == (0, 0, 2)
    assert [p.name for p in dst.parent.iterdir()] == ["p"]  # no temporary left beside it


def test_pack_argument_messages(small_folder, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        pack(tmp_path / "nope", tmp_path / "p", progress=False)
    assert _one_line(e) == f"{tmp_path / 'nope'}: no such folder; pack expects an ImageFolder root SRC/<class>/<image>"
    with pytest.raises(ValueError) as e:
        pack(small_folder, tmp_path / "p", max_side=0, progress=False)
    assert _one_line(e) == "max_side=0: must be a positive number of pixels"
    assert pack(small_folder, tmp_path / "p1", max_side=1, progress=False).reencoded == 7  # 1 pixel is allowed
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        pack(tmp_path / "empty", tmp_path / "p2", progress=False)
    assert _one_line(e) == (
        f"{tmp_path / 'empty'}: no .jpg/.jpeg/.png files under class sub-folders; expected SRC/<class>/<image>"
    )


def test_a_failing_pack_leaves_nothing(small_folder, tmp_path, monkeypatch):
    import dali_fast.records as records

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(records.os, "fsync", boom)
    with pytest.raises(OSError, match="No space left"):
        pack(small_folder, tmp_path / "p", progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "imgs"]


def test_pillow_reasons_name_the_error_not_a_buffer():
    from PIL import Image, UnidentifiedImageError

    from dali_fast.records import pillow_reason

    try:
        Image.open(io.BytesIO(b"junk"))
    except UnidentifiedImageError as e:
        assert pillow_reason(e) == "undecodable: UnidentifiedImageError: cannot identify image file the record"
    assert pillow_reason(OSError("broken data stream")) == "undecodable: OSError: broken data stream"


# ----------------------------------------------------------------------------- parallel pack


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):

    root = tmp_path_factory.mktemp("photos")
    make_synthetic(root / "src", images=60, classes=3, progress=False)
    bad = sorted((root / "src").rglob("*.jpg"))
    bad[7].write_bytes(bad[7].read_bytes()[:500])  # one truncated, left out the same way by every worker count
    return root / "src"


@pytest.mark.parametrize("max_side", [None, 128])
def test_parallel_pack_is_byte_identical_for_any_worker_count(photo_folder, tmp_path, max_side):
    outputs = {}
    for workers in (1, 2, 4):
        dst = tmp_path / f"w{workers}"
        report = pack(photo_folder, dst, max_side=max_side, workers=workers, progress=False)
        assert report.records == 59 and len(report.skipped) == 1
        outputs[workers] = [(dst / f).read_bytes() for f in (INDEX_FILE, DATA_FILE, "paths.bin")]
    assert outputs[1] == outputs[2] == outputs[4]
    with pytest.raises(ValueError, match="workers=0: must be 1 or more"):
        pack(photo_folder, tmp_path / "w0", workers=0, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 3])
def test_a_killed_parallel_pack_leaves_no_destination(photo_folder, tmp_path, workers):
    dst = tmp_path / "packed"
    code = f"from dali_fast import pack; pack({str(photo_folder)!r}, {str(dst)!r}, workers={workers}, progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.stat().st_size for p in tmp_path.glob(".packed.tmp-*/data.bin")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not dst.exists()
    assert pack(photo_folder, dst, workers=workers, progress=False).records == 59  # and the next pack completes
    assert list(tmp_path.glob(".packed.tmp-*")) == []


@pytest.mark.slow
def test_pack_memory_does_not_grow_with_the_number_of_images(tmp_path):
    """Peak RSS packing 5,000 images stays within a fixed budget of packing 500 (2 workers, verify on)."""
    import io as _io

    from PIL import Image

    def folder(n: int) -> Path:
        root = tmp_path / f"src{n}"
        if root.exists():
            return root
        for c in range(5):
            (root / f"c{c}").mkdir(parents=True)
        buf = _io.BytesIO()  # noise compresses badly: about 25 KB each, 120 MB for 5,000
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(
            buf, "JPEG", quality=95
        )
        for i in range(n):
            (root / f"c{i % 5}" / f"{i:05d}.jpg").write_bytes(buf.getvalue())
        return root

    def peak_kib(n: int) -> int:
        code = (
            f"from dali_fast import pack; pack({str(folder(n))!r}, {str(tmp_path / f'p{n}')!r}, workers=2, progress=False)\n"
            "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')))"
        )
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)

    small, large = peak_kib(500), peak_kib(5000)
    assert large - small < 16 * 1024, f"{small} KiB for 500 images, {large} KiB for 5,000"


def test_a_sharded_pack_holds_the_same_records(photo_folder, tmp_path):
    whole = pack(photo_folder, tmp_path / "whole", workers=2, progress=False)
    sharded = pack(photo_folder, tmp_path / "sharded", workers=2, shard_size=200_000, progress=False)
    a, b = MemmapReader(tmp_path / "whole"), MemmapReader(tmp_path / "sharded")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("data-*.bin"))
    assert len(shards) > 3 and shards[0] == "data-00000.bin" and not (tmp_path / "sharded" / DATA_FILE).exists()
    assert all((tmp_path / "sharded" / s).stat().st_size <= 200_000 for s in shards)
    assert whole.records == sharded.records == len(a) == len(b) == 59
    for i in range(len(a)):
        assert bytes(a[i][0]) == bytes(b[i][0]) and a[i][1] == b[i][1] and a.source(i) == b.source(i)
    views, labels = b.read_batch([58, 0, 30])
    assert [bytes(v) for v in views] == [bytes(a[i][0]) for i in (58, 0, 30)] and labels.tolist() == [
        a[i][1] for i in (58, 0, 30)
    ]
    assert b.verify() == [] and b.index_intact() and b.shard_size == 200_000
    (tmp_path / "sharded" / shards[1]).unlink()
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(tmp_path / "sharded")
    assert "a shard is missing" in _one_line(e)
    with pytest.raises(ValueError, match="larger than the shard size 1000"):
        pack(photo_folder, tmp_path / "tiny", shard_size=1000, progress=False)
    assert not (tmp_path / "tiny").exists()


def test_parallel_pack_from_a_script_without_a_main_guard_runs_it_once(photo_folder, tmp_path):
    """Workers must not re-run the caller's script (what spawn and forkserver do without `if __name__ == ...`)."""
    script = tmp_path / "user_script.py"
    script.write_text(
        "from dali_fast import pack\n"
        "print('script ran', flush=True)\n"
        f"pack({str(photo_folder)!r}, {str(tmp_path / 'out')!r}, workers=2, progress=False)\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("script ran") == 1 and (tmp_path / "out" / "index.bin").is_file()


def test_shard_size_edges_and_messages(photo_folder, tmp_path):
    from dali_fast.records import MemmapReader as MR

    largest = max(p.stat().st_size for p in photo_folder.rglob("*.jpg"))
    report = pack(
        photo_folder, tmp_path / "exact", shard_size=largest, workers=1, progress=False
    )  # a record may fill a shard
    r = MR(tmp_path / "exact")
    assert report.records == 59 and all(
        (tmp_path / "exact" / f.name).stat().st_size <= largest for f in (tmp_path / "exact").glob("data-*.bin")
    )
    assert r.verify() == []
    with pytest.raises(ValueError) as e:
        pack(photo_folder, tmp_path / "one", shard_size=1, workers=1, progress=False)
    first = sorted(photo_folder.rglob("*.jpg"))[0]
    assert _one_line(e) == (
        f"{first}: {first.stat().st_size} bytes, larger than the shard size 1; use a larger --shard-size"
    )
    with pytest.raises(ValueError) as e:
        pack(photo_folder, tmp_path / "zero", shard_size=0, progress=False)
    assert _one_line(e) == "shard_size=0: must be a positive number of bytes"
    assert not any(p.name.startswith(".one") or p.name == "one" for p in tmp_path.iterdir())


def test_pack_from_shards_in_one_process_reads_the_members(tmp_path, monkeypatch):
    wds = pytest.importorskip("webdataset")
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    (tmp_path / "shards").mkdir()
    images = [jpeg_bytes(30 + i, 20) for i in range(5)]
    with wds.TarWriter(str(tmp_path / "shards" / "a.tar")) as sink:
        for i, img in enumerate(images):
            sink.write({"__key__": f"k{i}", "jpg": img, "cls": str(i % 2).encode()})
    report = pack(tmp_path / "shards", tmp_path / "p", workers=1, progress=False)
    r = MemmapReader(tmp_path / "p")
    assert report.records == 5 and [bytes(r[i][0]) for i in range(5)] == images
    assert [r[i][1] for i in range(5)] == [0, 1, 0, 1, 0] and r.source(2).endswith("a.tar:k2.jpg")


def test_parallel_pack_still_verifies_by_decoding(tmp_path):
    """An image that passes the structural check but does not decode is left out, by any worker count."""
    import odd_images

    items = [jpeg_bytes(40 + i, 30) for i in range(6)] + [odd_images.corrupt()["bogus_huffman_table_jpeg"]]
    src = make_folder(tmp_path / "src", {"a": items})
    for workers in (1, 2):
        report = pack(src, tmp_path / f"p{workers}", workers=workers, progress=False)
        assert report.records == 6 and [p for p, _ in report.skipped] == [str(src / "a" / "006.jpg")]


# ----------------------------------------------------------------------------- pack and open: the remaining edges


def test_a_shard_fills_up_exactly_before_the_next_begins(small_folder, tmp_path):
    """Records are written in pack order; a shard takes a record that fills it to exactly ``shard_size``."""
    first = pack(small_folder, tmp_path / "plain", progress=False)
    r = MemmapReader(tmp_path / "plain")
    sizes = [int(n) for n in r.records["length"]]
    exact = sizes[0] + sizes[1]
    pack(small_folder, tmp_path / "sharded", shard_size=exact, progress=False)
    assert (tmp_path / "sharded" / "data-00000.bin").stat().st_size == exact  # two records, full to the byte
    s = MemmapReader(tmp_path / "sharded")
    assert [bytes(s[i][0]) for i in range(len(s))] == [bytes(r[i][0]) for i in range(first.records)]


def test_pack_summary_line_exactly(tmp_path):
    from dali_fast.records import PackReport

    report = PackReport(dst=tmp_path / "p", records=12, classes=3, data_bytes=3 * 2**20 + 2**19, seconds=2.25)
    report.reencoded, report.skipped = 2, [("a.jpg", "empty file")]
    assert report.summary() == (
        f"packed 12 records of 3 classes (3.5 MiB) into {tmp_path / 'p'} in 2.2s; re-encoded 2, left out 1"
    )


def test_missing_data_files_exact_one_line(photo_folder, small_folder, tmp_path):
    pack(small_folder, tmp_path / "plain", progress=False)
    (tmp_path / "plain" / DATA_FILE).unlink()
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(tmp_path / "plain")
    d = tmp_path / "plain"
    assert _one_line(e) == (
        f"{d}/data.bin: missing; {d} is not a complete packed data set, pack it again with `dali-fast pack SRC {d}`"
    )
    d = tmp_path / "sharded"
    pack(photo_folder, d, shard_size=400_000, workers=1, progress=False)
    shards = sorted(d.glob("data-*.bin"))
    assert len(shards) >= 3
    with open(shards[-1], "ab") as f:  # a shard that grew: the sizes no longer add up
        f.write(b"x")
    with pytest.raises(ValueError) as e:
        MemmapReader(d)
    total = sum(p.stat().st_size for p in shards)
    assert _one_line(e) == (
        f"{d}/data-*.bin ({len(shards)} shards): {total} bytes, the index says {total - 1} "
        "(truncated or modified); pack the data set again"
    )
    shards[1].unlink()  # a shard missing from the middle of the sequence
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(d)
    assert _one_line(e) == (
        f"{d}: the data shards are not data-00000.bin ... data-{len(shards) - 2:05d}.bin in sequence; "
        f"a shard is missing: pack it again with `dali-fast pack SRC {d}`"
    )


def test_every_map_of_a_sharded_set_is_read_only(photo_folder, tmp_path):
    pack(photo_folder, tmp_path / "s", shard_size=400_000, workers=1, progress=False)
    r = MemmapReader(tmp_path / "s")
    maps = [r.records, r._paths, *r.shards]  # noqa: SLF001 - the data set's files, mapped
    assert len(maps) >= 4 and not any(m.flags.writeable for m in maps)


def test_verify_and_pack_show_progress_only_when_asked(small_folder, tmp_path, capsys):
    pack(small_folder, tmp_path / "quiet", progress=False)
    assert MemmapReader(tmp_path / "quiet").verify() == []
    assert capsys.readouterr().err == ""  # verify() is quiet by default
    pack(small_folder, tmp_path / "shown", progress=True)
    err = capsys.readouterr().err
    assert f"pack {small_folder.name}" in err and "7/7" in err  # the folder's name, and the images counted


def test_a_destination_that_cannot_be_created_is_one_line(small_folder, tmp_path, monkeypatch):
    import errno

    def refuse(src, dst):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ValueError) as e:
        pack(small_folder, tmp_path / "p", progress=False)
    assert _one_line(e) == f"{tmp_path / 'p'}: cannot be created (Permission denied); choose another destination"
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [small_folder.name]  # the temporary folder went with it


# ----------------------------------------------------------------------------- batch reads and read-time checks


def _tiny_jpeg(scan: bytes = b"") -> bytes:
    """18 bytes (+ ``scan``) whose JPEG structure is whole: SOI, a scan, EOI."""
    return SOI + SOS + scan + EOI


def _set_length(dst: Path, record: int, length: int) -> None:
    rows = np.fromfile(dst / INDEX_FILE, dtype=RECORD_DTYPE, offset=HEADER_DTYPE.itemsize)
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    rows["length"][record] = length
    header["index_crc32"] = zlib.crc32(rows.tobytes())
    (dst / INDEX_FILE).write_bytes(header.tobytes() + rows.tobytes())


@pytest.fixture
def mixed_pack(tmp_path):
    """A packed set (not verified) of a JPEG, a PNG, a JPEG with data after its end, a whole JPEG of 18 bytes
    (shorter than the quick look), a progressive JPEG, a gray PNG and a whole JPEG of exactly 20 bytes (the
    quick look's least); returns (path, the source bytes in record order)."""
    import odd_images

    valid = odd_images.odd_valid()
    items = [
        jpeg_bytes(40, 30),
        valid["rgb_png"],
        valid["trailing_data_jpeg"],
        _tiny_jpeg(),
        valid["progressive_jpeg"],
        valid["gray16_png"],
        _tiny_jpeg(b"\x12\x34"),
    ]
    assert len(items[3]) == 18 and len(items[6]) == QUICK_MIN == 20
    src = make_folder(tmp_path / "src", {"a": items[:3], "b": items[3:]})
    report = pack(src, tmp_path / "p", verify=False, progress=False)
    assert report.records == len(items)
    r = MemmapReader(tmp_path / "p")
    return tmp_path / "p", [bytes(r[i][0]) for i in range(len(r))]


def test_packed_batch_reads_are_exact_and_quick_checked(mixed_pack):
    """Whole records pass: JPEG and PNG ends, data after the image's end, a record shorter than the quick
    window (these two by the full check); any order, repeats and negative indices."""
    path, data = mixed_pack
    r = MemmapReader(path)
    order = [5, 0, 2, 2, -1, 3, 1, 4, 6]
    views, labels, bad = r.read_batch_checked(order)
    assert bad == {}
    assert [bytes(v) for v in views] == [data[i] for i in order]
    assert labels.dtype == np.int64 and labels.tolist() == [r[i][1] for i in order]
    assert all(not v.flags.owndata and not v.flags.writeable for v in views)  # views of the map
    plain, plain_labels = r.read_batch(order)
    assert [bytes(v) for v in plain] == [data[i] for i in order] and plain_labels.tolist() == labels.tolist()
    assert r.read_batch_checked([])[0] == [] and r.read_batch_checked([])[2] == {}
    with pytest.raises(IndexError):
        r.read_batch_checked([len(r)])


def test_damage_after_packing_that_the_quick_check_sees_is_named(mixed_pack):
    path, data = mixed_pack
    r = MemmapReader(path)
    off = [int(x) for x in r.records["offset"]]
    n = [int(x) for x in r.records["length"]]
    del r
    _flip_byte(path / DATA_FILE, off[0] + n[0] - 1, 0xFF)  # the JPEG's EOI: D9 -> 26
    _flip_byte(path / DATA_FILE, off[1], 0xFF)  # the PNG's signature
    _flip_byte(path / DATA_FILE, off[5] + n[5] - 7, 0x20)  # the gray PNG's last chunk: "IEND" -> "IeND"
    _flip_byte(path / DATA_FILE, off[4] + 1, 0x01)  # the progressive JPEG's SOI: FFD8 -> FFD9
    _rewrite_label(path, 3, 2, fix_crc=True)  # the 18-byte JPEG: label 2 of 2 classes (0 and 1)
    _rewrite_label(path, 6, 2, fix_crc=True)  # the 20-byte one, too
    _set_length(path, 2, 0)  # the trailing-data JPEG: now empty
    r = MemmapReader(path)
    views, labels, bad = r.read_batch_checked(range(7))
    assert bad == {
        0: "truncated JPEG (no end-of-image marker)",
        1: "not a JPEG or PNG (unknown signature)",
        2: "empty record",
        3: "label 2 is not one of the data set's 2 classes (0..1)",
        4: "not a JPEG or PNG (unknown signature)",
        5: "truncated PNG (no IEND chunk)",
        6: "label 2 is not one of the data set's 2 classes (0..1)",
    }
    assert labels.tolist() == [0, 0, 0, 2, 1, 1, 2] and bytes(views[2]) == b""
    assert [pos for pos in range(7) if bytes(views[pos]) != data[pos]] == [0, 1, 2, 4, 5]


def test_damage_inside_a_packed_record_is_left_to_the_decoder(mixed_pack):
    """The read-time check of a packed record is O(1): the ends, not the headers in between (pack walked
    them). A marker broken after packing passes it; the full check (what the failed-batch search runs)
    names it."""
    path, _ = mixed_pack
    r = MemmapReader(path)
    record = bytes(r[0][0])
    second = 4 + int.from_bytes(record[4:6], "big")  # the second segment's marker, after SOI and APP0
    at = int(r.records["offset"][0]) + second
    del r
    _flip_byte(path / DATA_FILE, at, 0xFF)
    r = MemmapReader(path)
    _, _, bad = r.read_batch_checked([0, 1])
    assert bad == {}
    assert check_encoded(r[0][0]) == f"corrupt JPEG (no marker at byte {second})"
    assert r.verify() == [0]  # and the crc stored at pack time finds it


def test_whole_packed_records_cost_no_full_check(mixed_pack, photo_folder, tmp_path, monkeypatch):
    """O(1) per record: a whole record is passed on its ends alone, with no walk of its headers; only what
    does not end in its marker (data after the image) or is too short for the quick look gets one."""
    import warnings

    import dali_fast.records as records

    walked = []
    real = records.check_encoded
    monkeypatch.setattr(records, "check_encoded", lambda data: walked.append(bytes(data)) or real(data))
    path, data = mixed_pack
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by zero or other numpy complaint on the way
        _, _, bad = MemmapReader(path).read_batch_checked([6, 5, 4, 3, 2, 1, 0, 0])
        assert bad == {} and sorted(walked) == sorted([data[3], data[2]])
        pack(photo_folder, tmp_path / "sharded", shard_size=200_000, progress=False)
        sharded = MemmapReader(tmp_path / "sharded")
        walked.clear()
        _, _, bad = sharded.read_batch_checked(np.arange(len(sharded))[::-1])
        assert bad == {} and walked == [] and sharded.shard_size and len(sharded.shards) > 3


def test_sharded_batch_reads_and_checks_match_the_unsharded(photo_folder, tmp_path):
    pack(photo_folder, tmp_path / "whole", progress=False)
    pack(photo_folder, tmp_path / "sharded", shard_size=200_000, progress=False)
    a, b = MemmapReader(tmp_path / "whole"), MemmapReader(tmp_path / "sharded")
    last = len(b) - 1
    assert int(b.records["offset"][last]) // b.shard_size >= 3  # the last record is in a later shard
    off, n = int(b.records["offset"][last]), int(b.records["length"][last])
    del b
    shard, local = divmod(off, 200_000)
    _flip_byte(tmp_path / "sharded" / f"data-{shard:05d}.bin", local + n - 2, 0x01)  # its EOI: FFD9 -> FED9
    b = MemmapReader(tmp_path / "sharded")
    order = np.random.default_rng(0).permutation(len(a))
    va, la, bad_a = a.read_batch_checked(order)
    vb, lb, bad_b = b.read_batch_checked(order)
    pos = int(np.flatnonzero(order == last)[0])
    assert bad_a == {} and bad_b == {pos: "truncated JPEG (no end-of-image marker)"}
    assert la.tolist() == lb.tolist()
    assert [bytes(x) for x in va[:pos] + va[pos + 1 :]] == [bytes(x) for x in vb[:pos] + vb[pos + 1 :]]


def test_batch_read_of_a_reader_without_one_checks_record_by_record():
    from conftest import IndexReader

    from dali_fast.records import read_batch_checked, read_checked

    good = jpeg_bytes(32, 24)
    reader = IndexReader([good, good[:100], b"", good], classes=3)  # label 3 is outside the 3 classes
    datas, labels, bad = read_batch_checked(reader, np.array([3, 1, 0, 2]))
    assert labels.dtype == np.int64 and labels.tolist() == [3, 1, 0, 2]
    assert [bytes(d) for d in datas] == [good, good[:100], good, b""]
    assert bad == {0: read_checked(reader, 3)[2], 1: read_checked(reader, 1)[2], 3: "empty record"}
    assert bad[0].startswith("label 3 is not one") and bad[1].startswith("truncated JPEG")


def test_folder_batch_reads_overlap_in_the_read_threads_and_keep_their_order(tmp_path, monkeypatch):
    """A folder's files are read by the pool, several at once (a network file system's latency overlaps),
    never on the calling thread; results come back in the batch's order."""
    import threading

    import dali_fast.records as records

    images = [jpeg_bytes(20 + k, 20) for k in range(32)]
    root = make_folder(tmp_path / "imgs", {"a": images})
    reader = ImageFolderReader(root)
    lock, state = threading.Lock(), {"now": 0, "most": 0, "threads": set()}
    real = records._read_file_checked

    def slow(path):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["threads"].add(threading.current_thread().name)
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        return real(path)

    monkeypatch.setattr(records, "_read_file_checked", slow)
    order = list(range(31, -1, -1))
    datas, labels, bad = reader.read_batch_checked(order)
    assert bad == {} and [bytes(d) for d in datas] == [images[k] for k in order] and labels.tolist() == [0] * 32
    assert state["most"] >= 4, state
    assert threading.current_thread().name not in state["threads"]
    assert all(name.startswith("dali_fast-read") for name in state["threads"])


def test_folder_batch_reads_name_unreadable_and_broken_files(tmp_path):
    good = jpeg_bytes(32, 24)
    root = make_folder(tmp_path / "imgs", {"a": [good, good[:-50], good, good]})
    (root / "a" / "002.jpg").unlink()
    (root / "a" / "002.jpg").symlink_to(root / "gone.jpg")
    reader = ImageFolderReader(root)
    datas, labels, bad = reader.read_batch_checked([3, 2, 1, 0])
    assert bad == {1: "unreadable: No such file or directory", 2: "truncated JPEG (no end-of-image marker)"}
    assert datas[1] is None and bytes(datas[0]) == good and bytes(datas[2]) == good[:-50]
    views, _ = reader.read_batch([0, 3])
    assert [bytes(v) for v in views] == [good, good]
    with pytest.raises(FileNotFoundError):
        reader.read_batch([2])


def test_the_read_pool_serves_a_forked_child(tmp_path):
    """A forked child (a DataLoader worker) inherits the pool object but not its threads: it gets its own."""
    import multiprocessing

    images = [jpeg_bytes(20 + k, 20) for k in range(12)]
    reader = ImageFolderReader(make_folder(tmp_path / "imgs", {"a": images}))
    assert [bytes(d) for d in reader.read_batch_checked(range(12))[0]] == images  # the parent's pool now runs
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put([bytes(d) for d in reader.read_batch_checked(range(12))[0]]))
    child.start()
    try:
        assert queue.get(timeout=60) == images
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_read_threads_do_not_grow_with_readers_or_batches(tmp_path):
    import threading

    from dali_fast.records import READ_THREADS

    images = [jpeg_bytes(20 + k, 20) for k in range(40)]
    root = make_folder(tmp_path / "imgs", {"a": images})
    ImageFolderReader(root).read_batch_checked(range(40))
    before = threading.active_count()
    for _ in range(10):
        reader = ImageFolderReader(root)
        for start in range(0, 40, 8):
            reader.read_batch_checked(range(start, start + 8))
    names = [t.name for t in threading.enumerate() if t.name.startswith("dali_fast-read")]
    assert threading.active_count() == before and 1 <= len(names) <= READ_THREADS


def test_batch_reads_leave_no_file_open_and_the_process_exits_cleanly(tmp_path):
    """Every read closes its file, failed ones too; the idle reader threads do not hold the process at exit."""
    good = jpeg_bytes(32, 24)
    root = make_folder(tmp_path / "imgs", {"a": [good] * 6 + [good[:-30]]})
    reader = ImageFolderReader(root)
    (root / "a" / "003.jpg").unlink()  # gone after the listing

    def open_here() -> list[str]:  # this process's fds on the set's files (others come and go with other tests)
        out = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
                    out.append(fd)
        return out

    for _ in range(20):
        _, _, bad = reader.read_batch_checked(range(7))
        assert set(bad) == {3, 6}
        with pytest.raises(FileNotFoundError):
            reader.read_batch(range(7))
        assert open_here() == []
    script = (
        "from dali_fast.records import ImageFolderReader; "
        f"r = ImageFolderReader({str(root)!r}); d, _, bad = r.read_batch_checked(range(6)); "
        "print(len(d), sorted(bad))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "6 [5]", done.stderr[-2000:]


def test_check_encoded_gives_one_verdict_for_bytes_arrays_and_views():
    """Bytes are searched in place, other buffers walked in place and their scan copied once: the same answer."""
    import odd_images

    cases = {**odd_images.odd_valid(), **odd_images.corrupt()}
    cases["two_images"] = odd_images.good_jpeg() + odd_images.good_jpeg()[:-2]  # an EOI inside, none at the end
    cases["thumbnail_eoi_only"] = SOI + _seg(0xE1, b"Exif" + SOI + EOI) + SOS + b"\x12\x34"
    for name, data in cases.items():
        verdict = check_encoded(data)
        big = np.frombuffer(b"\x00" * 7 + data + b"\x00" * 5, np.uint8)[7 : 7 + len(data)]  # a view inside a buffer
        for form in (np.frombuffer(data, np.uint8), big, memoryview(data), bytearray(data)):
            assert check_encoded(form) == verdict, name
    assert check_encoded(cases["two_images"]) is None  # the first image's EOI follows the first scan
    assert check_encoded(cases["thumbnail_eoi_only"]) == "truncated JPEG (no end-of-image marker)"


def test_a_failed_parallel_read_returns_only_after_every_read_has_finished():
    """The first run's error is raised once the other runs are done, not while they still hold files."""
    import time

    from dali_fast.records import READ_THREADS, read_parallel

    finished = []

    def read(x: int) -> int:
        if x == 0:
            raise FileNotFoundError("gone")
        time.sleep(0.05)
        finished.append(x)
        return x

    items = list(range(2 * READ_THREADS))
    with pytest.raises(FileNotFoundError):
        read_parallel(read, items)
    assert sorted(finished) == [x for x in items if x >= 2]  # run 0 (items 0, 1) stopped at its error
