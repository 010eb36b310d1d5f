"""Parquet files in object storage, against moto's S3 server: the Hugging Face layout written by pyarrow
here, uploaded, and read back exactly as the same local files read; the index from the footers alone,
reused with no byte of a row read, indexed again when a file changes; row groups through the shard cache;
both loaders on 2 ranks over 2 epochs, resume, bad rows named by URL; the store's errors named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import hf_table, jpeg_bytes, one_line, png_bytes
from contract import each_once, run_save_load_state

from dali_fast import open_dataset
from dali_fast.data.remote import errors

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

from dali_fast.data.parquet import ParquetReader  # noqa: E402 (needs pyarrow)
from dali_fast.data.remote import parquet_index  # noqa: E402
from dali_fast.data.remote.parquet import RemoteParquetReader  # noqa: E402

BUCKET = "parquet"  # moto keeps one store per process: a bucket of this file's own
NAMES = ["cat", "dog", "emu", "fox"]
FILES, PER_FILE, GROUP = 3, 7, 3  # 21 rows: 3 files of 7 rows, row groups of 3, 3 and 1
N = FILES * PER_FILE
SPEC = f"s3://{BUCKET}/data/train-*.parquet"


def sample(i: int) -> bytes:
    return png_bytes(20 + i, 10 + i % 7, "RGB") if i % 5 == 0 else jpeg_bytes(30 + i, 20 + i % 7)


def upload(server, local: Path, *, bad: dict | None = None, split: str = "train") -> list[tuple[bytes, int]]:
    """``local/data/{split}-0000k-of-00003.parquet``, written and put under ``data/`` in the bucket; ``bad``:
    {row: (image, label)} overrides. Returns (image, label) of every row, in order."""
    (local / "data").mkdir(parents=True, exist_ok=True)
    rows = [(sample(i), i % 4) for i in range(N)]
    for i, row in (bad or {}).items():
        rows[i] = row
    for k in range(FILES):
        part = rows[k * PER_FILE : (k + 1) * PER_FILE]
        name = f"data/{split}-{k:05d}-of-{FILES:05d}.parquet"
        pq.write_table(hf_table([r[0] for r in part], [r[1] for r in part], NAMES), local / name, row_group_size=GROUP)
        server.client.put_object(Bucket=BUCKET, Key=name, Body=(local / name).read_bytes())
    return rows


@pytest.fixture
def s3pq(empty_bucket):
    return empty_bucket


def opts(server, tmp_path: Path, cache: str = "cache", **kw) -> dict:
    return {"storage_options": {"endpoint_url": server.endpoint}, "cache_dir": tmp_path / cache, **kw}


def served(server) -> dict[str, int]:
    return {k.split("/", 1)[1]: v for k, v in server.bytes_served.items()}


# --------------------------------------------------------------------------------------------- open


def test_every_row_reads_back_exactly_as_the_local_files_with_classes_and_sources(s3pq, tmp_path):
    rows = upload(s3pq, tmp_path / "local")
    local = ParquetReader(tmp_path / "local" / "data" / "train-*.parquet")
    r = open_dataset(SPEC, **opts(s3pq, tmp_path))
    assert isinstance(r, RemoteParquetReader) and r.streaming and len(r) == N and r.classes == NAMES
    assert r.group_rows.tolist() == local.group_rows.tolist() == [3, 3, 1] * 3
    assert r.labels.tolist() == local.labels.tolist() == [label for _, label in rows]
    for i in range(N):
        data, label = r[i]
        assert bytes(data) == bytes(local[i][0]) == rows[i][0] and label == rows[i][1]
    assert r.source(0) == f"s3://{BUCKET}/data/train-00000-of-00003.parquet:0"
    assert r.source(9) == f"s3://{BUCKET}/data/train-00001-of-00003.parquet:2"
    assert r.source(-1) == f"s3://{BUCKET}/data/train-00002-of-00003.parquet:6"
    datas, labels, bad = r.read_batch_checked([20, 0, 7, 7, 13, -1])
    assert bad == {} and [bytes(d) for d in datas] == [rows[i][0] for i in (20, 0, 7, 7, 13, 20)]
    assert labels.tolist() == [rows[i][1] for i in (20, 0, 7, 7, 13, 20)]
    with pytest.raises(IndexError, match="record 21 out of range for a data set of 21 records"):
        r.read_batch_checked([0, 21])
    for spec in (
        f"s3://{BUCKET}/",  # a snapshot's root: its data/ folder
        f"s3://{BUCKET}/data",
        f"s3://{BUCKET}/data/train-{{00000..00002}}-of-00003.parquet",
    ):
        same = open_dataset(spec, **opts(s3pq, tmp_path))
        assert isinstance(same, RemoteParquetReader) and same.fingerprint == r.fingerprint
        assert bytes(same[20][0]) == rows[20][0]
    one = open_dataset(f"s3://{BUCKET}/data/train-00001-of-00003.parquet", **opts(s3pq, tmp_path))
    assert len(one) == 7 and one.classes == NAMES and bytes(one[0][0]) == rows[7][0]
    assert one.fingerprint != r.fingerprint and r.fingerprint.startswith("remote-parquet:21:")


def test_the_index_comes_from_the_footers_and_is_reused_with_no_row_read(s3pq, tmp_path, monkeypatch):
    rows = upload(s3pq, tmp_path / "local")
    monkeypatch.setattr(parquet_index, "TAIL_BYTES", 64)  # shorter than any footer: the second request too
    expected = {}
    for k in range(FILES):
        name = f"data/train-{k:05d}-of-00003.parquet"
        md = pq.ParquetFile(tmp_path / "local" / name).metadata
        footer = md.serialized_size + 8
        chunks = [
            [md.row_group(g).column(j).total_compressed_size for g in range(md.num_row_groups)] for j in (0, 2)
        ]  # image.bytes, label
        expected[name] = footer + sum(chunks[1])
        assert expected[name] + sum(chunks[0]) <= (tmp_path / "local" / name).stat().st_size
    r = open_dataset(SPEC, **opts(s3pq, tmp_path))
    assert served(s3pq) == expected  # the footers and the label chunks, not one image byte
    assert r.stats()["downloads"] == 0
    s3pq.counts.reset()
    again = open_dataset(SPEC, **opts(s3pq, tmp_path))  # a second open: the saved index and footers
    assert served(s3pq) == {} and again.fingerprint == r.fingerprint and again.index_file == r.index_file
    assert [bytes(again[i][0]) for i in range(N)] == [image for image, _ in rows]
    images = {k: sum(c.size for c in again.chunks if c.url.startswith(f"s3://{BUCKET}/{k}#")) for k in expected}
    assert served(s3pq) == images  # each row group's image column, once, and nothing else


def test_a_file_changed_on_the_server_is_indexed_again_and_never_read_with_the_old_index(s3pq, tmp_path):
    upload(s3pq, tmp_path / "local")
    before = open_dataset(SPEC, **opts(s3pq, tmp_path))
    assert before.labels.tolist()[:7] == [i % 4 for i in range(7)]
    changed = hf_table([sample(100 + i) for i in range(5)], [3] * 5, NAMES)  # another file: 5 rows, all "fox"
    name = "data/train-00000-of-00003.parquet"
    pq.write_table(changed, tmp_path / "changed.parquet", row_group_size=2)
    s3pq.client.put_object(Bucket=BUCKET, Key=name, Body=(tmp_path / "changed.parquet").read_bytes())
    after = open_dataset(SPEC, **opts(s3pq, tmp_path))
    assert len(after) == N - 2 and after.labels.tolist()[:5] == [3] * 5 and after.index_file != before.index_file
    assert [bytes(after[i][0]) for i in range(5)] == [sample(100 + i) for i in range(5)]
    assert after.fingerprint != before.fingerprint
    _, _, bad = before.read_batch_checked([0, 8])  # opened before the change: its row group is refused
    assert list(bad) == [0] and bad[0].startswith(f"unreadable: row group 0 of s3://{BUCKET}/{name}: ")
    assert "changed on the server" in bad[0]


def test_open_errors_name_the_url(s3pq, tmp_path):
    upload(s3pq, tmp_path / "local")
    upload(s3pq, tmp_path / "local", split="test")
    with pytest.raises(ValueError) as e:
        open_dataset(f"s3://{BUCKET}/data/", **opts(s3pq, tmp_path))
    assert one_line(e) == (
        f"s3://{BUCKET}/data/: holds the files of several splits: test (3 files), train (3 files); open one split "
        f"with a pattern, e.g. open_dataset('s3://{BUCKET}/data/test-*.parquet')"
    )
    with pytest.raises(errors.NoSuchShardError) as e:
        open_dataset(f"s3://{BUCKET}/data/val-*.parquet", **opts(s3pq, tmp_path))
    assert (
        one_line(e) == f"s3://{BUCKET}/data/val-*.parquet: the pattern matches no object on the server; check the URL"
    )
    with pytest.raises(errors.NoSuchShardError) as e:
        open_dataset(f"s3://{BUCKET}/data/train-{{00002..00004}}-of-00003.parquet", **opts(s3pq, tmp_path))
    assert one_line(e) == f"s3://{BUCKET}/data/train-00003-of-00003.parquet and 1 more: {errors.NO_SHARD}"
    s3pq.client.put_object(Bucket=BUCKET, Key="other/x.parquet", Body=b"not parquet, just text: PAR")
    with pytest.raises(ValueError) as e:
        open_dataset(f"s3://{BUCKET}/other/x.parquet", **opts(s3pq, tmp_path))
    assert (
        one_line(e) == f"s3://{BUCKET}/other/x.parquet: not a Parquet file (it does not end with PAR1); check the URL"
    )
    with pytest.raises(ValueError) as e:
        open_dataset(SPEC, **opts(s3pq, tmp_path, cache_limit=1000, shuffle_window=2))
    assert one_line(e).startswith("cache_limit=1000: too small for 1 rank(s) on this node each reading shuffle")


def test_a_missing_bucket_and_rejected_credentials_are_named(s3pq, tmp_path, monkeypatch):
    for url in ("s3://nobucket/data/train-*.parquet", "s3://nobucket/train-00000-of-00001.parquet"):
        with pytest.raises(errors.NoSuchBucketError) as e:
            open_dataset(url, **opts(s3pq, tmp_path))
        assert one_line(e) == f"{url}: {errors.NO_BUCKET.format(bucket='nobucket')}"
    upload(s3pq, tmp_path / "local")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWS00000")
    s3fs.S3FileSystem.clear_instance_cache()
    s3pq.check_credentials(True)  # moto checks credentials from now on
    try:
        with pytest.raises(errors.CredentialsRejectedError) as e:
            open_dataset(SPEC, **opts(s3pq, tmp_path))
    finally:
        s3pq.check_credentials(False)
    assert one_line(e) == f"{SPEC}: {errors.CREDENTIALS_REJECTED.format(code='InvalidAccessKeyId')}"


# --------------------------------------------------------------------------------------------- loaders


def loader_class(backend: str) -> tuple[type, dict]:
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return DALIIterator, {"num_threads": 2}
    from dali_fast import TorchIterator

    return TorchIterator, {"num_workers": 2}


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_two_ranks_two_epochs_each_row_once_each_row_group_fetched_once_and_resume(s3pq, tmp_path, backend):
    cls, kw = loader_class(backend)
    upload(s3pq, tmp_path / "local")
    r = open_dataset(SPEC, **opts(s3pq, tmp_path, shuffle_window=2))
    per_object = {k: v for k, v in served(s3pq).items()}  # the open's footers and labels
    for epoch in (0, 1):
        seen, batches = [], []
        for rank in (0, 1):
            x = cls(r, 4, image_size=16, device="cpu", seed=3, rank=rank, world_size=2, **kw)
            assert type(x.order).__name__ == "StreamingOrder"
            x.set_epoch(epoch)
            n = 0
            for _, labels in x:
                seen += x.last_indices.tolist()
                assert labels.tolist() == [r.labels[i] for i in x.last_indices.tolist()]
                n += 1
            batches.append(n)
            x.close()
        assert batches[0] == batches[1] == 3  # 11 rows a rank (one padded), in batches of 4
        each_once(seen, range(N), padding=1, what=f"epoch {epoch}")
    images = {k: sum(c.size for c in r.chunks if c.url.startswith(f"s3://{BUCKET}/{k}#")) for k in per_object}
    assert served(s3pq) == {k: per_object[k] + images[k] for k in per_object}  # one download per row group
    run_save_load_state(lambda: cls(r, 4, image_size=16, device="cpu", seed=3, **kw), midpoint=2)


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_bad_rows_are_named_by_url_or_skipped_and_counted(s3pq, tmp_path, backend, caplog):
    cls, kw = loader_class(backend)
    bad = {2: (b"not an image at all", 1), 4: (None, 2), 8: (sample(8), None)}
    upload(s3pq, tmp_path / "local", bad=bad)
    r = open_dataset(SPEC, **opts(s3pq, tmp_path))
    _, _, reasons = r.read_batch_checked([2, 4, 8, 9])
    assert reasons == {0: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)", 1: "null image", 2: "null label"}
    f0 = f"s3://{BUCKET}/data/train-00000-of-00003.parquet"
    x = cls(r, 21, image_size=16, device="cpu", train=False, **kw)
    with pytest.raises(ValueError, match=rf"record 2 \({f0}:2\).*not an image \(unknown signature"):
        next(iter(x))
    x.close()
    y = cls(r, 5, image_size=16, device="cpu", train=False, on_error="skip", **kw)
    delivered = [label for _, labels in y for label in labels.tolist()]
    assert y.skipped == 3 and sorted(delivered) == sorted(int(r.labels[i]) for i in range(N) if i not in bad)
    assert f"{f0}:2" in caplog.text
    y.close()


def test_pack_inspect_train_and_bench_take_the_url(s3pq, tmp_path, capsys):
    from dali_fast.cli import main
    from dali_fast.data.packed import MemmapReader

    rows = upload(s3pq, tmp_path / "local")
    flags = ["--storage-option", f"endpoint_url={s3pq.endpoint}", "--cache-dir", str(tmp_path / "c")]
    assert main(["inspect", SPEC, *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    files = ", ".join(f"train-0000{k}-of-00003.parquet" for k in range(3))
    assert out[:4] == [
        f"data set: {SPEC} (RemoteParquetReader)",
        "records:  21",
        "classes:  4 (cat, dog, emu, fox)",
        f"parquet:  3 files ({files}), 9 row groups, columns image (image.bytes) and label",
    ]
    assert main(["pack", SPEC, str(tmp_path / "packed"), *flags]) == 0
    packed = MemmapReader(tmp_path / "packed")
    assert packed.classes == NAMES and [(bytes(packed[i][0]), packed[i][1]) for i in range(N)] == rows
    assert packed.source(3) == f"s3://{BUCKET}/data/train-00000-of-00003.parquet:3"
    common = [SPEC, *flags, "--batch-size", "4", "--image-size", "16"]
    record = tmp_path / "indices.jsonl"
    argv = ["train", *common, "--loader", "torch", "--model", "resnet_tiny", "--epochs", "1", "--out", str(tmp_path)]
    assert main([*argv, "--record-indices", str(record)]) == 0
    seen = [i for line in record.read_text().splitlines() for i in json.loads(line)["indices"]]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 12  # 15 of 21 trained on (2 row groups of 3 held out)
    out = tmp_path / "bench"
    assert main(["bench", *common, "--loaders", "torch", "--epochs", "1", "--no-limit", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["rows"][0]["images_per_epoch"] == N and result["settings"]["dataset"] == SPEC


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_lightning_datamodule_takes_the_url(s3pq, tmp_path, backend, monkeypatch):
    pytest.importorskip("pytorch_lightning")
    loader_class(backend)
    from dali_fast.lightning import DaliFastDataModule

    upload(s3pq, tmp_path / "local")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3pq.endpoint)  # the module opens paths with no options
    dm = DaliFastDataModule(train=SPEC, batch_size=4, image_size=16, device="cpu", backend=backend)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.dataset, RemoteParquetReader)
    each_once([i for _ in loader for i in loader.last_indices.tolist()], range(N), padding=0)
