"""`dali-fast train` run as real processes (one, or several under torchrun), and killed the way a preempted
node is: what the training, elastic and evaluation tests share."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from contract import each_once

from dali_fast.data.base import split
from dali_fast.data.open import open_dataset
from dali_fast.train.checkpoint import read_index_records

ROOT = Path(__file__).resolve().parents[2]


def skip_without_enough_gpus(nproc: int) -> None:
    """On a GPU host each rank needs its own GPU (nccl); on a CPU host ranks share the CPU (gloo)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"{nproc} ranks need {nproc} GPUs; this host has {torch.cuda.device_count()}")


def dist_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def train_command(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "dali_fast", *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, "-m", "dali_fast", *args]


def train_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def train_args(data: Path, loader: str, tmp: Path, tag: str, epochs: int = 2) -> list[str]:
    return [
        "train", str(data), "--loader", loader, "--epochs", str(epochs), "--model", "resnet_tiny",
        "--image-size", "32", "--batch-size", "5", "--num-workers", "0", "--no-drop-last",
        "--record-indices", str(tmp / f"{tag}.jsonl"),
    ]  # fmt: skip


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kill_at_first_checkpoint(cmd: list[str], ckpt: Path, timeout: float = 600) -> None:
    """Start ``cmd``; the moment ``ckpt`` appears, freeze every process of the run, then SIGKILL them all."""
    proc = subprocess.Popen(cmd, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    tree: list[int] = []
    try:
        while not ckpt.exists():
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                pytest.fail(f"training ended (rc {proc.returncode}) before its first checkpoint:\n{out[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint before the timeout")
            time.sleep(0.005)
        tree = process_tree(proc.pid)
        signal_all(tree, signal.SIGSTOP)  # no rank takes another step or writes another checkpoint
        tree = process_tree(proc.pid)
        signal_all(tree, signal.SIGKILL)  # no chance to clean up, as on a preempted node
    finally:
        signal_all(tree or [proc.pid], signal.SIGKILL)
        proc.wait(timeout=60)
        if proc.stdout:
            proc.stdout.close()
    end = time.monotonic() + 60
    while not all(gone(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(gone(p) for p in tree) and proc.returncode == -signal.SIGKILL


def index_records(tmp: Path, tag: str, nproc: int) -> dict[int, list[dict]]:
    if nproc == 1:
        return {0: read_index_records(tmp / f"{tag}.jsonl")}
    return {r: read_index_records(tmp / f"{tag}.jsonl.rank{r}") for r in range(nproc)}


def train_indices(data: Path) -> list[int]:
    train, _ = split(open_dataset(data), 0.2, 0)
    return [int(i) for i in train.indices]


def check_epoch_cover(per_rank: dict[int, list[int]], train: list[int], nproc: int) -> None:
    """Each rank's samples once; together the training split once, plus the documented padding."""
    for rank, got in per_rank.items():
        each_once(got, set(got), what=f"rank {rank}")  # no sample twice on one rank
    padded = math.ceil(len(train) / nproc) * nproc - len(train)
    everything = [i for got in per_rank.values() for i in got]
    each_once(everything, train, padding=padded)
    assert len(everything) == len(train) + padded  # the padding wraps around: `padded` samples twice
