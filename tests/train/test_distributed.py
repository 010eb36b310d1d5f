"""This process's place in a job: the rank, the world and the CUDA device a launcher gives it."""

from __future__ import annotations

from pathlib import Path

import torch


def test_each_rank_drives_a_visible_gpu_when_the_launcher_shows_it_only_its_own(monkeypatch):
    """SLURM --gpus-per-task=1: WORLD_SIZE=2, LOCAL_RANK=1, one visible GPU. Device 1 does not exist."""
    import torch.distributed as dist

    import dali_fast.machine as system
    import dali_fast.train.distributed as distributed

    monkeypatch.setattr(system, "cuda_usable", lambda: True)  # what local_device_index asks
    monkeypatch.setattr(distributed, "cuda_usable", lambda: True)  # what distributed_context asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: chosen.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with distributed.distributed_context() as ctx:
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.device_index) == (1, 2, 1, 0)
    assert chosen == [0, "nccl"]


def test_a_restarted_group_joins_under_its_own_prefix_of_the_agent_s_store(monkeypatch):
    """torchrun's agent keeps one store for every start of a group; a restarted start (count 1) joins under
    ``dali_fast/start1/``, so it never reads what the failed start had published there."""
    from datetime import timedelta

    import torch.distributed as dist

    from dali_fast.train.distributed import restart_store

    server = dist.TCPStore(
        "127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for count in ("", "0"):  # the first start: torch's own env:// store
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        assert restart_store(timedelta(seconds=10)) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = restart_store(timedelta(seconds=10))
    server.set("default_pg/0", b"a stale address")  # what the failed start left
    assert not store.check(["default_pg/0"])
    store.set("default_pg/0", b"this start's")
    assert server.check(["dali_fast/start1/default_pg/0"])
    assert server.get("dali_fast/start1/default_pg/0") == b"this start's"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # each start makes its own store: nothing to do
    assert restart_store(timedelta(seconds=10)) is None


def test_a_rank_killed_under_max_restarts_the_group_restarts_and_the_epoch_holds_each_sample_once(tmp_path):
    """``train --resume`` under ``torchrun --max-restarts 1`` on 2 ranks: rank 1 SIGKILLed after the first
    checkpoint, the agent restarts both, which resume from it; each epoch holds every sample of the
    training split once (what was trained after the checkpoint is trained again). Before, the restarted
    group never formed (gloo: "connectFullMesh failed ... Connection refused") and the job failed."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from collections import Counter

    from train_runs import process_tree, skip_without_enough_gpus, train_env, train_indices

    from dali_fast.data.pack.packed import pack
    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.train.checkpoint import read_index_records

    skip_without_enough_gpus(2)
    make_synthetic(tmp_path / "images", images=61, classes=3, seed=3, progress=False)
    pack(tmp_path / "images", tmp_path / "packed", progress=False)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    args = ["train", str(tmp_path / "packed"), "--loader", "torch", "--epochs", "2", "--model", "resnet_tiny"]
    args += ["--image-size", "16", "--batch-size", "4", "--num-workers", "0", "--checkpoint", str(tmp_path / "ck")]
    args += ["--checkpoint-every", "2", "--resume", "--record-indices", str(tmp_path / "seen.jsonl")]
    proc = subprocess.Popen([*launcher, "-m", "dali_fast", *args], env=train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    rank1, killed, deadline = tmp_path / "seen.jsonl.rank1", False, time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            done = rank1.exists() and rank1.read_text().count("\n") >= 3
            if not killed and done and (tmp_path / "ck" / "checkpoint.pt").exists():
                for pid in process_tree(proc.pid):
                    environ = Path(f"/proc/{pid}/environ").read_bytes() if Path(f"/proc/{pid}").exists() else b""
                    if b"\0RANK=1\0" in b"\0" + environ and b"dali_fast" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
                        killed = True
                        break
            time.sleep(0.02)
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert killed and proc.returncode == 0, out[-3000:]
    train = train_indices(tmp_path / "packed")
    records = {r: read_index_records(tmp_path / f"seen.jsonl.rank{r}") for r in (0, 1)}
    drops = [xs[k]["step"] for xs in records.values() for k in range(1, len(xs)) if xs[k]["step"] <= xs[k - 1]["step"]]
    resumed_at = min(drops) - 1 if drops else None  # the restarted ranks begin after the checkpoint's step
    for xs in records.values():
        begin = max((k for k, x in enumerate(xs) if x["step"] == (resumed_at or 0) + 1), default=0)
        kept = [x for x in xs[:begin] if x["step"] <= resumed_at] + xs[begin:] if drops else xs
        for epoch in (0, 1):
            seen = Counter(i for x in kept if x["epoch"] == epoch for i in x["indices"])
            assert max(seen.values()) == 1 and len(seen) == len(train) // 2 // 4 * 4  # drop_last: whole batches
            assert set(seen) <= set(train)
