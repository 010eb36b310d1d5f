"""`MemmapReader`: a packed data set read in place; every kind of damage named in one line."""

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from builders import EOI, SOI, SOS, jpeg_bytes, make_folder, one_line

from dali_fast.data.checks import QUICK_MIN, check_encoded
from dali_fast.data.format import DATA_FILE, FORMAT_VERSION, HEADER_DTYPE, INDEX_FILE, RECORD_DTYPE
from dali_fast.data.open import open_dataset
from dali_fast.data.pack.packed import pack
from dali_fast.data.packed import MemmapReader


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
    assert r.data is r.shards[0]  # the one data file of an unsharded set
    declared = MemmapReader(tmp_path / "p", classes=["emu", "dog", "cat", "fox"])  # another order, one more
    again = pickle.loads(pickle.dumps(declared))
    assert again.classes == declared.classes == ["emu", "dog", "cat", "fox"]
    assert [again[i][1] for i in range(7)] == [declared[i][1] for i in range(7)] == [2, 2, 2, 1, 1, 0, 0]


def test_declared_classes_that_lack_a_packed_class_name_the_pack(small_folder, tmp_path):
    pack(small_folder, tmp_path / "p", progress=False)
    with pytest.raises(ValueError) as e:
        MemmapReader(tmp_path / "p", classes=["cat", "dog"])
    assert one_line(e).startswith(f"{tmp_path / 'p'}: class 'emu' (of ")


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


def test_truncated_data_file(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    size = (dst / DATA_FILE).stat().st_size
    os.truncate(dst / DATA_FILE, size - 5)
    with pytest.raises(ValueError) as e:
        open_dataset(dst)
    msg = one_line(e)
    assert "data.bin" in msg and "truncated" in msg and str(size) in msg


def test_truncated_index_file(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    os.truncate(dst / INDEX_FILE, (dst / INDEX_FILE).stat().st_size - 3)
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert "index.bin" in one_line(e) and "truncated" in str(e.value)


def test_wrong_magic(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(b"NOTMAGIC")
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert "index.bin" in one_line(e) and "magic" in str(e.value)


def test_future_version_names_both(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    header["version"] = FORMAT_VERSION + 6
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(header.tobytes())
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert one_line(e) == (
        f"{dst / INDEX_FILE}: format version {FORMAT_VERSION + 6}, written by a newer dali_fast; this one reads "
        f"versions 2 to {FORMAT_VERSION}: upgrade dali_fast (pip install -U dali-fast) to read it"
    )


def test_missing_index(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    (dst / INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(dst)
    assert "index.bin" in one_line(e) and "missing" in str(e.value)


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
    assert one_line(e) == (
        f"{dst / INDEX_FILE}: record 4 has label 4000000000, but there are 3 classes; "
        "check it with `dali-fast inspect --verify` and pack the data set again"
    )
    assert main(["inspect", str(dst)]) == 2  # one line, no 30 GiB bincount
    from dali_fast.data.base import read_checked

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
    assert one_line(e).startswith(f"{dst / 'meta.json'}: ") and says in str(e.value)


def test_a_version_1_pack_is_refused_with_what_to_do(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    header = np.fromfile(dst / INDEX_FILE, dtype=HEADER_DTYPE, count=1)
    header["version"] = 1
    with open(dst / INDEX_FILE, "r+b") as f:
        f.write(header.tobytes())
    with pytest.raises(ValueError) as e:
        MemmapReader(dst)
    assert one_line(e) == (
        f"{dst / INDEX_FILE}: format version 1 (an older dali_fast, whose labels were not checksummed), "
        f"this dali_fast reads versions 2 to {FORMAT_VERSION}; pack the data set again with `dali-fast pack`"
    )


def test_fingerprint_tells_data_sets_apart(small_folder, tmp_path):
    pack(small_folder, tmp_path / "a", progress=False)
    pack(small_folder, tmp_path / "b", progress=False)
    assert MemmapReader(tmp_path / "a").fingerprint == MemmapReader(tmp_path / "b").fingerprint
    _rewrite_label(tmp_path / "b", 0, 1, fix_crc=True)  # same size, one label different
    assert MemmapReader(tmp_path / "a").fingerprint != MemmapReader(tmp_path / "b").fingerprint


def test_damaged_paths_file_does_not_hide_the_real_error(small_folder, tmp_path):
    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    size = (dst / "paths.bin").stat().st_size
    (dst / "paths.bin").write_bytes(b"\xff\xfe" * (size // 2) + b"\xff" * (size % 2))  # not UTF-8
    r = MemmapReader(dst)
    assert isinstance(r.source(0), str)  # readable for a message, no UnicodeDecodeError


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
        (lambda d: _set_header(d, version=0),
         "{d}/index.bin: format version 0, this dali_fast reads versions 2 to 3; pack the data set again with `dali-fast pack`"),
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
    assert one_line(e) == message.format(d=dst, size=size)


def test_index_and_data_maps_are_read_only(small_folder, tmp_path):
    pack(small_folder, tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    assert not r.records.flags.writeable and not r.data.flags.writeable
    assert r.records.shape == (7,) and r.records.dtype == RECORD_DTYPE


def test_missing_data_files_exact_one_line(photo_folder, small_folder, tmp_path):
    pack(small_folder, tmp_path / "plain", progress=False)
    (tmp_path / "plain" / DATA_FILE).unlink()
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(tmp_path / "plain")
    d = tmp_path / "plain"
    assert one_line(e) == (
        f"{d}/data.bin: missing; {d} is not a complete packed data set, pack it again with `dali-fast pack SRC {d}`"
    )
    d = tmp_path / "sharded"
    pack(photo_folder, d, shard_size=400_000, workers=1, progress=False)
    shards = sorted(d.glob("data-*.bin"))
    assert len(shards) >= 3
    assert MemmapReader(d).data is None  # no one data file
    with open(shards[-1], "ab") as f:  # a shard that grew: the sizes no longer add up
        f.write(b"x")
    with pytest.raises(ValueError) as e:
        MemmapReader(d)
    total = sum(p.stat().st_size for p in shards)
    assert one_line(e) == (
        f"{d}/data-*.bin ({len(shards)} shards): {total} bytes, the index says {total - 1} "
        "(truncated or modified); pack the data set again"
    )
    shards[1].unlink()  # a shard missing from the middle of the sequence
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(d)
    assert one_line(e) == (
        f"{d}: the data shards are not data-00000.bin ... data-{len(shards) - 2:05d}.bin in sequence; "
        f"a shard is missing: pack it again with `dali-fast pack SRC {d}`"
    )


def test_every_map_of_a_sharded_set_is_read_only(photo_folder, tmp_path):
    pack(photo_folder, tmp_path / "s", shard_size=400_000, workers=1, progress=False)
    r = MemmapReader(tmp_path / "s")
    maps = [r.records, r._paths, *r.shards]  # noqa: SLF001 - the data set's files, mapped
    assert len(maps) >= 4 and not any(m.flags.writeable for m in maps)


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
    (shorter than the quick look), a progressive JPEG, a gray PNG and a whole JPEG of exactly 24 bytes (the
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
        _tiny_jpeg(b"\x12\x34\x56\x78\x9a\xbc"),
    ]
    assert len(items[3]) == 18 and len(items[6]) == QUICK_MIN == 24
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
    _rewrite_label(path, 6, 2, fix_crc=True)  # the 24-byte one, too
    _set_length(path, 2, 0)  # the trailing-data JPEG: now empty
    r = MemmapReader(path)
    views, labels, bad = r.read_batch_checked(range(7))
    assert bad == {
        0: "truncated JPEG (no end-of-image marker)",
        1: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)",
        2: "empty record",
        3: "label 2 is not one of the data set's 2 classes (0..1)",
        4: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)",
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

    import dali_fast.data.packed as packed

    walked = []
    real = packed.check_encoded
    monkeypatch.setattr(packed, "check_encoded", lambda data: walked.append(bytes(data)) or real(data))
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


def test_verify_shows_progress_only_when_asked_and_counts_every_record(small_folder, tmp_path, monkeypatch, caplog):
    """verify() is quiet by default; with progress=True on a terminal its bar ends at records/records,
    and without a terminal it says one line instead."""
    import io
    import logging
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    dst = tmp_path / "p"
    pack(small_folder, dst, progress=False)
    r = MemmapReader(dst)
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    with caplog.at_level(logging.INFO, logger="dali_fast.text"):
        assert r.verify() == []
        assert screen.getvalue() == "" and caplog.messages == []
        assert r.verify(progress=True) == []
    assert f"{r.count}/{r.count}" in screen.getvalue().rsplit("\r", 1)[-1]
    assert caplog.messages == []  # a bar was drawn: no line as well
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="dali_fast.text"):
        r.verify(progress=True)
    assert caplog.messages == [f"verify: {r.count} records ..."]
