"""Remote Parquet at its edges, against moto's S3 server: `RangeFile` as a file, the footer's tail fetched
(and refused) exactly, the store's failures named, which folders hold Parquet files, split mixtures named,
explicit columns honoured, and footers that cannot be saved reported."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from builders import jpeg_bytes, jpeg_files, one_line

from dali_fast import open_dataset
from dali_fast.data.remote import errors

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

from dali_fast.data.remote import parquet_index  # noqa: E402 (needs pyarrow)
from dali_fast.data.remote.parquet_index import RangeFile, fetch_tail, holds_parquet, list_parquet  # noqa: E402
from dali_fast.data.remote.store import ShardDownloader  # noqa: E402

BUCKET = "edges"  # moto keeps one store per process: a bucket of this file's own


@pytest.fixture
def s3e(empty_bucket):
    return empty_bucket


def put(server, key: str, body: bytes) -> str:
    server.client.put_object(Bucket=BUCKET, Key=key, Body=body)
    return f"s3://{BUCKET}/{key}"


def so(server) -> dict:
    return {"endpoint_url": server.endpoint}


def downloader(server, url: str) -> ShardDownloader:
    fs, infos = list_parquet(url, so(server))
    return ShardDownloader(infos, so(server), retry_seconds=0.0, timeout=10.0, chunk_bytes=1, fs=fs)


def parquet_bytes(table: pa.Table, tmp_path, name: str = "t.parquet", **kw) -> bytes:
    pq.write_table(table, tmp_path / name, **kw)
    return (tmp_path / name).read_bytes()


def gets(server, key: str) -> tuple[int, int]:
    """(GET requests, body bytes) the server answered for ``key``."""
    k = f"{BUCKET}/{key}"
    return server.counts.gets.get(k, 0), server.counts.bytes.get(k, 0)


# ---------------------------------------------------------------------------------------------- RangeFile


def test_range_file_reads_its_ranges_and_fetches_the_rest():
    asked = []

    def fetch(a: int, b: int) -> bytes:
        asked.append((a, b))
        return f"<{a},{b}>".encode()

    f = RangeFile(10, {2: b"abcd"}, fetch)
    assert f.tell() == 0 and f.size() == 10 and f.readable() and f.seekable() and not f.writable()
    assert f.seek(2) == 2 and bytes(f.read(4)) == b"abcd" and f.tell() == 6
    assert f.seek(-2, 1) == 4 and bytes(f.read(2)) == b"cd"
    assert f.seek(-6, 2) == 4 and f.tell() == 4
    assert f.seek(3) == 3 and bytes(f.read(2)) == b"bc"  # whence 0 by default
    assert f.seek(2) == 2 and bytes(f.read(0)) == b"" and f.tell() == 2
    assert f.seek(4) == 4 and f.read(4) == b"<4,8>"  # past the held range: fetched whole
    assert f.seek(8) == 8 and f.read(5) == b"<8,10>"  # clipped at the end of the file
    assert f.seek(3) == 3 and f.read() == b"<3,10>" and f.tell() == 10
    assert asked == [(4, 8), (8, 10), (3, 10)]
    f.close()
    assert f.closed
    held = RangeFile(10, {2: b"abcd"})
    held.seek(4)
    with pytest.raises(OSError, match=r"^bytes 4\.\.8 of the file were not fetched$"):
        held.read(4)


# ---------------------------------------------------------------------------------------------- the tail


def test_the_tail_is_fetched_exactly_and_a_damaged_one_is_named(s3e, tmp_path, monkeypatch):
    url = put(s3e, "t/short.parquet", b"PAR1abcPAR")
    with pytest.raises(ValueError) as e:
        fetch_tail(downloader(s3e, url), 0)
    assert one_line(e) == f"{url}: 10 bytes: not a Parquet file (too short); check the URL"
    url = put(s3e, "t/twelve.parquet", b"PAR1\0\0\0\0PAR1")  # the shortest tail: an empty footer
    assert fetch_tail(downloader(s3e, url), 0) == b"\0\0\0\0PAR1"
    assert gets(s3e, "t/twelve.parquet") == (1, 12)  # the whole small file in one request
    whole = b"PAR1" + b"z" * 20 + (20).to_bytes(4, "little") + b"PAR1"  # the footer fills all but the magic
    url = put(s3e, "t/whole.parquet", whole)
    assert fetch_tail(downloader(s3e, url), 0) == whole[4:]
    for length, key in ((1 << 24) + 5, "t/huge.parquet"), (100, "t/long.parquet"):  # need = 108 bytes of 108
        url = put(s3e, key, b"PAR1" + b"x" * 96 + length.to_bytes(4, "little") + b"PAR1")
        with pytest.raises(ValueError) as e:
            fetch_tail(downloader(s3e, url), 0)
        assert one_line(e) == f"{url}: a footer of {length + 8} bytes in a file of 108: the file is damaged"
    data = parquet_bytes(pa.table({"x": pa.array(range(50), pa.int64())}), tmp_path)
    need = int.from_bytes(data[-8:-4], "little") + 8
    monkeypatch.setattr(parquet_index, "TAIL_BYTES", need)  # the footer fills the first request exactly
    url = put(s3e, "t/exact.parquet", data)
    assert fetch_tail(downloader(s3e, url), 0) == data[-need:]
    assert gets(s3e, "t/exact.parquet") == (1, need)


def test_the_store_failing_on_the_tail_is_named(s3e, monkeypatch):
    monkeypatch.setattr(parquet_index, "TAIL_BYTES", 100)
    url = put(s3e, "t/a.parquet", b"PAR1" + b"x" * 192 + b"PAR1")  # 200 bytes when listed
    store = downloader(s3e, url)
    put(s3e, "t/a.parquet", b"y" * 150)  # shorter now: half of the tail's range is there
    with pytest.raises(errors.StoreFailedError) as e:
        fetch_tail(store, 0)
    assert one_line(e) == f"{url}: got 50 bytes of 100 asked for at offset 100"
    put(s3e, "t/a.parquet", b"y" * 50)  # none of it is there: the server refuses the range
    with pytest.raises(errors.StoreFailedError) as e:
        fetch_tail(store, 0)
    assert re.fullmatch(rf"{re.escape(url)}: the object store failed \((?!NoneType)\w+: .+\)", one_line(e))
    s3e.client.delete_object(Bucket=BUCKET, Key="t/a.parquet")
    with pytest.raises(FileNotFoundError) as e:
        fetch_tail(store, 0)
    assert not isinstance(e.value, errors.StoreFailedError)
    put(s3e, "t/a.parquet", b"PAR1" + b"x" * 192 + b"PAR1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWS00000")
    s3fs.S3FileSystem.clear_instance_cache()
    store = downloader(s3e, url)
    s3e.check_credentials(True)  # moto checks credentials from now on
    try:
        with pytest.raises(errors.CredentialsRejectedError) as e:
            fetch_tail(store, 0)
    finally:
        s3e.check_credentials(False)
    assert one_line(e) == f"{url}: {errors.CREDENTIALS_REJECTED.format(code='InvalidAccessKeyId')}"


# ---------------------------------------------------------------------------------------------- folders


def test_which_folders_hold_parquet_files(s3e, tmp_path):
    for key in ("X/a.parquet", "X/data/b.parquet", "tars/s.tar", "both/c.parquet", "both/d.tar", "hf/data/e.parquet"):
        put(s3e, key, b"not read")
    o = so(s3e)
    assert holds_parquet(f"s3://{BUCKET}/X", o) and holds_parquet(f"s3://{BUCKET}/X/", o)
    assert holds_parquet(f"s3://{BUCKET}/hf", o)  # a snapshot: its data/ folder
    with pytest.raises(ValueError) as e:  # .tar shards beside them: which is the data set is not guessed
        holds_parquet(f"s3://{BUCKET}/both/", o)
    assert one_line(e) == (
        f"s3://{BUCKET}/both/: holds both WebDataset shards (1 shard: d.tar, ...) and Parquet files (1 file: "
        "c.parquet, ...); a data set is one or the other: move one kind into a folder of its own, or name its "
        "files (a pattern)"
    )
    assert not holds_parquet(f"s3://{BUCKET}/tars", o)
    assert not holds_parquet("s3://nobucket/X", o)  # the listing fails: the shards' reader names why
    assert [i.url for i in list_parquet(f"s3://{BUCKET}/X", o)[1]] == [f"s3://{BUCKET}/X/a.parquet"]
    (tmp_path / "local" / "data").mkdir(parents=True)
    (tmp_path / "local" / "data" / "f.parquet").write_bytes(b"not read")
    assert holds_parquet(f"file://{tmp_path / 'local'}", None)


def test_a_folder_of_several_splits_names_them_with_other_files(s3e):
    for key in ("m/train-00000-of-00001.parquet", "m/test-00000-of-00001.parquet", "m/extra.parquet"):
        put(s3e, key, b"not read")
    with pytest.raises(ValueError) as e:
        list_parquet(f"s3://{BUCKET}/m", so(s3e))
    assert one_line(e) == (
        f"s3://{BUCKET}/m: holds the files of several splits: (other) (1 file), test (1 file), train (1 file); "
        f"open one split with a pattern, e.g. open_dataset('s3://{BUCKET}/m/test-*.parquet')"
    )


def test_a_pattern_or_a_file_is_taken_as_given_whatever_splits_it_names(s3e):
    for key in ("p/train-00000-of-00001.parquet", "p/test-00000-of-00001.parquet", "p/extra.parquet"):
        put(s3e, key, b"not read")
    base = f"s3://{BUCKET}/p"
    for spec, names in (
        (f"{base}/{{train,test}}-00000-of-00001.parquet", ["test", "train"]),
        (f"{base}/*-00000-of-00001.parquet", ["test", "train"]),
        (f"{base}/test-00000-of-00001.parquet", ["test"]),
        (f"{base}/*", ["extra.parquet", "test", "train"]),
        (f"{base}/{{train-00000-of-00001.parquet,test-00000-of-00001.parquet}}", ["test", "train"]),
    ):
        _, infos = list_parquet(spec, so(s3e))
        assert sorted(info.url.rsplit("/", 1)[1].split("-")[0] for info in infos) == names, spec


# ---------------------------------------------------------------------------------------------- the index


def two_columns(tmp_path) -> tuple[list[bytes], list[bytes], list[int], list[int], bytes]:
    images = [jpeg_bytes(20 + i, 12) for i in range(6)]
    thumbs = [jpeg_bytes(8, 8 + i) for i in range(6)]
    labels, other = [i % 2 for i in range(6)], [5 - i for i in range(6)]
    table = pa.table({"image": images, "thumb": thumbs, "label": labels, "other": other})
    return images, thumbs, labels, other, parquet_bytes(table, tmp_path, row_group_size=4)


def test_parquet_is_known_by_the_names_a_url_spells_or_by_a_listing(s3e, tmp_path):
    _, _, labels, _, data = two_columns(tmp_path)
    for key in ("q/a.parquet", "q/b.parquet"):
        put(s3e, key, data)
    base = f"s3://{BUCKET}/q"
    for spec in (f"{base}/{{a,b}}.parquet", f"{base}/{{a.parquet,b.parquet}}", f"{base}/", base):
        r = open_dataset(spec, storage_options=so(s3e), cache_dir=tmp_path / "cache")
        assert type(r).__name__ == "RemoteParquetReader" and r.labels.tolist() == labels * 2, spec


def test_parquet_at_a_url_reads_classes_and_names_what_it_does_not_read_yet(s3e, tmp_path):
    _, _, labels, _, data = two_columns(tmp_path)
    url = put(s3e, "t/a.parquet", data)
    kw = {"storage_options": so(s3e), "cache_dir": tmp_path / "cache"}
    assert open_dataset(url, target="class", **kw).labels.tolist() == labels
    said = (
        f"{url}: multi-hot and float targets of Parquet at a URL are not read yet; copy the files to a local "
        "folder and open that, or pack them (dali-fast pack --target) and open the pack"
    )
    for refused in ({"target": "multihot"}, {"target": "float"}, {"num_classes": 3}):
        with pytest.raises(ValueError) as e:
            open_dataset(url, **refused, **kw)
        assert str(e.value) == said, refused


def test_explicit_image_and_label_columns_are_read(s3e, tmp_path, monkeypatch):
    images, thumbs, labels, other, data = two_columns(tmp_path)
    url = put(s3e, "c/one.parquet", data)
    kw = {"storage_options": so(s3e), "cache_dir": tmp_path / "cache"}
    monkeypatch.setattr(parquet_index, "TAIL_BYTES", 64)  # shorter than the footer: the tail is the footer
    r = open_dataset(url, image_column="thumb", label_column="other", **kw)
    md = pq.ParquetFile(tmp_path / "t.parquet").metadata
    chunks = sum(md.row_group(g).column(3).total_compressed_size for g in range(md.num_row_groups))
    assert gets(s3e, "c/one.parquet")[1] == md.serialized_size + 8 + chunks  # footer and `other`: nothing else
    assert [bytes(r[i][0]) for i in range(6)] == thumbs and r.labels.tolist() == other
    r = open_dataset(url, image_column="image", label_column="label", **kw)
    assert [bytes(r[i][0]) for i in range(6)] == images and r.labels.tolist() == labels


def test_a_file_without_an_image_column_is_named(s3e, tmp_path):
    url = put(s3e, "n/one.parquet", parquet_bytes(pa.table({"label": [1, 2], "text": ["a", "b"]}), tmp_path))
    with pytest.raises(ValueError) as e:
        open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "cache")
    assert one_line(e) == (
        f"{url}: no image column (binary, or struct<bytes: binary, path: string>) among label: int64, "
        "text: string; name it with image_column="
    )


def test_footers_that_cannot_be_saved_are_reported_and_the_data_still_reads(s3e, tmp_path, caplog):
    images, _, labels, _, data = two_columns(tmp_path)
    url = put(s3e, "f/one.parquet", data)
    kw = {"storage_options": so(s3e), "cache_dir": tmp_path / "cache"}
    first = open_dataset(url, **kw)
    footers = first.index_file.with_suffix(".footers.npz")
    footers.unlink()
    footers.mkdir()  # nothing can be written there now
    with caplog.at_level(logging.WARNING, logger="dali_fast.data.remote.parquet_index"):
        r = open_dataset(url, **kw)
    assert [bytes(r[i][0]) for i in range(6)] == images and r.labels.tolist() == labels
    said = [rec.getMessage() for rec in caplog.records if rec.name == "dali_fast.data.remote.parquet_index"]
    assert len(said) == 1
    assert re.fullmatch(rf"cannot save the Parquet footers to {re.escape(str(footers))} \(\[Errno \d+\] .+\)", said[0])


def test_stats_count_the_row_groups_downloaded_and_close_unpins_them(s3e, tmp_path):
    images, _, _, _, data = two_columns(tmp_path)
    url = put(s3e, "s/one.parquet", data)
    r = open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "cache", shuffle_window=2)
    r.schedule(np.arange(6))  # both row groups, pinned until their records are delivered
    assert [bytes(r[i][0]) for i in range(6)] == images
    sizes = sum(int(c.size) for c in r.chunks)
    assert r.stats() == {"downloads": 2, "downloaded_bytes": sizes, "evictions": 0, "pinned": 2, "bad_row_groups": 0}
    r.close()
    assert r.stats()["pinned"] == 0


def test_label_chunks_are_read_one_by_one_when_the_batch_of_ranges_fails(s3e, tmp_path, monkeypatch):
    images, _, labels, _, data = two_columns(tmp_path)
    url = put(s3e, "b/one.parquet", data)
    monkeypatch.setattr(parquet_index, "TAIL_BYTES", 64)

    def refused(self, *a, **kw):
        raise RuntimeError("the batch of ranges failed")

    monkeypatch.setattr(s3fs.S3FileSystem, "cat_ranges", refused)
    r = open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "cache")
    md = pq.ParquetFile(tmp_path / "t.parquet").metadata
    chunks = [md.row_group(g).column(2).total_compressed_size for g in range(md.num_row_groups)]
    tail = 2  # the footer: one request of TAIL_BYTES, one for the rest
    assert gets(s3e, "b/one.parquet") == (tail + len(chunks), md.serialized_size + 8 + sum(chunks))
    assert [bytes(r[i][0]) for i in range(6)] == images and r.labels.tolist() == labels


def test_the_store_failing_on_the_label_chunks_is_named(s3e, tmp_path, monkeypatch):
    _, _, _, _, data = two_columns(tmp_path)
    url = put(s3e, "b/one.parquet", data)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWS00000")
    s3fs.S3FileSystem.clear_instance_cache()
    real = s3fs.S3FileSystem.cat_ranges

    def rejected(self, *a, **kw):
        s3e.check_credentials(True)  # the footer was read: the server refuses these credentials from now on
        return real(self, *a, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "cat_ranges", rejected)
    try:
        with pytest.raises(errors.CredentialsRejectedError) as e:
            open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "cache")
    finally:
        s3e.check_credentials(False)
    assert one_line(e) == f"{url}: {errors.CREDENTIALS_REJECTED.format(code='InvalidAccessKeyId')}"


def test_path_references_at_a_url_are_refused_with_the_fix(s3e, tmp_path):
    """datasets' to_parquet of images made from files: paths of the writer's machine, which a file read from a
    URL cannot open. Refused at open, in one line."""
    datasets = pytest.importorskip("datasets")
    paths = jpeg_files(tmp_path / "imgs", 3)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a"])})
    datasets.Dataset.from_dict({"image": paths, "label": [0] * 3}, features=features).to_parquet(str(tmp_path / "d.parquet"))
    url = put(s3e, "refs/d.parquet", (tmp_path / "d.parquet").read_bytes())
    with pytest.raises(ValueError) as e:
        open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "c")
    assert one_line(e).startswith(
        f"{url}: column 'image' holds 3 images as paths to files (Hugging Face's {{bytes: null, path}}), which a "
        "file read from a URL cannot open; embed the images"
    )


def test_path_references_at_a_url_name_the_file_of_the_first_one(s3e, tmp_path):
    """Two files at one URL: the line names the file that holds the first path reference, whether that
    reference is the first row of the second file or the last row of the first."""
    datasets = pytest.importorskip("datasets")
    paths = jpeg_files(tmp_path / "imgs", 6)
    embedded = [{"bytes": open(p, "rb").read(), "path": None} for p in paths]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a"])})
    for folder, first, second in (
        ("late", embedded[:3], paths[3:]),  # the first reference: row 0 of the second file
        ("early", [*embedded[:2], paths[2]], paths[3:]),  # the last row of the first file
    ):
        for name, images in (("a", first), ("b", second)):
            out = tmp_path / f"{folder}-{name}.parquet"
            datasets.Dataset.from_dict({"image": images, "label": [0] * 3}, features=features).to_parquet(str(out))
            put(s3e, f"{folder}/{name}.parquet", out.read_bytes())
        with pytest.raises(ValueError) as e:
            open_dataset(f"s3://{BUCKET}/{folder}/", storage_options=so(s3e), cache_dir=tmp_path / "c")
        holder = "b" if folder == "late" else "a"
        refs = 3 if folder == "late" else 4
        assert one_line(e).startswith(
            f"s3://{BUCKET}/{folder}/{holder}.parquet: column 'image' holds {refs} images as paths to files"
        ), folder


def test_an_endpoint_lost_while_footers_are_read_is_named_by_its_address(s3e, tmp_path, monkeypatch):
    """The listing worked, then the connection is refused (injected) on the first footer read: the line
    names the endpoint the storage options point at, not the bucket."""
    pq.write_table(pa.table({"image": [jpeg_bytes(8, 8)], "label": [0]}), tmp_path / "d.parquet")
    url = put(s3e, "lost/d.parquet", (tmp_path / "d.parquet").read_bytes())

    def refused(self, path, start, end):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(ShardDownloader, "get_range", refused)
    with pytest.raises(errors.EndpointUnreachableError) as e:
        open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "c")
    endpoint = so(s3e)["endpoint_url"].split("://", 1)[1]
    assert one_line(e).startswith(f"{url}: ") and endpoint in one_line(e) and "connection refused" in one_line(e)


def test_declared_classes_number_the_labels_at_a_url_as_they_do_locally(s3e, tmp_path):
    """A validation split at a URL with the training set's class list: its names are numbered by that list,
    as a local file's are."""
    table = pa.table({"image": [jpeg_bytes(8, 8 + i) for i in range(3)], "label": ["dog", "cat", "dog"]})
    pq.write_table(table, tmp_path / "d.parquet")
    url = put(s3e, "declared/d.parquet", (tmp_path / "d.parquet").read_bytes())
    remote = open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "c", classes=["emu", "dog", "cat"])
    local = open_dataset(tmp_path / "d.parquet", classes=["emu", "dog", "cat"])
    assert remote.classes == local.classes == ["emu", "dog", "cat"]
    assert remote.labels.tolist() == local.labels.tolist() == [1, 2, 1]
    assert open_dataset(url, storage_options=so(s3e), cache_dir=tmp_path / "c").classes == ["cat", "dog"]
