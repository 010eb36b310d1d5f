"""WebDataset shards read in place: written by the webdataset package's own TarWriter, read back exactly."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import jpeg_bytes, png_bytes

from dali_fast import open_dataset, pack
from dali_fast.webdataset import WebDatasetReader, expand_shards, scan_tar

wds = pytest.importorskip("webdataset")
N_SHARDS, PER_SHARD = 3, 7


def write_shards(root: Path, *, label: str = "cls", extra: dict | None = None) -> list[tuple[bytes, int]]:
    """Shards root/train-000000.tar ...; returns (image bytes, label) of every sample in order."""
    root.mkdir(parents=True, exist_ok=True)
    samples = []
    for s in range(N_SHARDS):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar")) as sink:
            for k in range(PER_SHARD):
                i = s * PER_SHARD + k
                image = png_bytes(20 + i, 10 + k, "RGB") if i % 5 == 0 else jpeg_bytes(30 + i, 20 + k)
                lab = i % 4
                sample = {"__key__": f"sample{i:05d}", "jpg" if i % 5 else "png": image}
                if label == "cls":
                    sample["cls"] = str(lab).encode()
                else:
                    sample["json"] = json.dumps({"label": lab, "caption": f"image {i}"}).encode()
                sample.update((extra or {}).get(i, {}))
                sink.write(sample)
                samples.append((image, lab))
    return samples


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("label", ["cls", "json"])
def test_every_sample_reads_back_exactly(tmp_path, cache, label):
    samples = write_shards(tmp_path / "shards", label=label)
    r = open_dataset(str(tmp_path / "shards" / "train-{000000..000002}.tar"))
    assert isinstance(r, WebDatasetReader) and len(r) == len(samples) == 21
    for i, (image, lab) in enumerate(samples):
        data, got = r[i]
        assert bytes(data) == image and got == lab
        assert not data.flags.owndata and not data.flags.writeable  # a view into the mapped shard
    assert r.source(0) == f"{tmp_path / 'shards' / 'train-000000.tar'}:sample00000.png"  # sample 0 is a PNG
    assert r.source(8) == f"{tmp_path / 'shards' / 'train-000001.tar'}:sample00008.jpg"
    assert r.classes == ["0", "1", "2", "3"] and r.labels.tolist() == [lab for _, lab in samples]
    same = open_dataset(tmp_path / "shards")  # a folder of shards
    assert len(same) == 21 and bytes(same[20][0]) == samples[20][0]


def test_second_open_uses_the_saved_index(tmp_path, cache, monkeypatch):
    write_shards(tmp_path / "shards")
    first = WebDatasetReader(tmp_path / "shards")
    assert first.index_file.is_file() and first.index_file.parent == cache / "wds-index"
    import dali_fast.webdataset as w

    monkeypatch.setattr(w, "scan_tar", lambda p: pytest.fail("scanned again"))
    again = WebDatasetReader(tmp_path / "shards")
    assert len(again) == 21 and bytes(again[5][0]) == bytes(first[5][0]) and again.source(5) == first.source(5)
    (tmp_path / "shards" / "train-000001.tar").touch()  # a changed shard: a new index
    monkeypatch.undo()
    assert WebDatasetReader(tmp_path / "shards").index_file != first.index_file


def test_compressed_shards_are_refused_with_what_to_do(tmp_path, cache):
    write_shards(tmp_path / "shards")
    gz = tmp_path / "shards" / "train-000000.tar.gz"
    gz.write_bytes(gzip.compress((tmp_path / "shards" / "train-000000.tar").read_bytes()))
    with pytest.raises(ValueError) as e:
        open_dataset(gz)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{gz}: a compressed tar has no random access") and "gunzip" in msg


def test_missing_labels_other_members_and_a_truncated_shard_are_counted_or_named(tmp_path, cache):
    extra = {3: {"cls": None}, 4: {"txt": b"a caption"}, 9: {"txt": b"x"}}
    root = tmp_path / "shards"
    root.mkdir()
    samples = []
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(10):
            image = jpeg_bytes(30 + i, 20)
            sample = {"__key__": f"s{i}", "jpg": image, **{k: v for k, v in extra.get(i, {}).items() if v is not None}}
            if i != 3:
                sample["cls"] = b"1"
            sink.write(sample)
            samples.append(image)
    with wds.TarWriter(str(root / "b.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"t{i}", "jpg": jpeg_bytes(40, 30 + i), "cls": b"2"})
    blob = (root / "b.tar").read_bytes()
    _, last_offset, last_size = scan_tar(root / "b.tar")[0][-1]
    (root / "b.tar").write_bytes(blob[: last_offset + last_size // 2])  # cut in the middle of the last image
    r = WebDatasetReader(root)
    assert len(r) == 9 + 3  # a.tar: all but the unlabelled s3; b.tar: the three whole samples
    where = dict(r.skipped)
    assert where[f"{root / 'a.tar'}:s3"] == "no label (.cls, or .json with the label key)"
    assert where[str(root / "b.tar")] == "truncated: member t3.jpg runs past the end"
    assert r.ignored == Counter({"txt": 2})
    assert [bytes(r[i][0]) for i in range(9)] == [samples[i] for i in range(10) if i != 3]
    with pytest.raises(ValueError) as e:
        WebDatasetReader(root / "a.tar", on_error="raise")
    assert str(e.value).startswith(f"{root / 'a.tar'}:s3: no label") and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        WebDatasetReader(root / "b.tar", on_error="raise")
    assert str(e.value).startswith(f"{root / 'b.tar'}: truncated")


def test_json_labels_under_another_key(tmp_path, cache):
    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"k{i}", "jpg": jpeg_bytes(), "json": json.dumps({"class_id": i + 5}).encode()})
    assert WebDatasetReader(root, label_key="class_id").labels.tolist() == [5, 6, 7]
    assert open_dataset(root, label_key="class_id").labels.tolist() == [5, 6, 7]  # open_dataset passes it on
    with pytest.raises(ValueError, match="no samples with an image and a label"):
        WebDatasetReader(root)  # the default key "label" is not there: every sample is left out, and said


def test_brace_patterns_and_missing_shards(tmp_path):
    for name in ("x-000.tar", "x-001.tar", "y-000.tar"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in expand_shards(str(tmp_path / "x-{000..001}.tar"))] == ["x-000.tar", "x-001.tar"]
    assert [p.name for p in expand_shards(str(tmp_path / "{x,y}-000.tar"))] == ["x-000.tar", "y-000.tar"]
    with pytest.raises(FileNotFoundError) as e:
        expand_shards(str(tmp_path / "x-{000..003}.tar"))
    assert str(e.value) == f"{tmp_path / 'x-002.tar'} and 1 more: no such shard"


def test_scan_tar_reads_member_offsets(tmp_path):
    import tarfile

    write_shards(tmp_path / "s")
    path = tmp_path / "s" / "train-000001.tar"
    ours = scan_tar(path)
    with tarfile.open(path) as tf:
        theirs = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
    assert ours == (theirs, None)


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_loaders_exactly_once_and_resume_on_shards(tmp_path, cache, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator as cls

        kw = {"num_threads": 2}
    else:
        from dali_fast import TorchIterator as cls

        kw = {"num_workers": 2}
    write_shards(tmp_path / "shards")
    r = open_dataset(tmp_path / "shards")
    ids = {bytes(r[i][0]): i for i in range(len(r))}

    def make():
        return cls(r, 4, image_size=16, device="cpu", seed=3, cache_bytes=10**6, **kw)

    def indices(loader, epoch, limit=None):
        loader.set_epoch(epoch)
        out = []
        for k, _ in enumerate(loader):
            out += loader.last_indices.tolist()
            if limit is not None and k + 1 == limit:
                break
        return out

    loader = make()
    for epoch in range(2):
        assert sorted(indices(loader, epoch)) == list(range(21))
    seen = indices(loader, 2, limit=2)
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = indices(resumed, 2)
    assert sorted(seen + rest) == list(range(21)) and len(ids) == 21


def test_pack_converts_shards_to_a_packed_set(tmp_path, cache):
    samples = write_shards(tmp_path / "shards", label="json")
    report = pack(
        str(tmp_path / "shards" / "train-{000000..000002}.tar"), tmp_path / "packed", workers=2, progress=False
    )
    p = open_dataset(tmp_path / "packed")
    assert report.records == 21 and p.classes == ["0", "1", "2", "3"]
    assert [(bytes(p[i][0]), p[i][1]) for i in range(21)] == samples
    assert p.source(3).endswith("train-000000.tar:sample00003.jpg")


def test_inspect_on_every_kind_of_data_set(tmp_path, cache, capsys):
    from dali_fast.cli import main
    from dali_fast.synthetic import make_synthetic

    write_shards(tmp_path / "shards")
    make_synthetic(tmp_path / "folder", images=6, classes=2, progress=False)
    pack(tmp_path / "folder", tmp_path / "packed", progress=False)
    for path, kind, n in (
        ("shards", "WebDatasetReader", 21),
        ("folder", "ImageFolderReader", 6),
        ("packed", "MemmapReader", 6),
    ):
        assert main(["inspect", str(tmp_path / path)]) == 0
        out = capsys.readouterr().out
        assert f"({kind})" in out and f"records:  {n}" in out


def test_reader_pickles_for_workers(tmp_path, cache):
    import pickle

    write_shards(tmp_path / "shards")
    r = WebDatasetReader(tmp_path / "shards")
    _ = r[3]
    back = pickle.loads(pickle.dumps(r))
    assert bytes(back[3][0]) == bytes(r[3][0]) and np.array_equal(back.labels, r.labels)


def test_pack_names_a_bad_member_by_shard_and_key(tmp_path, cache):
    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(3):
            image = jpeg_bytes()[:200] if i == 1 else jpeg_bytes()  # sample 1: cut off inside its headers
            sink.write({"__key__": f"k{i}", "jpg": image, "cls": b"0"})
    report = pack(str(root / "a.tar"), tmp_path / "packed", progress=False)
    assert report.records == 2
    assert report.skipped == [(f"{root / 'a.tar'}:k1.jpg", "undecodable: OSError: Truncated File Read")]


def test_batch_reads_are_exact_parallel_and_name_bad_members(tmp_path, cache, monkeypatch):
    """The DALI source reads members through the read pool (several at once, in order); a member damaged or
    cut off after indexing is a bad record named by its reason, not an error."""
    import threading
    import time

    import dali_fast.webdataset as w

    samples = write_shards(tmp_path / "shards")
    r = WebDatasetReader(tmp_path / "shards")
    order = [20, 0, 7, 7, 13, -1, *range(21)]
    lock, state = threading.Lock(), {"now": 0, "most": 0, "threads": set()}
    real = w._pread

    def slow(member):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["threads"].add(threading.current_thread().name)
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        return real(member)

    monkeypatch.setattr(w, "_pread", slow)
    datas, labels, bad = r.read_batch_checked(order)
    assert bad == {} and [bytes(d) for d in datas] == [samples[i][0] for i in order]
    assert labels.dtype == np.int64 and labels.tolist() == [samples[i][1] for i in order]
    assert state["most"] >= 4 and threading.current_thread().name not in state["threads"]
    views, plain_labels = r.read_batch(order)
    assert [bytes(v) for v in views] == [bytes(d) for d in datas] and plain_labels.tolist() == labels.tolist()
    monkeypatch.undo()
    shard = tmp_path / "shards" / "train-000002.tar"
    blob = bytearray(shard.read_bytes())
    start = int(r._offset[14])  # sample 14, the first of the last shard (a PNG: i % 5 == 0)
    blob[start : start + 8] = b"NOTAPNG!"
    last = int(r._offset[20]) + int(r._size[20]) // 2  # the last image, cut in the middle
    shard.write_bytes(bytes(blob[:last]))
    fds = len(os.listdir("/proc/self/fd"))
    datas, _, bad = r.read_batch_checked([13, 14, 20])
    assert bad == {
        1: "not a JPEG or PNG (unknown signature)",
        2: f"unreadable: the shard ends at byte {last}, inside this member; index it again",
    }
    assert bytes(datas[0]) == samples[13][0] and datas[2] is None
    with pytest.raises(OSError, match="inside this member"):
        r.read_batch([20])
    assert len(os.listdir("/proc/self/fd")) == fds  # every read closed its shard, failed ones too
