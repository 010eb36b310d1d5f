"""gpu_check's verdicts that need a GPU to happen, checked with given readings: the loader-ceiling step fails
when a GPU's JPEG engine stays idle, and a step that records a failure exits non-zero with its figures kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu_check"))


@pytest.mark.parametrize(
    "gpu, engine, sampled, idle, figure, fails",
    [
        (True, True, True, [], "yes", False),
        (True, True, True, ["DALIIterator with 16 threads"], "NO: idle under DALIIterator with 16 threads", True),
        (True, False, True, ["DALIIterator with 16 threads"], "n/a (no JPEG engine)", False),
        (True, None, True, ["DALIIterator with 8 threads"], "n/a (NVML cannot tell)", False),
        (True, True, False, [], "n/a (no NVML reading)", False),
        (False, None, False, [], "n/a (no GPU)", False),
    ],
)
def test_the_ceiling_step_fails_when_the_jpeg_engine_stays_idle(gpu, engine, sampled, idle, figure, fails):
    import gpu_steps

    verdict, failure = gpu_steps.engine_verdict(gpu, engine, sampled, idle)
    assert verdict == figure and (failure is not None) == fails
    if fails:
        assert failure == f"the JPEG engine stayed idle under {', '.join(idle)}"


def test_a_step_with_a_failure_exits_1_after_writing_its_figures(tmp_path, monkeypatch, capsys):
    import gpu_steps

    def step(args):
        gpu_steps.figure("controller.seen", 1)
        gpu_steps.FAILED.append("something the device showed")

    monkeypatch.setitem(gpu_steps.STEPS, "controller", step)
    data = tmp_path / "packed"
    data.mkdir()
    assert gpu_steps.main(["controller", "--data", str(data), "--out", str(tmp_path)]) == 1
    assert "controller FAILED: something the device showed" in capsys.readouterr().out
    assert json.loads((tmp_path / "controller.json").read_text())["controller.seen"] == 1
    monkeypatch.setitem(gpu_steps.STEPS, "controller", lambda args: gpu_steps.figure("controller.seen", 2))
    # failures do not carry over
    assert gpu_steps.main(["controller", "--data", str(data), "--out", str(tmp_path)]) == 0
