"""Remote WebDataset shards read against real servers on localhost: moto's S3 server and an HTTP range
server. Exact bytes, the cache, the servers' faults, resume; the tests compare multisets of labels and
count downloads on the server side (bytes it served per object)."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time

import pytest
from contract import each_once, run_save_load_state

from dali_fast import open_dataset
from dali_fast.data.remote.webdataset import RemoteShardsReader
from dali_fast.loaders.bad_records import BadRecordError
from dali_fast.loaders.torch_iterator import TorchIterator

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytest.importorskip("webdataset")
from object_store import RangeHTTPServer  # noqa: E402
from remote_shards import (  # noqa: E402
    PER_SHARD,
    SHARDS,
    SPEC,
    N,
    epoch_labels,
    make_shards,
    opts,
    served_per_shard,
    shard_bytes,
    sizes,
)

# --------------------------------------------------------------------------------------------- open


def test_every_sample_reads_back_exactly_and_the_index_is_read_once(s3, tmp_path):
    r = open_dataset(SPEC, **opts(s3, tmp_path))
    assert isinstance(r, RemoteShardsReader) and len(r) == N and r.classes == [str(i) for i in range(N)]
    assert r.shard_bounds.tolist() == list(range(0, N + 1, PER_SHARD))
    for i in range(N):
        data, label = r[i]
        assert label == i and bytes(data) == s3.images[i]
    assert r.source(9) == "s3://data/train-000001.tar:sample00009.jpg"
    assert served_per_shard(s3) == sizes(s3)  # indexing fetched each shard once (and kept it in the cache)
    s3.counts.reset()
    again = open_dataset(SPEC, **opts(s3, tmp_path, cache="other-cache"))  # the saved index: no shard fetched
    assert served_per_shard(again_server := s3) == {} and len(again) == N and again.fingerprint == r.fingerprint
    assert bytes(again[17][0]) == again_server.images[17]  # fetched now, into the other cache
    prefix = open_dataset("s3://data/", **opts(s3, tmp_path))  # a prefix lists its .tar files
    assert prefix.shards == r.shards


def test_the_endpoint_from_the_environment(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # what botocore and s3fs honour, no storage_options
    r = open_dataset(SPEC, cache_dir=tmp_path / "c")
    assert len(r) == N and bytes(r[0][0]) == s3.images[0]


def test_open_errors_are_one_line(s3, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^s3://data/train-000006.tar and 3 more: no such shard on the server"):
        open_dataset("s3://data/train-{000004..000009}.tar", **opts(s3, tmp_path))
    with pytest.raises(FileNotFoundError, match="no .tar shards there"):
        open_dataset("s3://data/nothing-here/", **opts(s3, tmp_path))
    shard = len(s3.objects["train-000000.tar"])
    s3.counts.reset()
    with pytest.raises(ValueError) as e:
        open_dataset(SPEC, **opts(s3, tmp_path, cache_limit=3 * shard, shuffle_window=2))
    assert "\n" not in str(e.value) and "too small" in str(e.value) and f">= {2 * 2 * shard}" in str(e.value)
    assert served_per_shard(s3) == {}  # refused before any download


def test_a_missing_cloud_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(ImportError, match=r"pip install 'dali_fast\[cloud\]'"):
        open_dataset("s3://data/train-000000.tar")


# --------------------------------------------------------------------------------------------- the cache


def test_cold_then_warm_cache_one_download_per_shard(s3, tmp_path):
    open_dataset(SPEC, **opts(s3, tmp_path, cache="indexing"))  # the index, built once
    s3.counts.reset()
    r = open_dataset(SPEC, **opts(s3, tmp_path))  # a cold shard cache
    loader = TorchIterator(r, 5, image_size=16, num_workers=0, rank=0, world_size=1, seed=1)
    each_once(epoch_labels(loader, 0), range(N))
    assert served_per_shard(s3) == sizes(s3) and r.stats()["downloads"] == SHARDS  # each shard once
    s3.counts.reset()
    each_once(epoch_labels(loader, 1), range(N))  # warm: nothing fetched
    assert served_per_shard(s3) == {} and r.stats()["downloads"] == SHARDS
    cached = sorted((tmp_path / "cache" / "shards").glob("*.tar"))
    assert sorted(p.read_bytes() for p in cached) == sorted(s3.objects.values())  # whole shards, nothing else
    r.close()


def test_a_budget_smaller_than_the_data_set(s3, tmp_path):
    shard = max(len(b) for b in s3.objects.values())
    limit = 2 * 1 * shard  # two windows of one shard: a third of the data set
    open_dataset(SPEC, **opts(s3, tmp_path, cache="indexing"))
    s3.counts.reset()
    r = open_dataset(SPEC, **opts(s3, tmp_path, cache_limit=limit, shuffle_window=1))
    peak, stop = [0], threading.Event()

    def watch():  # the folder, sampled while downloads run
        while not stop.is_set():
            peak[0] = max(peak[0], r.cache.used())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        loader = TorchIterator(r, 4, image_size=16, num_workers=0, rank=0, world_size=1, seed=2)
        for epoch in (0, 1):
            labels = epoch_labels(loader, epoch)
            assert sorted(labels) == list(range(N))
            assert r.cache.used() <= limit
            served = served_per_shard(s3)
            if epoch == 0:  # cold: every shard once
                assert served == sizes(s3)
            else:  # at most once (what the budget kept from the last epoch may be a hit): no thrashing
                assert all(served.get(k, 0) in (0, v) for k, v in sizes(s3).items()) and len(served) >= SHARDS - 2
            s3.counts.reset()
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak[0] <= limit
    assert r.stats()["evictions"] >= 2 * (SHARDS - 2) - 2
    r.close()


# --------------------------------------------------------------------------------------------- HTTP


def test_an_http_server_with_range_requests_and_a_stalled_request(tmp_path):
    objects, images = make_shards()
    (tmp_path / "www").mkdir()
    for key, body in objects.items():
        (tmp_path / "www" / key).write_bytes(body)
    srv = RangeHTTPServer(tmp_path / "www")
    try:
        spec = f"{srv.url}/train-{{000000..000005}}.tar"
        r = open_dataset(spec, cache_dir=tmp_path / "c", chunk_bytes=4096)
        assert [bytes(r[i][0]) for i in range(N)] == [images[i] for i in range(N)]
        assert r.infos[0].identity.startswith("ETag=")
        assert srv.bytes_served == {k: len(v) for k, v in objects.items()}  # once each, by 4 KiB ranges
        srv.counts.reset()
        srv.stall("train-000003.tar", 5.0)  # the first request hangs: abandoned after 0.5 s, then retried
        r2 = open_dataset(spec, cache_dir=tmp_path / "c2", index_dir=tmp_path / "c" / "index", timeout=0.5)
        t = time.monotonic()
        loader = TorchIterator(r2, 6, image_size=16, num_workers=0, rank=0, world_size=1)
        assert sorted(epoch_labels(loader)) == list(range(N))
        assert time.monotonic() - t < 5  # did not wait the stall out
        assert srv.gets["train-000003.tar"] >= 2 and srv.gets["train-000000.tar"] == 1
        r2.close()
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------------- faults


def test_the_server_away_for_seconds_mid_epoch_costs_time_not_samples(s3, tmp_path):
    shard = max(len(b) for b in s3.objects.values())
    open_dataset(SPEC, **opts(s3, tmp_path, cache="indexing"))
    r = open_dataset(SPEC, **opts(s3, tmp_path, cache_limit=2 * shard, shuffle_window=1, chunk_bytes=4096))
    loader = TorchIterator(r, 4, image_size=16, num_workers=0, rank=0, world_size=1, seed=3)
    labels, restarted = [], threading.Event()
    for _, batch in loader:
        labels += batch.tolist()
        if len(labels) == 8:  # mid-epoch, with shards still to download
            s3.stop()
            s3.counts.reset()
            threading.Timer(3.0, lambda: (s3.start(), restarted.set())).start()
    assert restarted.is_set() and sorted(labels) == list(range(N)) and loader.skipped == 0
    assert len(served_per_shard(s3)) >= 2  # shards were still fetched after the server came back
    r.close()


def _open_after_index(s3, tmp_path, **kw) -> RemoteShardsReader:
    open_dataset(SPEC, **opts(s3, tmp_path, cache="indexing"))
    return open_dataset(SPEC, **opts(s3, tmp_path, retry_seconds=2, **kw))


@pytest.mark.parametrize(
    ("fault", "backend"), [("deleted", "torch"), ("truncated", "torch"), ("changed", "torch"), ("deleted", "dali")]
)
def test_a_shard_gone_truncated_or_changed_on_the_server_is_a_bad_shard(s3, tmp_path, fault, backend, caplog):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator as Loader

        kw = {}
    else:
        Loader, kw = TorchIterator, {"num_workers": 0}
    bad_key, bad = "train-000002.tar", set(range(2 * PER_SHARD, 3 * PER_SHARD))
    r = _open_after_index(s3, tmp_path)  # both opened (the shard listed and indexed), then the fault
    skipping = Loader(_open_after_index(s3, tmp_path, cache="skip-cache"), 4, image_size=16, on_error="skip", **kw)
    body = s3.objects[bad_key]
    if fault == "deleted":
        s3.client.delete_object(Bucket="data", Key=bad_key)
        why = "no longer on the server (deleted?)"
    elif fault == "truncated":
        s3.client.put_object(Bucket="data", Key=bad_key, Body=body[: len(body) // 2])
        why = f"truncated on the server: {len(body) // 2} bytes now, {len(body)} when indexed"
    else:  # the same size, other bytes: only the identity and the crc32 tell
        changed = body.replace(b"sample00017", b"sample99999")
        assert len(changed) == len(body) and changed != body
        s3.client.put_object(Bucket="data", Key=bad_key, Body=changed)
        why = "changed on the server since it was indexed"
    loader = Loader(r, 4, image_size=16, rank=0, world_size=1, seed=4, **kw)
    with pytest.raises(BadRecordError) as e:
        epoch_labels(loader)
    msg = str(e.value)
    assert f"s3://data/{bad_key}:" in msg and why in msg and "\n" not in msg
    with caplog.at_level(logging.WARNING):
        labels = epoch_labels(skipping)
    assert sorted(labels) == sorted(set(range(N)) - bad)  # every other sample, once
    assert skipping.skipped == PER_SHARD  # the bad shard's samples, counted
    assert sum(f"s3://data/{bad_key}:sample000" in m for m in caplog.messages) >= PER_SHARD  # and named
    assert not [p for p in (tmp_path / "skip-cache" / "shards").iterdir() if ".part-" in p.name]


def test_a_shard_changed_after_its_index_was_cached_gets_a_new_index_not_the_old(s3, tmp_path):
    r = open_dataset(SPEC, **opts(s3, tmp_path))
    old_index = {p.name for p in (tmp_path / "index").glob("*.npz")}
    body, images = shard_bytes(100, PER_SHARD + 3)  # other samples, another length
    s3.client.put_object(Bucket="data", Key="train-000001.tar", Body=body)
    again = open_dataset(SPEC, **opts(s3, tmp_path))  # the same caches
    assert len(again) == N + 3 and again.fingerprint != r.fingerprint
    got = {again[i][1]: bytes(again[i][0]) for i in range(len(again))}
    assert {k: got[k] for k in images} == images and not set(range(PER_SHARD, 2 * PER_SHARD)) & set(got)
    assert len({p.name for p in (tmp_path / "index").glob("*.npz")} - old_index) == 1  # one shard re-indexed
    truncated, _ = shard_bytes(0, PER_SHARD, cut=len(s3.objects["train-000000.tar"]) // 2 + 100)  # mid-member
    s3.client.put_object(Bucket="data", Key="train-000000.tar", Body=truncated)
    cut = open_dataset(SPEC, **opts(s3, tmp_path))  # re-indexed: whole members kept, the cut one named
    assert len(cut) < N + 3 and any("train-000000.tar" in w and "truncated" in why for w, why in cut.damaged)
    with pytest.raises(ValueError, match="truncated"):
        open_dataset(SPEC, **opts(s3, tmp_path, on_error="raise"))


def test_save_load_state_contract_over_streamed_shards(s3, tmp_path):
    """The contract checker over the streaming order, the downloads ahead and the cache under a budget."""
    r = open_dataset(SPEC, **opts(s3, tmp_path, cache_limit=4 * len(s3.objects["train-000000.tar"]), shuffle_window=2))
    run_save_load_state(lambda: TorchIterator(r, 5, image_size=16, num_workers=0, rank=0, world_size=1, seed=2), 4)
    r.close()


def test_elastic_resume_on_another_world_size(s3, tmp_path):
    r = open_dataset(SPEC, **opts(s3, tmp_path))
    first = [TorchIterator(r, 3, image_size=16, num_workers=0, rank=k, world_size=2, seed=6) for k in range(2)]
    seen = []
    for loader in first:
        loader.set_epoch(1)
        it = iter(loader)
        for _ in range(3):
            seen += next(it)[1].tolist()
    state = first[0].state_dict()
    resumed = [TorchIterator(r, 4, image_size=16, num_workers=0, rank=k, world_size=3, seed=6) for k in range(3)]
    rest = []
    for loader in resumed:
        loader.load_state_dict(state)
        got = [b[1].tolist() for b in loader]
        rest.append(sum(got, []))
    assert len({len(x) for x in rest}) == 1
    each_once(seen + sum(rest, []), range(N), padding=2)  # each sample; repeats only as the new ranks' padding
    r.close()


def _alarm(_signum, _frame):
    raise TimeoutError("a lock a forked worker kept open blocks the loader")


def test_forked_workers_do_not_keep_the_parents_pins(s3, tmp_path):
    # Without care a forked DataLoader worker keeps its parent's locks (flock locks belong to the open
    # file, which fork shares): the loader then waits for ever. Bounded here, so that shows as a failure.
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(120)
    try:
        _forked_workers(s3, tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _forked_workers(s3, tmp_path):
    r = open_dataset(SPEC, **opts(s3, tmp_path, shuffle_window=2))
    loader = TorchIterator(r, 4, image_size=16, num_workers=2, rank=0, world_size=1, seed=7)
    loader.set_epoch(0)
    it = iter(loader)
    labels = next(it)[1].tolist()  # workers forked while shards were pinned and downloads ran
    labels += [x for _, b in it for x in b.tolist()]
    assert sorted(labels) == list(range(N))
    r.close()  # unpins; the workers still run (persistent) and must hold no lock
    for lock in (tmp_path / "cache" / "shards").glob("*.lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if anyone still pins the shard
        finally:
            os.close(fd)
    loader.close()
