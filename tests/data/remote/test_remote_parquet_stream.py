"""Remote Parquet row groups in the node's cache, against moto's S3 server: the row groups downloaded ahead
are the scheduled ones (and the next epoch's first), a full cache holds back downloads ahead but not a read
that needs its row group now, `close` stops a download under way, and a row group that failed is not asked
for again."""

from __future__ import annotations

import gc
import pickle
import sys
import time

import numpy as np
import pytest
from builders import jpeg_bytes

from dali_fast import open_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

from dali_fast.data.remote.cache import ShardCache  # noqa: E402

BUCKET = "stream"  # moto keeps one store per process: a bucket of this file's own
KEY = "g/one.parquet"
ROWS = 8  # two row groups of four


@pytest.fixture
def s3g(empty_bucket, tmp_path):
    """A bucket holding one Parquet file of two row groups; the caches under tmp_path."""
    server = empty_bucket
    images = [jpeg_bytes(40 + 3 * i, 30) for i in range(ROWS)]
    pq.write_table(pa.table({"image": images, "label": [i % 3 for i in range(ROWS)]}), tmp_path / "t.parquet",
                   row_group_size=4)  # fmt: skip
    server.client.put_object(Bucket=BUCKET, Key=KEY, Body=(tmp_path / "t.parquet").read_bytes())
    server.images = images
    yield server
    server.unstall()


def reader(server, tmp_path, **kw):
    kw.setdefault("cache_dir", tmp_path / "cache")
    return open_dataset(f"s3://{BUCKET}/{KEY}", storage_options={"endpoint_url": server.endpoint}, **kw)


def cached(r) -> list[bool]:
    """Whether each row group's image column is a complete file in the node's cache."""
    return [r.cache.path(c.key()).exists() for c in r.chunks]


def wait_for(what, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


def gets(server) -> int:
    return server.counts.gets.get(f"{BUCKET}/{KEY}", 0)


def fill(r, tmp_path) -> int:
    """Pin the whole budget of ``r``'s cache from another cache object (another process's pins); its fd."""
    other = ShardCache(r.cache.folder, r.cache.limit)
    fd = other.acquire("another-process", r.cache.limit, lambda tmp: None, pin=True)
    assert isinstance(fd, int)
    return fd


def test_the_scheduled_row_groups_are_downloaded_ahead_and_no_other(s3g, tmp_path):
    r = reader(s3g, tmp_path, shuffle_window=1, prefetch_next_epoch=False)
    r.schedule(np.arange(4), then=np.arange(4, 8))  # this epoch: row group 0 only
    wait_for(lambda: r.stats()["downloads"] == 1)
    time.sleep(0.3)
    assert cached(r) == [True, False] and r.stats()["downloads"] == 1
    r.close()
    r = reader(s3g, tmp_path, shuffle_window=1, cache_dir=tmp_path / "c2")
    r.schedule(np.arange(4, 8))
    wait_for(lambda: r.stats()["downloads"] == 1)
    time.sleep(0.3)
    assert cached(r) == [False, True]
    r.close()


def test_the_next_epochs_first_row_groups_are_downloaded_ahead(s3g, tmp_path):
    r = reader(s3g, tmp_path, shuffle_window=1)
    r.schedule(np.arange(4), then=np.array([6, 5, 0, 1]))  # the next epoch starts in row group 1
    wait_for(lambda: r.stats()["downloads"] == 2)
    assert cached(r) == [True, True]
    assert [bytes(r[i][0]) for i in range(ROWS)] == s3g.images and r.stats()["downloads"] == 2
    r.close()


def test_this_pass_s_row_groups_come_first_and_only_the_next_epoch_s_stay_pinned_after_it(s3g, tmp_path):
    """The rest of this pass reads row group 0, the next epoch starts in row group 1: both are downloaded
    ahead, and once the pass's four records are delivered its group is unpinned, the next epoch's kept."""
    r = reader(s3g, tmp_path, shuffle_window=1)
    r.schedule(np.arange(4), then=np.arange(4, 8))
    wait_for(lambda: r.stats()["downloads"] == 2)
    assert cached(r) == [True, True] and r.stats()["pinned"] == 2
    r.advance(3)
    assert r.stats()["pinned"] == 2  # record 3 of row group 0 is still to come
    r.advance(1)
    assert r.stats()["pinned"] == 1  # the pass is done with row group 0; row group 1 waits for the next epoch
    r.close()


def test_downloads_ahead_never_go_over_a_full_budget_and_stop_at_close(s3g, tmp_path):
    r = reader(s3g, tmp_path, shuffle_window=1, cache_limit=100_000)
    fd = fill(r, tmp_path)
    r.cache.overflow_after = 0.05  # a read that needs its row group now would go over at once
    opened = gets(s3g)  # the footer and the labels
    r.schedule(np.arange(ROWS))
    time.sleep(1.0)
    assert r.stats()["downloads"] == 0 and cached(r) == [False, False] and gets(s3g) == opened
    r.close()
    assert r._stream._threads and not [t for t in r._stream._threads if t.is_alive()]  # noqa: SLF001
    r.cache.release("another-process", fd)


def test_a_read_that_needs_its_row_group_waits_for_room_then_goes_over(s3g, tmp_path, caplog):
    r = reader(s3g, tmp_path, shuffle_window=1, cache_limit=100_000, streaming=False)
    fd = fill(r, tmp_path)
    r.cache.overflow_after = 0.3
    t0 = time.monotonic()
    assert bytes(r[5][0]) == s3g.images[5]
    assert time.monotonic() - t0 >= 0.3 and cached(r) == [False, True]
    assert "going over cache_limit=100000 by up to one shard" in caplog.text
    r.close()
    r.cache.release("another-process", fd)


def test_close_stops_a_download_under_way_at_its_next_range_request(s3g, tmp_path):
    r = reader(s3g, tmp_path, shuffle_window=1, chunk_bytes=256)
    requests = -(-int(r.chunks[0].size) // 256)
    assert requests >= 8
    opened = gets(s3g)  # the footer and the labels
    s3g.stall(f"{BUCKET}/{KEY}", 0.25, times=1000)  # each range request answers after 0.25 s
    r.schedule(np.arange(4))
    wait_for(lambda: gets(s3g) >= opened + 2)
    r.close()
    done = gets(s3g) - opened
    time.sleep(0.6)
    assert gets(s3g) - opened == done and 2 <= done < requests and cached(r) == [False, False]


def test_a_row_group_that_failed_is_not_asked_for_again(s3g, tmp_path):
    r = reader(s3g, tmp_path, shuffle_window=1, streaming=False, retry_seconds=0.0)
    body = s3g.client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    s3g.client.delete_object(Bucket=BUCKET, Key=KEY)
    _, _, bad = r.read_batch_checked([1])
    assert (
        bad[0].startswith(f"unreadable: row group 0 of s3://{BUCKET}/{KEY}: ") and "no longer on the server" in bad[0]
    )
    s3g.client.put_object(Bucket=BUCKET, Key=KEY, Body=body)  # back, but this reader has its answer
    asked = gets(s3g)
    _, _, again = r.read_batch_checked([1, 4])
    assert again == bad and gets(s3g) == asked + 1  # row group 1 only: one range request
    assert r.stats()["bad_row_groups"] == 1
    r.close()


def test_a_pickled_reader_reads_the_same_rows_through_a_stream_of_its_own(s3g, tmp_path):
    r = reader(s3g, tmp_path, shuffle_window=1)
    r.schedule(np.arange(4))
    wait_for(lambda: r.stats()["pinned"] == 1)
    copy = pickle.loads(pickle.dumps(r))  # what a spawned DataLoader worker gets
    assert copy._stream is not r._stream and copy.stats()["pinned"] == 0  # noqa: SLF001 - the parent's pins stay its own
    assert [(bytes(copy[i][0]), copy[i][1]) for i in range(ROWS)] == [(x, i % 3) for i, x in enumerate(s3g.images)]
    assert r.stats()["pinned"] == 1
    copy.close()
    r.close()


def test_a_reader_whose_open_failed_says_nothing_more_when_collected(s3g, tmp_path, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ValueError, match="^shuffle_window=0: must be a positive number of row groups$"):
        reader(s3g, tmp_path, shuffle_window=0)
    gc.collect()
    assert unraisable == []


def test_each_row_groups_image_column_is_named_by_its_file_and_place_in_it(s3g, tmp_path):
    s3g.client.put_object(
        Bucket=BUCKET, Key="g/two.parquet", Body=s3g.client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    )
    r = open_dataset(
        f"s3://{BUCKET}/g/{{one,two}}.parquet", storage_options={"endpoint_url": s3g.endpoint}, cache_dir=tmp_path / "c"
    )
    base = f"s3://{BUCKET}/g/"
    assert [c.url for c in r.chunks] == [
        f"{base}one.parquet#0",
        f"{base}one.parquet#1",
        f"{base}two.parquet#0",
        f"{base}two.parquet#1",
    ]
    assert len({c.key() for c in r.chunks}) == 4
