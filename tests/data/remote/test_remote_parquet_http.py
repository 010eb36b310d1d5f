"""Parquet files on a plain web server (``http://``/``https://`` with range requests, a local server here):
read in place as they are over S3, a folder listed from its index page, indexed once, re-indexed when a
file changes, denied and TLS failures named."""

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


def write(folder, rows=ROWS, seed: int = 0, name: str = "train-{k}.parquet") -> list[tuple[bytes, int]]:
    """train-0.parquet, train-1.parquet (``name`` of file ``k`` of ``n``) in ``folder``; the (image, label)
    of every row, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k, n in enumerate(rows):
        images = [jpeg_bytes(20 + seed + 2 * len(out) + i, 16) for i in range(n)]
        labels = [(len(out) + i + seed) % 4 for i in range(n)]
        where = folder / name.format(k=k, n=len(rows))
        pq.write_table(pa.table({"image": images, "label": labels}), where, row_group_size=3)
        out += list(zip(images, labels, strict=True))
    return out


def rows_of(reader) -> list[tuple[bytes, int]]:
    return [(bytes(reader[i][0]), int(reader[i][1])) for i in range(len(reader))]


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


def test_a_folder_at_a_url_is_read_from_its_index_page_as_a_local_folder_is(tmp_path, monkeypatch):
    """A web server lists a folder as an index page of links, and answers the folder named without its
    slash with a 301 to it (``python -m http.server``, nginx's autoindex): either URL opens the folder's
    files as the local folder opens, a Hugging Face snapshot's ``data/`` folder too; a folder holding .tar
    shards beside its Parquet files is refused in one line, as the local one is. The page is asked for at the folder's URL with its slash: no redirect to
    follow (one request less, and a redirect that points elsewhere, as behind a proxy, never taken)."""
    from remote_shards import shard_bytes

    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
    root = tmp_path / "site"
    flat = write(root / "flat")
    snap = write(root / "snap" / "data", seed=9, name="train-{k:05d}-of-{n:05d}.parquet")
    (root / "snap" / "README.md").write_text("a dataset card\n")
    (root / "mixed").mkdir()
    (root / "mixed" / "train-000000.tar").write_bytes(shard_bytes(0, 5)[0])
    write(root / "mixed", rows=(4,), seed=30)
    local = {"flat": rows_of(open_dataset(root / "flat")), "snap": rows_of(open_dataset(root / "snap"))}
    assert local == {"flat": flat, "snap": snap}
    srv = RangeHTTPServer(root)
    try:
        names = {"flat": ["flat/train-0.parquet", "flat/train-1.parquet"]}
        names["snap"] = [f"snap/data/train-{k:05d}-of-00002.parquet" for k in (0, 1)]
        cache = tmp_path / "c"
        for folder in ("flat", "snap"):
            for url in (f"{srv.url}/{folder}/", f"{srv.url}/{folder}"):
                srv.counts.reset()
                r = open_dataset(url, cache_dir=cache)
                assert type(r).__name__ == "RemoteParquetReader", url
                assert r.files == [f"{srv.url}/{name}" for name in names[folder]], url
                assert rows_of(r) == local[folder], url
                assert f"/{folder}" not in srv.redirects, url
        srv.counts.reset()
        again = open_dataset(f"{srv.url}/snap/", cache_dir=cache)
        assert rows_of(again) == snap and srv.gets == {} and srv.bytes_served == {}  # the listing alone: uncounted
        mixed = "holds both WebDataset shards (1 shard: train-000000.tar, ...) and Parquet files (1 file: "
        mixed += "train-0.parquet, ...); a data set is one or the other: move one kind into a folder of its own, "
        mixed += "or name its files (a pattern)"
        for where in (root / "mixed", f"{srv.url}/mixed/", f"{srv.url}/mixed"):  # which is the data set? not guessed
            with pytest.raises(ValueError) as e:
                open_dataset(where, cache_dir=cache)
            assert str(e.value) == f"{where}: {mixed}"
        shard = rows_of(open_dataset(root / "mixed" / "train-000000.tar"))
        r = open_dataset(f"{srv.url}/mixed/train-000000.tar", cache_dir=cache)  # named: read
        assert type(r).__name__ == "RemoteShardsReader" and rows_of(r) == shard and len(shard) == 5
        r.close()
    finally:
        srv.stop()


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


def test_a_server_that_hangs_on_a_footer_is_abandoned_after_the_timeout(tmp_path):
    """Indexing reads each file's footer by a range request: one the server holds for 8 s, with
    ``timeout=1``, is given up and named, not waited out."""
    write(tmp_path / "www")
    srv = RangeHTTPServer(tmp_path / "www")
    srv.stall("train-1.parquet", 8.0)  # its first GET: the footer's range
    try:
        with pytest.raises(errors.RemoteDataError) as e:
            open_dataset(f"{srv.url}/", cache_dir=tmp_path / "c", timeout=1.0)
        assert str(e.value).startswith(f"{srv.url}/train-1.parquet: the object store failed (FSTimeoutError")
    finally:
        srv.unstall()
        srv.stop()
