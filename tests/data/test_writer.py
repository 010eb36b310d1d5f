"""`pack`: exact bytes and labels, what is left out and why, the report, atomic writes, one-line refusals."""

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
from builders import IndexReader, jpeg_bytes, make_folder, one_line

from dali_fast.data.format import DATA_FILE, HEADER_DTYPE, INDEX_FILE, RECORD_DTYPE
from dali_fast.data.open import open_dataset
from dali_fast.data.pack.packed import pack
from dali_fast.data.packed import MemmapReader
from dali_fast.data.synthetic import make_synthetic


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


def test_bad_images_left_out_and_reported(tmp_path):
    good = jpeg_bytes(40, 40)
    src = make_folder(tmp_path / "src", {"a": [good, good[: len(good) // 2]], "b": [b"", os.urandom(300), good]})
    # names: a/000.jpg good, a/001.jpg truncated, b/000.jpg empty, b/001.jpg random, b/002.jpg good
    report = pack(src, tmp_path / "p", progress=False)
    assert report.records == 2
    reasons = dict(report.skipped)
    assert set(reasons) == {str(src / "a/001.jpg"), str(src / "b/000.jpg"), str(src / "b/001.jpg")}
    assert "empty" in reasons[str(src / "b/000.jpg")]
    assert reasons[str(src / "a/001.jpg")] == "truncated JPEG (ends inside its headers)"  # as a loader says it
    r = MemmapReader(tmp_path / "p")
    assert [r.source(i) for i in range(2)] == ["a/000.jpg", "b/002.jpg"]
    assert [r[i][1] for i in range(2)] == [0, 1]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_readers_record_pillow_cannot_read_is_named_in_pillows_words(tmp_path, workers):
    """Packing a reader, a record whose structure is whole but which Pillow cannot open (a PNG of bit depth
    3) is left out, the reader's name for it in Pillow's words."""
    ihdr = (4).to_bytes(4, "big") * 2 + bytes([3, 0, 0, 0, 0])
    png = b"\x89PNG\r\n\x1a\n" + b"".join(
        len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")
        for kind, body in [(b"IHDR", ihdr), (b"IDAT", zlib.compress(b"")), (b"IEND", b"")]
    )
    report = pack(IndexReader([jpeg_bytes(), png, jpeg_bytes()]), tmp_path / "p", progress=False, workers=workers)
    assert report.records == 2
    assert report.skipped == [
        ("mem://1.jpg", "undecodable: UnidentifiedImageError: cannot identify image file mem://1.jpg")
    ]


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
        tmps = list(tmp_path.glob(".packed.*.tmp/data.bin"))
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
    assert list(tmp_path.glob(".packed.*.tmp")) == []


def test_reencoded_pack_passes_verify(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(300, 100), jpeg_bytes(50, 40)], "b": [jpeg_bytes(90, 400)]})
    report = pack(src, tmp_path / "p", max_side=64, progress=False)
    assert report.reencoded == 2  # 50x40 already fits
    r = MemmapReader(tmp_path / "p")
    assert r.verify() == []
    assert [int(x) for x in r.records["crc32"]] == [zlib.crc32(bytes(r[i][0])) for i in range(3)]


def test_non_utf8_file_names_are_packed_and_named(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    name = os.fsdecode(b"caf\xe9.jpg")  # Latin-1 bytes, not UTF-8
    (src / "a" / name).write_bytes(jpeg_bytes())
    report = pack(src, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    assert report.records == 1 and r.source(0) == os.path.join("a", name)


def test_two_packs_to_one_destination_say_so(small_folder, tmp_path, monkeypatch):
    import dali_fast.files as files

    dst = tmp_path / "p"
    real_rename = os.rename

    def rename(src, target):
        if Path(target) == dst:  # another pack finished first
            dst.mkdir()
            (dst / "index.bin").write_bytes(b"theirs")
            raise OSError(39, "Directory not empty")
        return real_rename(src, target)

    monkeypatch.setattr(files.os, "rename", rename)  # what atomic_dir renames with
    with pytest.raises(FileExistsError) as e:
        pack(small_folder, dst, progress=False)
    assert one_line(e) == f"{dst}: appeared while packing (another pack to the same place?); this pack is discarded"
    assert (dst / "index.bin").read_bytes() == b"theirs" and list(tmp_path.glob(".p.*.tmp")) == []


def test_pack_summary_is_printed_once(small_folder, tmp_path, capsys, caplog):
    from dali_fast.cli import main

    (small_folder / "cat" / "notes.txt").write_text("x")
    with caplog.at_level("INFO"):
        assert main(["pack", str(small_folder), str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    logged = [r.getMessage() for r in caplog.records]
    assert out.count("packed 7 records") == 1 and not any("packed 7 records" in m for m in logged)
    assert sum("notes.txt" in m for m in logged) == 1 and "notes.txt" not in out  # named once


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
    assert report.skipped == [(str(src / "a" / "001.jpg"), "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)")]
    assert report.ignored == [(str(src / "a" / "readme.txt"), "not an image file (by its name)")]
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [f"not an image, ignored: {src / 'a' / 'readme.txt'} (not an image file (by its name))"] + [
        f"left out {p}: {why}" for p, why in report.skipped
    ]
    meta = json.loads((dst / "meta.json").read_text())
    created = meta.pop("created")
    assert meta == {
        "format_version": 3,
        "classes": ["a", "b"],
        "source_root": str(src.resolve()),
        "records": 2,
        "skipped": 1,
    }
    assert datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z")
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)[0]
    assert (int(header["shard_size"]), int(header["classes"])) == (0, 2)
    assert (int(header["target_kind"]), int(header["target_width"])) == (0, 0)  # class targets: no target block
    assert [p.name for p in dst.parent.iterdir()] == ["p"]  # no temporary left beside it


def test_pack_argument_messages(small_folder, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        pack(tmp_path / "nope", tmp_path / "p", progress=False)
    assert one_line(e) == f"{tmp_path / 'nope'}: no such folder; pack expects an ImageFolder root SRC/<class>/<image>"
    with pytest.raises(ValueError) as e:
        pack(small_folder, tmp_path / "p", max_side=0, progress=False)
    assert one_line(e) == "max_side=0: must be a positive number of pixels"
    assert pack(small_folder, tmp_path / "p1", max_side=1, progress=False).reencoded == 7  # 1 pixel is allowed
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        pack(tmp_path / "empty", tmp_path / "p2", progress=False)
    assert one_line(e) == (
        f"{tmp_path / 'empty'}: no image files under class sub-folders; expected SRC/<class>/<image>"
    )


def test_a_failing_pack_leaves_nothing(small_folder, tmp_path, monkeypatch):
    import dali_fast.data.pack.packed as writer

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", boom)
    with pytest.raises(ValueError, match=r"out of room while packing \(No space left on device"):
        pack(small_folder, tmp_path / "p", progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "imgs"]


def test_pack_summary_line_exactly(tmp_path):
    from dali_fast.data.pack.report import PackReport

    report = PackReport(dst=tmp_path / "p", records=12, classes=3, data_bytes=3 * 2**20 + 2**19, seconds=2.25)
    report.reencoded, report.skipped = 2, [("a.jpg", "empty file")]
    assert report.summary() == (
        f"packed 12 records of 3 classes (3.5 MiB) into {tmp_path / 'p'} in 2.2s; re-encoded 2, left out 1"
    )
    one = PackReport(dst=tmp_path / "p", records=1, classes=1, data_bytes=2**20, seconds=1.0)
    assert one.summary().startswith("packed 1 record of 1 class (1.0 MiB)")  # not "1 records of 1 classes"


def test_verify_and_pack_show_progress_only_when_asked(small_folder, tmp_path, capsys, caplog, monkeypatch):
    pack(small_folder, tmp_path / "quiet", progress=False)
    assert MemmapReader(tmp_path / "quiet").verify() == []
    assert capsys.readouterr().err == ""  # verify() is quiet by default
    with caplog.at_level("INFO"):
        pack(small_folder, tmp_path / "logged", progress=True)
    assert capsys.readouterr().err == ""  # stderr is no terminal here: no bar drawn into a log ...
    assert f"pack {small_folder.name}: 7 images ..." in caplog.messages  # ... but a line for the stage
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal
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
    assert one_line(e) == f"{tmp_path / 'p'}: cannot be created (Permission denied); choose another destination"
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [small_folder.name]  # the temporary folder went with it


@pytest.mark.parametrize("inside", ["packed", "cat/packed"])
def test_a_destination_inside_the_source_is_refused_before_any_work(small_folder, inside):
    from dali_fast.cli import main

    dst = small_folder / inside
    with pytest.raises(ValueError) as e:
        pack(small_folder, dst, progress=False)
    assert one_line(e) == f"{dst}: inside the source {small_folder}; choose a destination outside it"
    assert not dst.exists() and not any(p.name.startswith(".packed") for p in small_folder.rglob("*"))
    assert main(["pack", str(small_folder), str(small_folder / "p2")]) == 2


def test_an_empty_class_folder_is_named_and_keeps_its_label(small_folder, tmp_path, caplog):
    (small_folder / "dodo").mkdir()  # sorts between cat and dog
    (small_folder / "dodo" / "notes.txt").write_text("no images here")
    with caplog.at_level("WARNING"):
        report = pack(small_folder, tmp_path / "p", progress=False)
    assert report.classes == 4 and open_dataset(tmp_path / "p").labels.tolist() == [0, 0, 0, 2, 2, 3, 3]
    said = [m for m in caplog.messages if "no image files" in m]
    assert len(said) == 1 and "1 class folder has" in said[0] and "'dodo' (label 1)" in said[0]
    assert "move such a folder out of" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        open_dataset(small_folder)  # the ImageFolder reader says it too
    assert any("'dodo' (label 1)" in m for m in caplog.messages)
