"""`pack`: exact bytes and labels, what is left out and why, atomic and parallel writes, shards."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import jpeg_bytes, make_folder, one_line

from dali_fast.data.format import DATA_FILE, HEADER_DTYPE, INDEX_FILE, RECORD_DTYPE
from dali_fast.data.open import open_dataset
from dali_fast.data.packed import MemmapReader
from dali_fast.data.synthetic import make_synthetic
from dali_fast.data.writer import pack


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
    import dali_fast.system as system

    dst = tmp_path / "p"
    real_rename = os.rename

    def rename(src, target):
        if Path(target) == dst:  # another pack finished first
            dst.mkdir()
            (dst / "index.bin").write_bytes(b"theirs")
            raise OSError(39, "Directory not empty")
        return real_rename(src, target)

    monkeypatch.setattr(system.os, "rename", rename)  # what atomic_dir renames with
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
    assert report.skipped == [(str(src / "a" / "001.jpg"), "not a JPEG or PNG (unknown signature)")]
    assert report.ignored == [(str(src / "a" / "readme.txt"), "not a .jpg/.jpeg/.png file")]
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [f"not an image, ignored: {src / 'a' / 'readme.txt'} (not a .jpg/.jpeg/.png file)"] + [
        f"left out {p}: {why}" for p, why in report.skipped
    ]
    meta = json.loads((dst / "meta.json").read_text())
    created = meta.pop("created")
    assert meta == {
        "format_version": 2,
        "classes": ["a", "b"],
        "source_root": str(src.resolve()),
        "records": 2,
        "skipped": 1,
    }
    assert datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z")
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)[0]
    assert (int(header["shard_size"]), int(header["reserved"]), int(header["classes"])) == (0, 0, 2)
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
        f"{tmp_path / 'empty'}: no .jpg/.jpeg/.png files under class sub-folders; expected SRC/<class>/<image>"
    )


def test_a_failing_pack_leaves_nothing(small_folder, tmp_path, monkeypatch):
    import dali_fast.data.writer as writer

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", boom)
    with pytest.raises(OSError, match="No space left"):
        pack(small_folder, tmp_path / "p", progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "imgs"]


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


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that are still its children."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan reaped by init is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 3])
def test_a_killed_parallel_pack_leaves_no_destination(photo_folder, tmp_path, workers):
    dst = tmp_path / "packed"
    code = f"from dali_fast import pack; pack({str(photo_folder)!r}, {str(dst)!r}, workers={workers}, progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.stat().st_size for p in tmp_path.glob(".packed.*.tmp/data.bin")):
        time.sleep(0.005)
    workers_of_pack = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not dst.exists()
    assert (len(workers_of_pack) > 0) == (workers > 1)  # (capped at the CPUs)
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(pid) for pid in workers_of_pack):
        time.sleep(0.05)
    assert [pid for pid in workers_of_pack if alive(pid)] == []  # none left waiting for tasks forever
    assert pack(photo_folder, dst, workers=workers, progress=False).records == 59  # and the next pack completes
    assert list(tmp_path.glob(".packed.*.tmp")) == []


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
    assert "a shard is missing" in one_line(e)
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
    from dali_fast.data.packed import MemmapReader as MR

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
    assert one_line(e) == (
        f"{first}: {first.stat().st_size} bytes, larger than the shard size 1; use a larger --shard-size"
    )
    with pytest.raises(ValueError) as e:
        pack(photo_folder, tmp_path / "zero", shard_size=0, progress=False)
    assert one_line(e) == "shard_size=0: must be a positive number of bytes"
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
    from dali_fast.data.writer import PackReport

    report = PackReport(dst=tmp_path / "p", records=12, classes=3, data_bytes=3 * 2**20 + 2**19, seconds=2.25)
    report.reencoded, report.skipped = 2, [("a.jpg", "empty file")]
    assert report.summary() == (
        f"packed 12 records of 3 classes (3.5 MiB) into {tmp_path / 'p'} in 2.2s; re-encoded 2, left out 1"
    )


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


# ----------------------------------------------------------------------------- from WebDataset shards


def test_pack_converts_shards_to_a_packed_set(tmp_path, cache):
    from test_shards import write_shards  # skipped without the webdataset package

    samples = write_shards(tmp_path / "shards", label="json")
    report = pack(
        str(tmp_path / "shards" / "train-{000000..000002}.tar"), tmp_path / "packed", workers=2, progress=False
    )
    p = open_dataset(tmp_path / "packed")
    assert report.records == 21 and p.classes == ["0", "1", "2", "3"]
    assert [(bytes(p[i][0]), p[i][1]) for i in range(21)] == samples
    assert p.source(3).endswith("train-000000.tar:sample00003.jpg")


def test_pack_names_a_bad_member_by_shard_and_key(tmp_path, cache):
    wds = pytest.importorskip("webdataset")

    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(3):
            image = jpeg_bytes()[:200] if i == 1 else jpeg_bytes()  # sample 1: cut off inside its headers
            sink.write({"__key__": f"k{i}", "jpg": image, "cls": b"0"})
    report = pack(str(root / "a.tar"), tmp_path / "packed", progress=False)
    assert report.records == 2
    assert report.skipped == [(f"{root / 'a.tar'}:k1.jpg", "truncated JPEG (ends inside its headers)")]


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
    said = [m for m in caplog.messages if "no .jpg/.jpeg/.png files" in m]
    assert len(said) == 1 and "1 class folder has" in said[0] and "'dodo' (label 1)" in said[0]
    assert "move such a folder out of" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        open_dataset(small_folder)  # the ImageFolder reader says it too
    assert any("'dodo' (label 1)" in m for m in caplog.messages)


@pytest.fixture
def pools(monkeypatch) -> list[tuple[int, dict]]:
    """(max_workers, keyword arguments) of each process pool started while the test runs."""
    import concurrent.futures

    started: list[tuple[int, dict]] = []
    real = concurrent.futures.ProcessPoolExecutor.__init__

    def spy(self, max_workers=None, *args, **kwargs):
        started.append((max_workers, kwargs))
        real(self, max_workers, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ProcessPoolExecutor, "__init__", spy)
    return started


def test_more_workers_than_cpus_are_capped_with_a_warning(small_folder, tmp_path, caplog, pools):
    from dali_fast.system import available_cpus

    with caplog.at_level("WARNING"):
        pack(small_folder, tmp_path / "p", progress=False, workers=999)
    started = [n for n, _ in pools]
    assert started == [available_cpus()] or (available_cpus() == 1 and started == [])
    assert any(
        m.startswith("workers=999: more than the ") and f"packing with {available_cpus()}" in m for m in caplog.messages
    )


@pytest.mark.parametrize("cpus", [1, 3])
def test_workers_are_capped_at_the_cpus_and_a_cap_is_said_exactly(small_folder, tmp_path, caplog, monkeypatch, pools, cpus):
    """As many workers as CPUs: no warning, that many processes; one more: one line naming both numbers
    (in words: '1 CPU', '3 CPUs'), and the CPUs' count of processes. The pool forks (the caller's script
    is not re-run in each worker) and its workers die with this process."""
    import multiprocessing

    import dali_fast.data.writer as writer
    from dali_fast.system import die_with_parent

    monkeypatch.setattr(writer, "available_cpus", lambda: cpus)
    started = pools
    pack(small_folder, tmp_path / "ref", progress=False, workers=1)
    want = sorted(MemmapReader(tmp_path / "ref").records["crc32"])
    started.clear()
    for name, workers in (("same", cpus), ("more", cpus + 1)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dali_fast.data.writer"):
            pack(small_folder, tmp_path / name, progress=False, workers=workers)
        assert sorted(MemmapReader(tmp_path / name).records["crc32"]) == want
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if workers == cpus:
            assert said == []
        else:
            unit = "1 CPU" if cpus == 1 else f"{cpus} CPUs"
            assert said == [f"workers={workers}: more than the {unit} this process may use; packing with {cpus}"]
    if cpus == 1:
        assert started == []  # one worker: packed in this process
    else:
        assert [n for n, _ in started] == [cpus, cpus]
        for _, kwargs in started:
            assert kwargs["mp_context"].get_start_method() == "fork"
            assert isinstance(kwargs["mp_context"], type(multiprocessing.get_context("fork")))
            assert kwargs["initializer"] is die_with_parent and kwargs["initargs"] == (os.getpid(),)


def test_by_default_under_pack_small_images_pack_in_this_process_and_more_with_every_cpu(tmp_path, monkeypatch, pools):
    """workers=None: under PACK_SMALL images, this process packs (starting workers would cost more than the
    work), however many CPUs there are; from PACK_SMALL images on, one worker per CPU. The bytes are the same."""
    import dali_fast.data.writer as writer

    monkeypatch.setattr(writer, "available_cpus", lambda: 2)
    n = writer.PACK_SMALL
    half = n // 2
    src = make_folder(
        tmp_path / "src",
        {
            "a": [jpeg_bytes(8 + i % 5, 8) for i in range(half)],
            "b": [jpeg_bytes(9, 8 + i % 3) for i in range(n - half)],
        },
    )
    report = pack(src, tmp_path / "all", progress=False)
    assert [w for w, _ in pools] == [2] and report.records == n
    (src / "b" / f"{n - half - 1:03d}.jpg").unlink()
    pools.clear()
    report = pack(src, tmp_path / "under", progress=False)
    assert pools == [] and report.records == n - 1
    pack(src, tmp_path / "one", progress=False, workers=1)
    for name in (INDEX_FILE, DATA_FILE, "paths.bin"):
        assert (tmp_path / "under" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
