"""`write_shards`: exact bytes and targets back through the readers, partitions written apart read as one
set, fixed tar headers, shard sizes, atomic shards (a SIGKILLed writer), retries, and a URL destination."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from builders import jpeg_bytes, one_line, png_bytes

from dali_fast import open_dataset, write_shards
from dali_fast.data.pack.tar_writer import DEFAULT_SHARD_SIZE, encode_target
from dali_fast.data.shards import index_shard, scan_tar
from dali_fast.data.webdataset import WebDatasetReader

ROOT = Path(__file__).resolve().parents[2]


def records(n: int, first: int = 0) -> list[tuple[bytes, int]]:
    """``n`` distinct images (JPEGs, every fifth a PNG) with label = number % 7."""
    out = []
    for i in range(first, first + n):
        image = png_bytes(20 + i % 9, 10 + i % 5, "RGB") if i % 5 == 4 else jpeg_bytes(24 + i % 13, 20 + i % 7)
        out.append((image, i % 7))
    return out


def read_back(path) -> list[tuple[bytes, int, str]]:
    """(bytes, label, member name) of every sample, in the reader's order."""
    r = open_dataset(str(path))
    return [(bytes(r[i][0]), r[i][1], r.source(i).rsplit(":", 1)[1]) for i in range(len(r))]


def members(shard: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(shard) as tar:
        return tar.getmembers()


# --------------------------------------------------------------------------------------------- round trip


def test_bytes_and_class_targets_read_back_exactly_in_order(tmp_path, cache):
    recs = records(23)
    report = write_shards(recs, tmp_path / "out", prefix="train", shard_size=16 * 1024)
    got = read_back(tmp_path / "out")
    assert [(b, label) for b, label, _ in got] == recs
    ext = ["png" if i % 5 == 4 else "jpg" for i in range(23)]
    assert [name for *_, name in got] == [f"train-{i:09d}.{ext[i]}" for i in range(23)]
    assert report.samples == 23 and report.skipped == [] and report.removed == []
    assert report.shards == [f"train-{s:06d}.tar" for s in range(len(report.shards))] and len(report.shards) > 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == report.shards
    assert report.bytes == sum((tmp_path / "out" / s).stat().st_size for s in report.shards)
    mib = f"{report.bytes / 2**20:.1f}"
    assert report.summary().startswith(
        f"wrote 23 samples in {len(report.shards)} shards ({mib} MiB) to {tmp_path / 'out'} in "
    )


def test_the_webdataset_package_reads_the_same_samples(tmp_path):
    wds = pytest.importorskip("webdataset")
    recs = records(12)
    report = write_shards(recs, tmp_path, prefix="p", shard_size=8 * 1024)
    urls = [str(tmp_path / s) for s in report.shards]
    got = [(s.get("jpg", s.get("png")), int(s["cls"])) for s in wds.WebDataset(urls, shardshuffle=False)]
    assert got == recs


def test_buffers_arrays_and_numpy_labels_are_taken(tmp_path, cache):
    image = jpeg_bytes()
    recs = [
        (bytearray(image), np.int64(3)),
        (memoryview(image), np.array(4)),
        (np.frombuffer(image, np.uint8), 5),
        (np.frombuffer(image + image, np.uint8)[len(image) :], np.uint8(6)),  # a view at an offset
    ]
    write_shards(recs, tmp_path, prefix="x")
    assert [(b, label) for b, label, _ in read_back(tmp_path)] == [(image, 3), (image, 4), (image, 5), (image, 6)]


def test_list_targets_are_json_labels_exactly(tmp_path):
    targets = [[3, 1, 4], (0.5, -2.0), np.array([7, 8], dtype=np.int32), np.array([0.25], dtype=np.float32), 1.5, [2]]
    write_shards([(jpeg_bytes(), t) for t in targets], tmp_path, prefix="m")
    with tarfile.open(tmp_path / "m-000000.tar") as tar:
        docs = [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".json")]
        assert [m.name for m in tar.getmembers()][:2] == ["m-000000000.jpg", "m-000000000.json"]
    assert docs == [
        b'{"labels":[3,1,4]}',
        b'{"labels":[0.5,-2.0]}',
        b'{"labels":[7,8]}',
        b'{"labels":[0.25]}',
        b'{"labels":[1.5]}',
        b'{"labels":[2]}',
    ]
    assert all(isinstance(json.loads(d)["labels"], list) for d in docs)


def test_what_a_target_may_be_is_said_in_one_line():
    assert encode_target(0) == ("cls", b"0") and encode_target(np.int16(2**15 - 1)) == ("cls", b"32767")
    assert encode_target(2**31 - 1) == ("cls", b"2147483647")
    assert encode_target(()) == encode_target([]) == ("json", b'{"labels":[]}')  # multi-hot: no class
    cases = {
        -1: "class index -1 is outside 0..2147483647",
        2**31: "class index 2147483648 is outside 0..2147483647",
        True: "target True (bool): use an int class index, or a list of class indices or numbers",
        "cat": "target 'cat' (str): use an int class index, or a list of class indices or numbers",
        None: "target None (NoneType): use an int class index, or a list of class indices or numbers",
    }
    for target, message in cases.items():
        with pytest.raises(ValueError) as e:
            encode_target(target)
        assert one_line(e) == message
    for target in ([1, "a"], [float("nan")], [1.0, float("inf")], [True], np.zeros((2, 2))):
        with pytest.raises(ValueError, match="a list target holds finite numbers only"):
            encode_target(target)


# --------------------------------------------------------------------------------------------- partitions


def test_partitions_written_apart_read_back_as_one_set(tmp_path, cache):
    parts = [records(9, 0), records(0, 9), records(14, 9), records(5, 23)]  # one partition is empty
    reports = [
        write_shards(iter(part), tmp_path / "set", prefix=f"train-{k:05d}", shard_size=12 * 1024)
        for k, part in enumerate(parts)
    ]
    assert reports[1].shards == [] and reports[1].samples == 0
    got = read_back(tmp_path / "set")
    expected = [r for part in parts for r in part]
    assert Counter((b, label) for b, label, _ in got) == Counter(expected) and len(got) == 28
    keys = [name.split(".")[0] for *_, name in got]
    assert len(set(keys)) == len(keys) == 28
    assert sorted(keys) == sorted(f"train-{k:05d}-{i:09d}" for k, part in enumerate(parts) for i in range(len(part)))
    names = sorted(p.name for p in (tmp_path / "set").iterdir())
    assert names == sorted(s for r in reports for s in r.shards)


def test_a_retried_partition_replaces_its_shards_and_removes_its_stale_ones(tmp_path, cache):
    out = tmp_path / "set"
    first = write_shards(records(20), out, prefix="a", shard_size=8 * 1024)
    other = write_shards(records(3, 50), out, prefix="a-00001")  # "a-00001-000000.tar": another prefix
    assert len(first.shards) >= 3
    again = write_shards(records(20), out, prefix="a")  # one shard now: the default size holds them all
    assert again.shards == ["a-000000.tar"] and again.removed == first.shards[1:]
    assert sorted(p.name for p in out.iterdir()) == ["a-000000.tar", *other.shards]
    assert Counter((b, label) for b, label, _ in read_back(out)) == Counter(records(20) + records(3, 50))


def test_the_same_records_give_the_same_bytes_with_fixed_headers(tmp_path):
    write_shards(records(6), tmp_path / "one", prefix="s")
    time.sleep(1.1)  # a header carrying the time would differ now
    write_shards(records(6), tmp_path / "two", prefix="s")
    one, two = (tmp_path / "one" / "s-000000.tar").read_bytes(), (tmp_path / "two" / "s-000000.tar").read_bytes()
    assert one == two
    infos = members(tmp_path / "one" / "s-000000.tar")
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.type) for m in infos} == {
        (0, 0, 0, "", "", 0o644, tarfile.REGTYPE)
    }
    assert len(one) % 512 == 0 and one.endswith(b"\0" * 1024)


def test_a_long_prefix_gets_gnu_long_names_that_read_back(tmp_path, cache):
    prefix = "p" * 120
    write_shards(records(3), tmp_path, prefix=prefix)
    assert [m.name for m in members(tmp_path / f"{prefix}-000000.tar")][:2] == [
        f"{prefix}-000000000.jpg",
        f"{prefix}-000000000.cls",
    ]
    assert [(b, label) for b, label, _ in read_back(tmp_path)] == records(3)


# --------------------------------------------------------------------------------------------- shard sizes


def test_each_shard_stays_within_the_size_and_fills_up_first(tmp_path):
    recs = records(40)
    size = 10 * 1024
    report = write_shards(recs, tmp_path, prefix="s", shard_size=size)
    per_shard, total = [], 0
    for name in report.shards:
        path = tmp_path / name
        assert path.stat().st_size <= size
        found = index_shard(path)
        assert found.skipped == [] and scan_tar(path)[1] is None
        per_shard.append(len(found.labels))
        total += len(found.labels)
    assert total == 40
    # the next shard's first sample did not fit: a shard never closes with room for it
    first_of_next = np.cumsum(per_shard)[:-1]
    for name, nxt in zip(report.shards, first_of_next, strict=False):
        image, _ = recs[nxt]
        need = 512 + -(-len(image) // 512) * 512 + 512 + 512  # image header + data, .cls header + data
        assert (tmp_path / name).stat().st_size + need > size


def test_a_sample_larger_than_the_shard_size_gets_a_shard_of_its_own(tmp_path, caplog, cache):
    big = jpeg_bytes(400, 300)
    recs = [*records(2), (big, 1), *records(2, 2)]
    report = write_shards(recs, tmp_path, prefix="s", shard_size=len(big) // 2)
    sizes = {n: (tmp_path / n).stat().st_size for n in report.shards}
    big_shard = [n for n in report.shards if sizes[n] > len(big) // 2]
    assert len(big_shard) == 1 and [m.name for m in members(tmp_path / big_shard[0])] == [
        "s-000000002.jpg",
        "s-000000002.cls",
    ]
    assert sum(len(index_shard(tmp_path / n).labels) for n in report.shards) == 5
    assert any("s-000000002" in r.message and "a shard of its own" in r.message for r in caplog.records)
    assert [(b, label) for b, label, _ in read_back(tmp_path)] == recs


# --------------------------------------------------------------------------------------------- bad input


def test_a_bad_record_is_named_by_position_or_skipped_and_listed(tmp_path, cache):
    good = jpeg_bytes()
    bad = [(good, 0), (b"GIF89a....", 1), (good[: len(good) // 2], 2), (good, "cat"), ("not a pair",), (good, 4)]
    with pytest.raises(ValueError) as e:
        write_shards(bad, tmp_path / "raise", prefix="p")
    assert one_line(e) == (
        "record 1 of prefix 'p': not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM); write_shards stores whole JPEG or PNG "
        "files; fix it, or pass on_error='skip'"
    )
    assert not list((tmp_path / "raise").glob("*.tar")), "the shard being written when it failed has no name"
    report = write_shards(bad, tmp_path / "skip", prefix="p", on_error="skip")
    assert report.samples == 2 and [where for where, _ in report.skipped] == [
        "record 1 (p-000000001)",
        "record 2 (p-000000002)",
        "record 3 (p-000000003)",
        "record 4 (p-000000004)",
    ]
    assert report.skipped[1][1].startswith("truncated JPEG")
    assert report.skipped[3][1] == "a tuple, not an (encoded bytes, target) pair"
    assert [(b, label, n) for b, label, n in read_back(tmp_path / "skip")] == [
        (good, 0, "p-000000000.jpg"),
        (good, 4, "p-000000005.jpg"),
    ]


def test_argument_messages(tmp_path):
    cases = [
        ({"prefix": "a.b"}, "prefix='a.b': use letters, digits, '_' and '-'"),
        ({"prefix": "a/b"}, "prefix='a/b': use letters"),
        ({"prefix": ""}, "prefix='': use letters"),
        ({"shard_size": 0}, "shard_size=0: a positive number of bytes, e.g. 256 * 2**20"),
        ({"shard_size": 1.5}, "shard_size=1.5: a positive number of bytes"),
        ({"on_error": "ignore"}, "on_error='ignore': use 'raise' or 'skip'"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError) as e:
            write_shards(records(1), tmp_path / "out", **kw)
        assert one_line(e).startswith(message)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError) as e:
        write_shards(records(1), tmp_path / "file")
    assert one_line(e) == f"{tmp_path / 'file'}: a file, not a folder; write_shards writes shards into a folder"
    assert DEFAULT_SHARD_SIZE == 256 * 2**20 and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- a killed writer

KILLED_WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from builders import jpeg_bytes
from dali_fast import write_shards

def slow():
    for i in range(10_000):
        if i == 30:
            print("second shard under way", flush=True)
        if i >= 30:
            time.sleep(0.01)
        yield jpeg_bytes(40 + i % 11, 30), i % 3

write_shards(slow(), {out!r}, prefix="k", shard_size=30 * 2048)
"""


def test_a_killed_writer_leaves_no_shard_under_a_final_name(tmp_path, cache):
    """SIGKILL while a shard is half written: every .tar there is whole; the half one has only a temporary
    name, which no reader lists and the next write of that prefix removes."""
    out = tmp_path / "out"
    code = KILLED_WRITER.format(tests=str(ROOT / "tests" / "helpers"), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "second shard under way"
        deadline = time.time() + 60
        while time.time() < deadline and not any(p.stat().st_size > 4096 for p in out.glob(".k-000001.tar.*.tmp")):
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tmps = list(out.glob(".k-*.tmp"))
    assert len(tmps) == 1 and tmps[0].name.startswith(".k-000001.tar.") and tmps[0].stat().st_size > 4096
    assert sorted(p.name for p in out.glob("*.tar")) == ["k-000000.tar"]
    assert scan_tar(out / "k-000000.tar")[1] is None  # whole: the end-of-archive blocks and nothing missing
    first = WebDatasetReader(str(out))
    expected = [(jpeg_bytes(40 + i % 11, 30), i % 3) for i in range(len(first))]
    assert 10 < len(first) < 30 and first.skipped == []
    assert [(bytes(first[i][0]), first[i][1]) for i in range(len(first))] == expected
    report = write_shards(records(3), out, prefix="k")  # a retry: its temporaries of dead writers go
    assert report.removed == [] and not list(out.glob(".k-*.tmp"))
    assert [(b, label) for b, label, _ in read_back(out)] == records(3)


# --------------------------------------------------------------------------------------------- a URL


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from object_store import S3Server

    server = S3Server()
    yield server
    server.stop()


def test_a_url_destination_uploads_each_shard_and_reads_back_as_one_set(s3_server, tmp_path, cache):
    s3_server.reset()
    s3_server.client.create_bucket(Bucket="out")
    opts = {"endpoint_url": s3_server.endpoint}
    parts = [records(11), records(7, 11)]
    reports = [
        write_shards(part, "s3://out/train", prefix=f"part-{k:02d}", shard_size=10 * 1024, storage_options=opts)
        for k, part in enumerate(parts)
    ]
    listed = s3_server.client.list_objects_v2(Bucket="out")["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted(f"train/{s}" for r in reports for s in r.shards)
    assert all(o["Size"] == len(s3_server.client.get_object(Bucket="out", Key=o["Key"])["Body"].read()) for o in listed)
    for report in reports:  # the bytes on the server are the bytes a local write gives
        local = write_shards(
            parts[reports.index(report)], tmp_path / "local", prefix=report.prefix, shard_size=10 * 1024
        )
        assert local.shards == report.shards and local.bytes == report.bytes
        for name in report.shards:
            body = s3_server.client.get_object(Bucket="out", Key=f"train/{name}")["Body"].read()
            assert body == (tmp_path / "local" / name).read_bytes()
    remote = open_dataset("s3://out/train/", storage_options=opts, cache_dir=tmp_path / "rcache")
    got = [(bytes(remote[i][0]), remote[i][1]) for i in range(len(remote))]
    remote.close()
    assert Counter(got) == Counter(parts[0] + parts[1])
    # a retry with fewer shards removes the stale ones of its prefix on the server too
    again = write_shards(parts[0], "s3://out/train", prefix="part-00", storage_options=opts)
    assert again.removed == reports[0].shards[1:]
    keys = sorted(o["Key"] for o in s3_server.client.list_objects_v2(Bucket="out")["Contents"])
    assert keys == sorted(["train/part-00-000000.tar", *(f"train/{s}" for s in reports[1].shards)])
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("dali_fast-shards-*/*.tar"))


def test_a_failed_upload_is_raised(s3_server, tmp_path):
    s3_server.reset()  # no bucket
    opts = {"endpoint_url": s3_server.endpoint}
    with pytest.raises(FileNotFoundError):
        write_shards(records(2), "s3://missing-bucket/x", prefix="p", storage_options=opts)
