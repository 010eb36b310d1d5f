"""A damaged shard (truncated, or cut inside a header) is said as what is known of it: where the file ends,
and that the samples after that are lost. It is never counted as one sample left out, which would
understate the loss; samples left out for their own reasons stay in ``skipped``. Local and remote shards."""

from __future__ import annotations

import io
import logging
import tarfile
from pathlib import Path

import pytest
from builders import jpeg_bytes

from dali_fast import open_dataset
from dali_fast.data.webdataset import WebDatasetReader
from dali_fast.tools.inspect import inspect_dataset

wds = pytest.importorskip("webdataset")

SAMPLES = 60


def shard(path: Path, count: int = SAMPLES) -> bytes:
    """A WebDataset shard of ``count`` samples ``s000`` ... (label: the number mod 3); returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for i in range(count):
            sink.write({"__key__": f"s{i:03d}", "jpg": jpeg_bytes(30 + i % 9, 20 + i % 5), "cls": str(i % 3).encode()})
    return path.read_bytes()


def members(blob: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        return [m for m in tf if m.isfile()]


def whole_samples(blob: bytes, cut: int) -> list[str]:
    """The keys whose every member lies before byte ``cut``: the samples a cut there leaves."""
    ends: dict[str, int] = {}
    for m in members(blob):
        key = m.name.split(".")[0]
        ends[key] = max(ends.get(key, 0), m.offset_data + m.size)
    return [k for k, end in ends.items() if end <= cut]


def keys(reader) -> list[str]:
    return [reader.source(i).rsplit(":", 1)[1].split(".")[0] for i in range(len(reader))]


def test_a_shard_cut_to_half_says_it_is_truncated_and_where_never_one_sample_left_out(tmp_path, cache, caplog):
    path = tmp_path / "train-000000.tar"
    blob = shard(path)
    path.write_bytes(blob[: len(blob) // 2])
    with caplog.at_level(logging.WARNING):
        r = WebDatasetReader(path)
    kept = whole_samples(blob, len(blob) // 2)
    assert keys(r) == kept and 25 <= len(kept) <= 35  # about half of the 60 samples are lost
    assert r.skipped == []  # no sample was left out for a reason of its own
    [(where, what)] = r.damaged
    assert where == str(path) and what.startswith("truncated: the file ends inside ")
    assert what.endswith("any samples after it are lost")
    [warning] = [m for m in caplog.messages if "damaged" in m]
    assert warning.startswith("1 of 1 shard damaged; the samples lost with it cannot be counted (first: ")
    assert f"{path}: {what}" in warning and not any("left out" in m for m in caplog.messages)
    lines: list[str] = []
    assert inspect_dataset(str(path), emit=lines.append) == 0
    assert f"damaged:  {path}: {what}" in lines and not any(x.startswith("skipped:") for x in lines)
    assert f"records:  {len(kept)}" in lines


def _cuts(blob: bytes) -> dict[str, tuple[int, str | None]]:
    """Where to cut the shard, and what the reader must then say of it (None: nothing is lost)."""
    ms = members(blob)
    m30 = next(m for m in ms if m.name == "s030.jpg")
    before = ms[ms.index(m30) - 1].name  # s030.cls
    padded_end = ms[-1].offset_data + -(-ms[-1].size // 512) * 512
    boundary = m30.offset_data + -(-m30.size // 512) * 512  # after s030.jpg and its padding: the next header
    after_boundary = ms[ms.index(m30) + 1]
    return {
        "inside a member": (
            m30.offset_data + 10,
            f"truncated: the file ends inside member s030.jpg (at byte {m30.offset_data + 10} of the "
            f"{m30.offset_data + m30.size} it needs); that sample and any after it are lost",
        ),
        "inside a header": (
            after_boundary.offset + 100,
            "truncated: the file ends inside a member's header after member s030.jpg; any samples after it are lost",
        ),
        "at a member's end": (
            boundary,
            "truncated: no end-of-archive blocks after member s030.jpg; any samples after it are lost",
        ),
        "in the end-of-archive blocks": (padded_end + 700, None),
        "damaged header": (
            -1,
            f"damaged: no tar header at byte {m30.offset} after member {before}; any samples after it are lost",
        ),
    }


@pytest.mark.parametrize(
    "where",
    ["inside a member", "inside a header", "at a member's end", "in the end-of-archive blocks", "damaged header"],
)
def test_each_kind_of_damage_is_said_and_the_whole_samples_before_it_are_kept(tmp_path, cache, where):
    path = tmp_path / "a.tar"
    blob = shard(path)
    cut, said = _cuts(blob)[where]
    if cut == -1:  # the header of s030.jpg overwritten with text: the walk cannot go on
        at = next(m for m in members(blob) if m.name == "s030.jpg").offset
        damaged = blob[:at] + b"not a header".ljust(512, b"!") + blob[at + 512 :]
        path.write_bytes(damaged)
        kept = [f"s{i:03d}" for i in range(30)]
    else:
        path.write_bytes(blob[:cut])
        kept = whole_samples(blob, cut)
    r = WebDatasetReader(path)
    assert keys(r) == kept and r.skipped == []
    assert r.damaged == ([] if said is None else [(str(path), said)])
    if said is not None:
        with pytest.raises(ValueError) as e:
            WebDatasetReader(path, on_error="raise")
        assert str(e.value) == f"{path}: {said}; fix the shard, or open it with on_error='skip'"


def test_a_sample_left_out_for_itself_stays_a_sample_beside_a_damaged_shard(tmp_path, cache):
    good, cut = tmp_path / "s" / "a.tar", tmp_path / "s" / "b.tar"
    shard(cut, 10)
    cut.write_bytes(cut.read_bytes()[:3000])
    with wds.TarWriter(str(good)) as sink:
        sink.write({"__key__": "x0", "jpg": jpeg_bytes(), "cls": b"0"})
        sink.write({"__key__": "x1", "jpg": jpeg_bytes()})  # no label: left out, as itself
    r = open_dataset(tmp_path / "s")
    assert r.skipped == [(f"{good}:x1", "no label (.cls, or .json with the label key)")]
    assert [w for w, _ in r.damaged] == [str(cut)]
    again = open_dataset(tmp_path / "s")  # from the saved index: the same lists
    assert again.skipped == r.skipped and again.damaged == r.damaged


def test_pack_reports_a_damaged_shard_apart_from_the_records_it_left_out(tmp_path, cache, caplog):
    from dali_fast import pack

    path = tmp_path / "s" / "train-000000.tar"
    blob = shard(path, 20)
    path.write_bytes(blob[: len(blob) // 2])
    with caplog.at_level(logging.WARNING):
        report = pack(str(path), tmp_path / "packed", progress=False)
    assert report.records == len(whole_samples(blob, len(blob) // 2)) and report.skipped == []
    assert [w for w, _ in report.damaged] == [str(path)]
    assert report.summary().endswith("left out 0; 1 damaged shard (the samples they lost are not counted)")
    assert f"damaged shard {path}: {report.damaged[0][1]}" in caplog.messages


# --------------------------------------------------------------------------------------------- remote


def test_a_truncated_remote_shard_is_a_damaged_shard_not_a_sample(tmp_path, monkeypatch, caplog):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import s3fs
    from object_store import S3Server

    s3fs.S3FileSystem.clear_instance_cache()  # one of another test's endpoint would be reused
    server = S3Server()
    try:
        server.client.create_bucket(Bucket="damaged")  # moto keeps one store per process: a bucket of its own
        whole = shard(tmp_path / "whole.tar")
        half = shard(tmp_path / "other.tar", 8)
        server.client.put_object(Bucket="damaged", Key="train-000000.tar", Body=whole[: len(whole) // 2])
        server.client.put_object(Bucket="damaged", Key="train-000001.tar", Body=half)
        monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
        spec = "s3://damaged/train-{000000..000001}.tar"
        kw = {"storage_options": {"endpoint_url": server.endpoint}}
        with caplog.at_level(logging.WARNING):
            r = open_dataset(spec, **kw)
        kept = whole_samples(whole, len(whole) // 2)
        assert len(r) == len(kept) + 8 and r.skipped == []
        [(where, what)] = r.damaged
        assert where == "s3://damaged/train-000000.tar" and what.startswith("truncated: the file ends inside ")
        assert any(
            m.startswith("1 of 2 remote shards damaged; the samples lost with it cannot be") for m in caplog.messages
        )
        again = open_dataset(spec, **kw)  # from the saved index
        assert again.damaged == r.damaged and again.skipped == []
        with pytest.raises(ValueError) as e:
            open_dataset(spec, on_error="raise", **kw)
        assert str(e.value) == f"{where}: {what}; fix the shard, or open it with on_error='skip'"
        lines: list[str] = []
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        assert inspect_dataset(spec, emit=lines.append) == 0
        assert f"damaged:  {where}: {what}" in lines and not any(x.startswith("skipped:") for x in lines)
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
