"""The shard cache and its disk: without ``cache_limit`` the budget is what the disk can spare at open (its
free space and the cached shards, less a margin), said once, so the cache never fills the disk by itself;
a disk that fills anyway stops the run in one line naming the folder and --cache-limit, and nothing
half-written is ever read.

What is faked, at the boundary only: the disk's size and free space (`shutil.disk_usage`, so a test need
not fill a real disk), and the disk filling up (`store.write_at`, the one place shard bytes are written,
raises ENOSPC as ``os.pwrite`` would). Servers, downloads, files and loaders are real."""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import threading
import time
from collections import namedtuple

import pytest
from builders import jpeg_bytes
from contract import each_once

from dali_fast import open_dataset
from dali_fast.cli import main
from dali_fast.data.remote import cache as remote_cache
from dali_fast.data.remote import store
from dali_fast.data.remote.errors import CacheDiskFullError
from dali_fast.loaders.torch_iterator import TorchIterator

pytest.importorskip("s3fs")
pytest.importorskip("moto")
wds = pytest.importorskip("webdataset")
from object_store import S3Server  # noqa: E402

SHARDS, PER_SHARD = 6, 8
N = SHARDS * PER_SHARD
SPEC = "s3://disk/train-{000000..000005}.tar"  # moto keeps one store per process: a bucket of its own
GiB = 2**30
Usage = namedtuple("Usage", "total used free")


def shard_bytes(first: int) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for i in range(first, first + PER_SHARD):
            sink.write({"__key__": f"s{i:04d}", "jpg": jpeg_bytes(24 + i % 7, 20), "cls": str(i).encode()})
    return buf.getvalue()


@pytest.fixture(scope="module")
def server():
    srv = S3Server()
    srv.client.create_bucket(Bucket="disk")
    srv.objects = {f"train-{s:06d}.tar": shard_bytes(s * PER_SHARD) for s in range(SHARDS)}
    for key, body in srv.objects.items():
        srv.client.put_object(Bucket="disk", Key=key, Body=body)
    yield srv
    srv.stop()


@pytest.fixture
def s3(server, tmp_path, monkeypatch):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # one of another test's endpoint would be reused
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    open_dataset(SPEC, cache_dir=tmp_path / "indexing", index_dir=tmp_path / "index")  # the index, on the real disk
    server.counts.reset()
    yield server
    s3fs.S3FileSystem.clear_instance_cache()


def fake_disk(monkeypatch, folder, total: int, free: int) -> None:
    """The disk of ``folder`` (and what is under it) as ``total`` bytes with ``free`` free, as
    `shutil.disk_usage` reads it; every other path reads the real disk."""
    real = shutil.disk_usage

    def usage(path):
        inside = os.path.abspath(path).startswith(os.path.abspath(folder))
        return Usage(total, total - free, free) if inside else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)


def biggest(server) -> int:
    return max(len(b) for b in server.objects.values())


def test_without_a_limit_the_budget_is_the_disks_free_space_less_a_margin_said_once(s3, tmp_path, monkeypatch, caplog):
    shard = biggest(s3)
    margin = max(int(100 * GiB * remote_cache.DISK_MARGIN), remote_cache.DISK_MARGIN_MIN)
    assert margin == 10 * GiB  # 10 % of a 100 GiB disk
    fake_disk(monkeypatch, tmp_path / "c", 100 * GiB, margin + 5 * shard // 2)  # room for two and a half shards
    folder = tmp_path / "c" / "shards"
    with caplog.at_level(logging.INFO, logger="dali_fast"):
        r = open_dataset(SPEC, cache_dir=tmp_path / "c", index_dir=tmp_path / "index", shuffle_window=1)
    budget = 5 * shard // 2
    assert r.cache.limit == budget and not r.cache.limit_given
    said = [m for m in caplog.messages if m.startswith(f"shard cache {folder}: ")]
    assert said == [
        f"shard cache {folder}: up to {budget} bytes of shards (no cache_limit given: the disk's "
        f"{(margin + budget) / GiB:.1f} GiB free and 0 bytes already cached, less 10.0 GiB kept free)"
    ]
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], r.cache.used())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        loader = TorchIterator(r, 4, image_size=16, num_workers=0, rank=0, world_size=1, seed=2)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            each_once([int(x) for _, b in loader for x in b.tolist()], range(N))
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak[0] <= budget and r.cache.used() <= budget  # the shards never took more than the budget
    assert r.stats()["evictions"] >= SHARDS - 2
    r.close()


def test_a_disk_without_room_is_refused_at_open_naming_the_folder(s3, tmp_path, monkeypatch):
    shard = biggest(s3)
    fake_disk(monkeypatch, tmp_path / "c", 40 * GiB, 1 * GiB)  # less than the 4 GiB kept free: no room at all
    with pytest.raises(ValueError) as e:
        open_dataset(SPEC, cache_dir=tmp_path / "c", index_dir=tmp_path / "index")
    assert str(e.value) == (
        f"cache_dir {tmp_path / 'c' / 'shards'}: its disk has 1.0 GiB free, less than the 4.0 GiB kept free for "
        "other writers; free space there, or choose a cache folder on a larger disk (--cache-dir, cache_dir)"
    )
    fake_disk(monkeypatch, tmp_path / "c", 40 * GiB, 4 * GiB + shard)  # room for one shard: two windows need two
    with pytest.raises(ValueError) as e:
        open_dataset(SPEC, cache_dir=tmp_path / "c", index_dir=tmp_path / "index", shuffle_window=1)
    assert str(e.value).startswith(f"cache_dir {tmp_path / 'c' / 'shards'}: its disk can spare {shard} bytes (its")
    assert str(e.value).endswith("or use a smaller shuffle_window") and "\n" not in str(e.value)
    assert s3.bytes_served == {}  # refused before any download
    assert not list((tmp_path / "c" / "shards").glob("*.tar"))


def full_after(monkeypatch, writes: int) -> list[int]:
    """The disk fills after ``writes`` more writes of shard bytes: later ones write part of their bytes,
    then fail with ENOSPC, as ``pwrite`` on a full disk does."""
    real, done = store.write_at, [0]

    def write_at(fd: int, data: bytes, offset: int) -> None:
        if done[0] >= writes:
            os.pwrite(fd, data[: len(data) // 2], offset)  # what fitted
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done[0] += 1
        real(fd, data, offset)

    monkeypatch.setattr(store, "write_at", write_at)
    return done


def disk_full_message(folder) -> str:
    return (
        f"shard cache {folder}: the disk is full (No space left on device); free space on it, or keep the cache "
        "below what the disk can hold with --cache-limit (cache_limit), or choose another --cache-dir"
    )


def whole_or_nothing(s3, folder) -> None:
    """Nothing half-written in the cache: no temporary file, and every shard file is the server's bytes."""
    assert not [p for p in folder.iterdir() if ".part-" in p.name]
    assert all(p.read_bytes() in s3.objects.values() for p in folder.glob("*.tar"))


def test_a_disk_that_fills_while_indexing_stops_the_open_in_one_line(s3, tmp_path, monkeypatch, capsys):
    full_after(monkeypatch, 0)
    folder = tmp_path / "c" / "shards"
    with pytest.raises(CacheDiskFullError) as e:
        open_dataset(SPEC, cache_dir=tmp_path / "c")  # a new index: every shard is fetched to be read
    assert str(e.value) == disk_full_message(folder)
    whole_or_nothing(s3, folder)
    assert not list(folder.glob("*.tar"))
    assert main(["inspect", SPEC, "--cache-dir", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == f"dali-fast inspect: error: {disk_full_message(folder)}\n"


def test_a_disk_that_fills_mid_epoch_stops_the_run_not_a_sample_skipped(s3, tmp_path, monkeypatch):
    r = open_dataset(SPEC, cache_dir=tmp_path / "c", index_dir=tmp_path / "index", shuffle_window=1)
    folder = tmp_path / "c" / "shards"
    full_after(monkeypatch, 2)  # two shards fit (one range request each), then the disk is full
    loader = TorchIterator(r, 4, image_size=16, num_workers=0, rank=0, world_size=1, seed=3, on_error="skip")
    got: list[int] = []
    with pytest.raises(CacheDiskFullError) as e:
        for _, labels in loader:
            got += labels.tolist()
    assert str(e.value) == disk_full_message(folder)
    assert loader.skipped == 0 and len(got) < N  # it stopped: no sample was skipped as if it were bad
    loader.close()
    r.close()  # the downloads ahead stop (and remove what they had begun)
    whole_or_nothing(s3, folder)


def test_train_stops_in_one_line_when_the_disk_fills(s3, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "c"
    open_dataset(SPEC, cache_dir=cache).close()  # the index under --cache-dir
    for p in (cache / "shards").glob("*.tar"):
        p.unlink()  # the shards must be fetched again
    full_after(monkeypatch, 1)
    argv = ["train", SPEC, "--cache-dir", str(cache), "--loader", "torch", "--model", "resnet_tiny"]
    argv += ["--epochs", "1", "--batch-size", "4", "--image-size", "16", "--num-workers", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"dali-fast train: error: {disk_full_message(cache / 'shards')}"
    whole_or_nothing(s3, cache / "shards")
