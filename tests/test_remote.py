"""Remote WebDataset shards against real servers on localhost: moto's S3 server and an HTTP range server.

Every sample's label is its number, so a loader's labels name exactly which samples came; the tests
compare multisets, and count downloads on the server side (bytes it served per object).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import jpeg_bytes
from contract import each_once, run_save_load_state

from dali_fast import open_dataset
from dali_fast.data.remote.reader import RemoteShardsReader
from dali_fast.loaders.bad_records import BadRecordError
from dali_fast.loaders.torch_iterator import TorchIterator

pytest.importorskip("s3fs")
pytest.importorskip("moto")
wds = pytest.importorskip("webdataset")
from object_store import RangeHTTPServer, S3Server  # noqa: E402

SHARDS, PER_SHARD = 6, 8
N = SHARDS * PER_SHARD
SPEC = "s3://data/train-{000000..000005}.tar"
ROOT = Path(__file__).resolve().parents[1]


def shard_bytes(first: int, count: int, *, cut: int | None = None) -> tuple[bytes, dict[int, bytes]]:
    """A WebDataset tar of samples ``first..first+count-1`` (label = sample number), and their images."""
    buf, images = io.BytesIO(), {}
    with wds.TarWriter(buf) as sink:
        for i in range(first, first + count):
            image = jpeg_bytes(24 + i % 13, 20 + i % 7, (i * 5 % 256, 90, 200 - i))
            sink.write({"__key__": f"sample{i:05d}", "jpg": image, "cls": str(i).encode()})
            images[i] = image
    data = buf.getvalue()
    return (data[:cut] if cut else data), images


def make_shards() -> tuple[dict[str, bytes], dict[int, bytes]]:
    objects, images = {}, {}
    for s in range(SHARDS):
        objects[f"train-{s:06d}.tar"], imgs = shard_bytes(s * PER_SHARD, PER_SHARD)
        images.update(imgs)
    return objects, images


@pytest.fixture(scope="module")
def server():
    srv = S3Server()
    yield srv
    srv.stop()


@pytest.fixture
def s3(server, tmp_path, monkeypatch):
    """A fresh bucket ``data`` holding the shards; the loader's caches under tmp_path."""
    server.start() if server._server is None else None  # noqa: SLF001 - a test may leave it stopped
    server.reset()
    server.client.create_bucket(Bucket="data")
    objects, images = make_shards()
    for key, body in objects.items():
        server.client.put_object(Bucket="data", Key=key, Body=body)
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "dali_fast_cache"))
    server.objects, server.images = objects, images
    return server


def opts(server: S3Server, tmp_path: Path, cache: str = "cache", **kw) -> dict:
    kw.setdefault("index_dir", tmp_path / "index")
    return {"storage_options": {"endpoint_url": server.endpoint}, "cache_dir": tmp_path / cache, **kw}


def epoch_labels(loader, epoch: int = 0) -> list[int]:
    loader.set_epoch(epoch)
    return [int(x) for _, labels in loader for x in labels.tolist()]


def served_per_shard(server) -> dict[str, int]:
    return {k.split("/", 1)[1]: v for k, v in server.bytes_served.items()}


def sizes(server) -> dict[str, int]:
    return {k: len(v) for k, v in server.objects.items()}


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


# --------------------------------------------------------------------------------------------- processes

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from dali_fast import open_dataset, DALIIterator, TorchIterator
    spec, endpoint, cache, index, out, backend = sys.argv[1:7]
    r = open_dataset(spec, storage_options={"endpoint_url": endpoint}, cache_dir=cache, index_dir=index)
    kw = {"num_workers": 1} if backend == "torch" else {}
    cls = TorchIterator if backend == "torch" else DALIIterator
    loader = cls(r, 4, image_size=16, seed=11, **kw)
    loader.set_epoch(0)
    labels = [int(x) for _, b in loader for x in b.tolist()]
    rank = int(os.environ["RANK"])
    r.close()  # downloads ahead (of the next epoch) finished or stopped: the stats are final
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"labels": labels, "batches": -(-len(labels) // 4), "stats": r.stats()}, f)
    """
)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow
def test_two_ranks_under_torchrun_share_one_cache_with_one_download_per_shard(s3, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for phase, backend in (("index", "torch"), ("stream", "dali")):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        s3.counts.reset()
        cache = tmp_path / f"cache-{phase}"
        args = [str(script), SPEC, s3.endpoint, str(cache), str(tmp_path / "index"), str(tmp_path / phase), backend]
        proc = subprocess.run(launcher + args, env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"{phase}.{k}").read_text()) for k in range(2)]
        # Phase "index": both ranks opened a data set no one had indexed; phase "stream": a cold cache.
        assert served_per_shard(s3) == sizes(s3), phase  # one download per shard on the node
        assert sum(x["stats"]["downloads"] for x in ranks) == SHARDS, (phase, [x["stats"] for x in ranks])
        a, b = (Counter(x["labels"]) for x in ranks)
        assert not set(a) & set(b) and sorted((a + b).elements()) == list(range(N))  # disjoint, exactly once
        assert ranks[0]["batches"] == ranks[1]["batches"]


KILL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from dali_fast import open_dataset, DALIIterator
    spec, endpoint, cache, index, log, state = sys.argv[1:7]
    r = open_dataset(spec, storage_options={"endpoint_url": endpoint}, cache_dir=cache, index_dir=index,
                     shuffle_window=1, prefetch_next_epoch=False)  # the test counts this epoch's fetches
    loader = DALIIterator(r, 4, image_size=16, seed=5, rank=0, world_size=1)
    if os.path.exists(state):
        loader.load_state_dict(json.load(open(state)))
    else:
        loader.set_epoch(0)
    with open(log, "a") as f:
        for _, labels in loader:
            f.write(json.dumps({"labels": labels.tolist(), "state": loader.state_dict()}) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        f.write(json.dumps({"done": True, "stats": r.stats()}) + "\\n")
    """
)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_gives_each_sample_once_and_fetches_only_what_is_left(s3, tmp_path):
    pytest.importorskip("nvidia.dali")
    from dali_fast.loaders.shard_order import StreamingOrder

    r = open_dataset(SPEC, **opts(s3, tmp_path, cache="indexing"))  # the node's index
    order = StreamingOrder(r.shard_bounds, window=1, seed=5, rank=0, world_size=1).indices()
    shard_seq = list(dict.fromkeys(f"train-{i // PER_SHARD:06d}.tar" for i in order.tolist()))
    for key in shard_seq[2:]:  # the first two shards come; every later download hangs until the kill
        s3.stall(f"data/{key}", 120.0, times=99)
    s3.counts.reset()
    script, log, state = tmp_path / "kill.py", tmp_path / "log.jsonl", tmp_path / "state.json"
    script.write_text(KILL_SCRIPT)

    def args(cache: str) -> list[str]:
        return [str(script), SPEC, s3.endpoint, str(tmp_path / cache), str(tmp_path / "index"), str(log), str(state)]

    child = subprocess.Popen([sys.executable, *args("c1")], env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert child.poll() is None, child.stderr.read()[-3000:]
            lines = log.read_text().splitlines() if log.exists() else []
            if len(lines) >= 2 and list((tmp_path / "c1" / "shards").glob("*.part-*")):
                break  # two batches out, and a download under way
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        s3.unstall()
    assert child.returncode == -signal.SIGKILL
    assert list((tmp_path / "c1" / "shards").glob("*.part-*"))  # killed in the middle of a download
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    before = [i for x in lines for i in x["labels"]]
    state.write_text(json.dumps(lines[-1]["state"]))
    s3.counts.reset()
    # The restart on another node (an empty shard cache, the same index): it fetches only what is left.
    proc = subprocess.run([sys.executable, *args("c2")], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    after = [i for x in lines[len(before) // 4 :] for i in x.get("labels", [])]
    assert lines[-1].get("done") and len(before) >= 8
    each_once(before + after, range(N))
    still_needed = {f"train-{i // PER_SHARD:06d}.tar" for i in after}
    assert set(served_per_shard(s3)) == still_needed and served_per_shard(s3) == {k: sizes(s3)[k] for k in still_needed}
    assert len(still_needed) < SHARDS  # the shard read to its end before the kill was not fetched again
    # The killed process's cache: its partial download is cleared at the next open, never read as a shard.
    open_dataset(SPEC, **opts(s3, tmp_path, cache="c1"))
    assert not list((tmp_path / "c1" / "shards").glob("*.part-*"))
    assert all(p.read_bytes() in s3.objects.values() for p in (tmp_path / "c1" / "shards").glob("*.tar"))


@pytest.mark.slow
def test_the_command_line_takes_a_url(s3, tmp_path):
    env = {**_env(), "AWS_ENDPOINT_URL": s3.endpoint, "DALI_FAST_CACHE": str(tmp_path / "cli-cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "dali_fast", "inspect", SPEC], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"data set: {SPEC} (RemoteShardsReader)" in proc.stdout and f"records:  {N}" in proc.stdout


def test_bench_runs_every_loader_on_a_url_it_opens_once(s3, tmp_path, monkeypatch, capsys):
    """`dali-fast bench s3://...` takes the URL `train` and `inspect` take (it once became ``s3:/...``, "the
    pattern matches no file"), opens it once and reads every sample in each row."""
    from dali_fast import cli
    from dali_fast.data.remote import reader as remote_reader

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    opened = []
    monkeypatch.setattr(
        remote_reader.RemoteShardsReader, "_build", counted(opened, remote_reader.RemoteShardsReader._build)
    )
    out = tmp_path / "bench"
    argv = ["bench", SPEC, "--loaders", "baseline,torch,dali", "--epochs", "1", "--batch-size", "8"]
    assert cli.main([*argv, "--image-size", "32", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["loader"] for r in result["rows"]] == ["baseline", "torch", "dali"]
    assert all("error" not in r and r["images_per_epoch"] == N for r in result["rows"])
    assert result["limit"]["images_per_epoch"] == N and result["settings"]["dataset"] == SPEC
    assert len(opened) == 1  # one open for the limit and every row


def counted(calls: list, method):
    def wrapper(self, *args, **kwargs):
        calls.append(1)
        return method(self, *args, **kwargs)

    return wrapper
