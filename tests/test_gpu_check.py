"""benchmarks/gpu_check.sh and its kill-and-resume step, checked here without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_dry_run_lists_every_step_and_stops_without_a_gpu(tmp_path):
    r = _run("benchmarks/gpu_check.sh", "--dry-run", env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [x.split(":")[0].strip() for x in lines[1:-1]]
    assert steps == [
        "doctor",
        "gpu tests",
        "whole suite",
        "sigkill + resume",
        "bench none",
        "bench resnet50",
        "bench stages",
        "bench recipes",
        "torchrun 2 GPUs",
    ]
    assert lines[-1].startswith("no usable GPU: ") and list(tmp_path.iterdir()) == []
    r = _run("benchmarks/gpu_check.sh", env={"OUT": str(tmp_path)})
    assert r.returncode == 1 and r.stdout.count("\n") == 1 and r.stdout.startswith("no usable GPU: ")


@pytest.mark.slow
def test_kill_and_resume_step_proves_exactly_once(tmp_path):
    pytest.importorskip("nvidia.dali")
    tiny = "--images 150 --model resnet_tiny --image-size 32 --batch-size 8 --num-workers 0"
    env = {"KILL_RESUME_ARGS": tiny, "DALI_FAST_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = _run("benchmarks/gpu_kill_resume.sh", str(tmp_path / "ck"), env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "killed the run after its first checkpoint" in r.stdout and "resumed from" in r.stdout
    assert "each sample of each epoch exactly once across the kill" in r.stdout
