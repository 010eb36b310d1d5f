"""The node cache's budget for remote Parquet row groups, against moto's S3 server: two shuffle windows of
the largest row group per rank on the node, refused at open in one line that says how much to give."""

from __future__ import annotations

import os
import shutil
import time
from collections import namedtuple

import numpy as np
import pytest
from builders import jpeg_bytes

from dali_fast import open_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

BUCKET = "budget"  # moto keeps one store per process: a bucket of this file's own
Usage = namedtuple("Usage", "total used free")
GiB = 1 << 30


@pytest.fixture
def url(empty_bucket, tmp_path, monkeypatch):
    """One Parquet file of three row groups (the last the largest) on the server."""
    server = empty_bucket
    images = [jpeg_bytes(24 + 8 * i, 20 + 4 * i) for i in range(6)]
    pq.write_table(pa.table({"image": images, "label": [0, 1] * 3}), tmp_path / "t.parquet", row_group_size=2)
    server.client.put_object(Bucket=BUCKET, Key="b/one.parquet", Body=(tmp_path / "t.parquet").read_bytes())
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return f"s3://{BUCKET}/b/one.parquet"


def opener(server, tmp_path):
    so = {"endpoint_url": server.endpoint}
    return lambda url, **kw: open_dataset(url, storage_options=so, cache_dir=tmp_path / "c", **kw)


def refusal(open_, url, **kw) -> str:
    with pytest.raises(ValueError) as e:
        open_(url, **kw)
    return str(e.value)


def test_the_budget_is_two_windows_of_the_largest_row_group_per_rank(server, url, tmp_path, monkeypatch):
    open_ = opener(server, tmp_path)
    biggest = max(int(c.size) for c in open_(url, cache_limit=10 * GiB).chunks)
    assert biggest > 0
    assert len(open_(url, cache_limit=2 * biggest, shuffle_window=1)) == 6  # exactly enough
    said = refusal(open_, url, cache_limit=2 * biggest - 1, shuffle_window=1)
    assert said == (
        f"cache_limit={2 * biggest - 1}: too small for 1 rank(s) on this node each reading shuffle windows of 1 "
        f"row group(s) of up to {biggest} bytes; use cache_limit >= {2 * biggest} (two windows per rank) or a "
        "smaller shuffle_window"
    )
    said = refusal(open_, url, cache_limit=4 * biggest - 1, shuffle_window=2)
    assert f"shuffle windows of 2 row group(s) of up to {biggest} bytes; use cache_limit >= {4 * biggest} " in said
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # three ranks on this node share the cache
    said = refusal(open_, url, cache_limit=6 * biggest - 1, shuffle_window=1)
    assert said.startswith(f"cache_limit={6 * biggest - 1}: too small for 3 rank(s) on this node") and (
        f">= {6 * biggest} (two windows" in said
    )
    assert len(open_(url, cache_limit=6 * biggest, shuffle_window=1)) == 6


def test_without_a_limit_the_refusal_names_the_cache_folder(server, url, tmp_path, monkeypatch):
    open_ = opener(server, tmp_path)
    biggest = max(int(c.size) for c in open_(url, cache_limit=10 * GiB).chunks)
    real = shutil.disk_usage
    folder = tmp_path / "c"

    def usage(path):  # 40 GiB, of which 4 GiB are kept free: room for one row group
        inside = os.path.abspath(path).startswith(os.path.abspath(folder))
        return Usage(40 * GiB, 36 * GiB - biggest, 4 * GiB + biggest) if inside else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    said = refusal(open_, url, shuffle_window=1)
    assert said.startswith(f"cache_dir {folder / 'shards'}: its disk can spare ")  # the shard reader's words
    assert said == (
        f"cache_dir {folder / 'shards'}: its disk can spare {biggest} bytes (its free space less a margin), too "
        f"little for 1 rank(s) on this node each reading shuffle windows of 1 row group(s) of up to {biggest} bytes "
        f"({2 * biggest} bytes); free space there, choose a cache folder on a larger disk (--cache-dir, "
        "cache_dir), or use a smaller shuffle_window"
    )


def test_settings_are_checked_at_open_and_default_as_the_shard_reader(server, url, tmp_path):
    open_ = opener(server, tmp_path)
    r = open_(url, cache_limit=10 * GiB)
    assert (r.download_threads, r.store.retry_seconds, r.store.timeout) == (4, 60.0, 60.0)
    for kw, said in (
        ({"shuffle_window": 0}, "shuffle_window=0: must be a positive number of row groups"),
        ({"shuffle_window": 1.5}, "shuffle_window=1.5: must be a positive number of row groups"),
        ({"row_group_cache": -1}, "row_group_cache=-1: must be >= 0 bytes"),
        ({"download_threads": 0}, "download_threads=0: must be a positive integer"),
        ({"download_threads": 2.5}, "download_threads=2.5: must be a positive integer"),
        ({"retry_seconds": -1}, "retry_seconds must be >= 0, timeout and chunk_bytes > 0"),
        ({"timeout": 0}, "retry_seconds must be >= 0, timeout and chunk_bytes > 0"),
        ({"chunk_bytes": 0}, "retry_seconds must be >= 0, timeout and chunk_bytes > 0"),
    ):
        assert refusal(open_, url, cache_limit=10 * GiB, **kw) == said
    r = open_(url, cache_limit=10 * GiB, download_threads=1, retry_seconds=0, timeout=0.5, chunk_bytes=1)
    assert (r.download_threads, r.store.retry_seconds, r.store.timeout, r.store.chunk_bytes) == (1, 0, 0.5, 1)
    r = open_(url, cache_limit=10 * GiB, row_group_cache=0, shuffle_window=1)
    assert [r[i][1] for i in range(6)] == [0, 1] * 3  # no row group kept: still reads


def test_a_download_that_fails_unexpectedly_names_its_row_group(server, url, tmp_path, monkeypatch):
    r = opener(server, tmp_path)(url, cache_limit=10 * GiB, shuffle_window=1)

    def broken(*args, **kwargs):
        raise RuntimeError("the client broke")

    monkeypatch.setattr(r.store, "download", broken)
    r.schedule(np.arange(6))  # downloaded ahead: the failure is met by the stream's own thread
    deadline = time.monotonic() + 20
    while r.stats()["bad_row_groups"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _, _, bad = r.read_batch_checked([0])
    assert bad[0] == (f"unreadable: row group 0 of {url}: {url}#0: RuntimeError: the client broke"), bad[0]
    r.close()


def test_where_the_cache_and_index_live_and_the_order_chosen(server, url, tmp_path, monkeypatch):
    so = {"endpoint_url": server.endpoint}
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "home"))
    r = open_dataset(url, storage_options=so)  # the defaults: all under $DALI_FAST_CACHE/remote
    assert r.cache.folder == tmp_path / "home" / "remote" / "shards"
    assert r.index_file.parent == tmp_path / "home" / "remote" / "parquet-index"
    assert r.streaming is True
    r = open_dataset(url, storage_options=so, index_dir=tmp_path / "idx", shuffle_window=2, streaming=None)
    assert r.index_file.parent == tmp_path / "idx" and r.shuffle_window == 2 and r.streaming is True
    r = open_dataset(url, storage_options=so, cache_dir=tmp_path / "c", streaming=False)
    assert r.cache.folder == tmp_path / "c" / "shards" and r.streaming is False
    assert r.index_file.parent == tmp_path / "c" / "parquet-index"
