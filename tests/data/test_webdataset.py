"""WebDataset shards read in place: written by the webdataset package's own TarWriter, read back exactly."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
from builders import write_shards
from contract import run_save_load_state
from spies import ConcurrencySpy

from dali_fast import open_dataset
from dali_fast.data.webdataset import WebDatasetReader

wds = pytest.importorskip("webdataset")


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
    import dali_fast.data.shards as shards

    monkeypatch.setattr(shards, "scan_tar", lambda p: pytest.fail("scanned again"))  # what index_shard walks with
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
    assert len({bytes(r[i][0]) for i in range(len(r))}) == 21  # the indices name distinct images
    run_save_load_state(lambda: cls(r, 4, image_size=16, device="cpu", seed=3, cache_bytes=10**6, **kw), midpoint=2)


def test_reader_pickles_for_workers(tmp_path, cache):
    import pickle

    write_shards(tmp_path / "shards")
    r = WebDatasetReader(tmp_path / "shards")
    _ = r[3]
    back = pickle.loads(pickle.dumps(r))
    assert bytes(back[3][0]) == bytes(r[3][0]) and np.array_equal(back.labels, r.labels)


def test_batch_reads_are_exact_parallel_and_name_bad_members(tmp_path, cache, monkeypatch):
    """The DALI source reads members through the read pool (several at once, in order); a member damaged or
    cut off after indexing is a bad record named by its reason, not an error."""
    import threading

    import dali_fast.data.webdataset as w

    samples = write_shards(tmp_path / "shards")
    r = WebDatasetReader(tmp_path / "shards")
    order = [20, 0, 7, 7, 13, -1, *range(21)]
    spy = ConcurrencySpy(w._pread)
    monkeypatch.setattr(w, "_pread", spy)
    datas, labels, bad = r.read_batch_checked(order)
    assert bad == {} and [bytes(d) for d in datas] == [samples[i][0] for i in order]
    assert labels.dtype == np.int64 and labels.tolist() == [samples[i][1] for i in order]
    assert spy.most >= 4 and threading.current_thread().name not in spy.threads
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
        1: "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)",
        2: f"unreadable: the shard ends at byte {last}, inside this member; index it again",
    }
    assert bytes(datas[0]) == samples[13][0] and datas[2] is None
    with pytest.raises(OSError, match="inside this member"):
        r.read_batch([20])
    assert len(os.listdir("/proc/self/fd")) == fds  # every read closed its shard, failed ones too
