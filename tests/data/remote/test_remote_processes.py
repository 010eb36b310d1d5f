"""Remote WebDataset shards from several processes: two ranks under torchrun sharing one cache, a SIGKILL
mid-epoch then a resume, and the command line on an `s3://` URL (moto's S3 server on localhost)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from contract import each_once

from dali_fast import open_dataset

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytest.importorskip("webdataset")
from remote_shards import PER_SHARD, SHARDS, SPEC, N, opts, served_per_shard, sizes  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


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
    from dali_fast.loaders.order.streaming import StreamingOrder

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
    from dali_fast.data.remote import webdataset as remote_reader

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
