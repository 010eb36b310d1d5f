"""Parquet files on a plain web server (``http://``/``https://`` with range requests, a local server here):
read in place as they are over S3, indexed once, re-indexed when a file changes, denied and TLS failures
named."""

from __future__ import annotations

import os
import time

import pytest
from builders import jpeg_bytes
from object_store import RangeHTTPServer, self_signed_certificate

from dali_fast import open_dataset
from dali_fast.data.remote import errors

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

ROWS = (7, 5)  # rows of each file; row groups of three


def write(folder, rows=ROWS, seed: int = 0) -> list[tuple[bytes, int]]:
    """train-0.parquet, train-1.parquet in ``folder``; the (image, label) of every row, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k, n in enumerate(rows):
        images = [jpeg_bytes(20 + seed + 2 * len(out) + i, 16) for i in range(n)]
        labels = [(len(out) + i + seed) % 4 for i in range(n)]
        pq.write_table(pa.table({"image": images, "label": labels}), folder / f"train-{k}.parquet", row_group_size=3)
        out += list(zip(images, labels, strict=True))
    return out


@pytest.fixture
def www(tmp_path, monkeypatch):
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
    rows = write(tmp_path / "www")
    srv = RangeHTTPServer(tmp_path / "www")
    srv.rows = rows
    yield srv
    srv.stop()


def test_every_row_reads_back_exactly_with_its_url_and_the_index_is_reused(www, tmp_path):
    spec = f"{www.url}/train-{{0..1}}.parquet"
    r = open_dataset(spec, cache_dir=tmp_path / "c", chunk_bytes=512)
    n = sum(ROWS)
    assert type(r).__name__ == "RemoteParquetReader" and len(r) == n
    assert [(bytes(r[i][0]), r[i][1]) for i in range(n)] == www.rows
    assert r.source(8) == f"{www.url}/train-1.parquet:1"
    images = sum(int(c.size) for c in r.chunks)
    served = sum(www.bytes_served.values())
    assert served > images  # the footers and label columns too, at open
    www.counts.reset()
    again = open_dataset(spec, cache_dir=tmp_path / "c")
    assert again.fingerprint == r.fingerprint and [bytes(again[i][0]) for i in range(n)] == [x for x, _ in www.rows]
    assert www.bytes_served == {}  # the index, the footers and the row groups all came from the cache


def test_a_file_changed_on_the_server_is_indexed_again(www, tmp_path):
    spec = f"{www.url}/train-{{0..1}}.parquet"
    before = open_dataset(spec, cache_dir=tmp_path / "c")
    time.sleep(0.01)
    rows = write(tmp_path / "new", rows=(4, 5), seed=50)
    os.replace(tmp_path / "new" / "train-0.parquet", tmp_path / "www" / "train-0.parquet")  # a new ETag
    after = open_dataset(spec, cache_dir=tmp_path / "c")
    assert len(after) == 9 and after.fingerprint != before.fingerprint and after.index_file != before.index_file
    assert [(bytes(after[i][0]), after[i][1]) for i in range(4)] == rows[:4]
    _, _, bad = before.read_batch_checked([0])  # opened before the change: its row group is refused
    assert bad[0].startswith(f"unreadable: row group 0 of {www.url}/train-0.parquet: ")


def test_a_denied_file_and_a_tls_failure_are_named(tmp_path):
    write(tmp_path / "www")
    srv = RangeHTTPServer(tmp_path / "www")
    srv.deny.add("train-1.parquet")
    try:
        url = f"{srv.url}/train-1.parquet"
        with pytest.raises(errors.AccessDeniedError) as e:
            open_dataset(url, cache_dir=tmp_path / "c")
        assert str(e.value).startswith(f"{url}: ") and "HTTP 403" in str(e.value)
    finally:
        srv.stop()
    pytest.importorskip("cryptography")
    srv = RangeHTTPServer(tmp_path / "www", tls=self_signed_certificate(tmp_path / "tls"))
    try:
        url = f"{srv.url}/train-0.parquet"
        with pytest.raises(errors.TLSError) as e:
            open_dataset(url, cache_dir=tmp_path / "c")
        assert str(e.value).startswith(f"{url}: TLS with 127.0.0.1:{srv.port} failed (")
    finally:
        srv.stop()
