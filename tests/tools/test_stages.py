"""`dali-fast stages`: every row in order, cumulative settings, consistent projections, skipped stages."""

from __future__ import annotations

import json

import pytest

from dali_fast.data.synthetic import make_synthetic
from dali_fast.tools.report import fmt_duration
from dali_fast.tools.stages import IMAGENET_IMAGES, STAGES, run_stages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    make_synthetic(root / "images", images=24, classes=3, progress=False)
    return root / "images"


def _run(tiny, out, **kw):
    kw = {"epochs": 1, "batch_size": 8, "image_size": 32, "controller_epochs": 2, "progress": False, **kw}
    return run_stages(tiny, out=out, **kw)


@pytest.mark.slow
def test_every_stage_in_order_cumulative_and_consistent(tiny, tmp_path):
    pytest.importorskip("nvidia.dali")
    result = _run(tiny, tmp_path, total_epochs=10, total_images=1000)
    rows = result["rows"]
    assert [r["stage"] for r in rows] == [s.name for s in STAGES]
    for before, after in zip(rows, rows[1:], strict=False):
        assert set(before["settings"]) < set(after["settings"])  # each row contains the one above, plus one
        assert after["settings"][-1] == after["adds"]
    for r in rows:
        assert "skipped" not in r, r
        assert r["projected_s"] == pytest.approx(1000 * 10 / r["img_per_s"])
        assert r["img_per_s"] > 0 and r["epoch_s"] > 0 and 0 < r["peak_mem_fraction"] < 1
    assert rows[0]["x_baseline"] == 1.0 and rows[0]["cache_hit_rate"] is None
    assert all(0 <= r["cache_hit_rate"] <= 1 for r in rows[1:])
    assert rows[-1]["batch_decisions"] and rows[-1]["batch_size"] == rows[-1]["batch_decisions"][-1]["next_batch_size"]
    saved = json.loads((tmp_path / "stages.json").read_text())
    assert [r["stage"] for r in saved["rows"]] == [s.name for s in STAGES]
    assert saved["settings"]["cache_bytes"] < saved["settings"]["data_bytes"]  # smaller than the data: honest
    png = (tmp_path / "stages.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    table = result["table"].splitlines()
    assert (
        table[0].startswith("| stage | img/s | epoch s | projected run (10 epochs x 1,000 images)") and len(table) == 9
    )


def test_a_stage_that_cannot_run_is_named_with_its_reason(tiny, tmp_path, monkeypatch):
    import dali_fast.tools.stages as stages

    monkeypatch.setattr(stages, "dali_status", lambda: (False, "nvidia.dali does not import (test)"))
    monkeypatch.setattr(stages, "STAGES", stages.STAGES[:1] + stages.STAGES[4:])  # baseline, then the DALI rows
    rows = _run(tiny, tmp_path)["rows"]
    assert [r["stage"] for r in rows] == ["baseline", "+ DALI", "+ controller", "+ progressive resizing"]
    assert rows[1]["skipped"] == rows[2]["skipped"] == "DALI cannot run here: nvidia.dali does not import (test)"
    assert rows[3]["skipped"] == rows[1]["skipped"]
    assert "| + DALI | skipped: DALI cannot run here" in json.loads((tmp_path / "stages.json").read_text())["table"]


class FakeGpuMonitor:
    """The utilization monitor on a GPU whose DALI pipeline holds memory torch's allocator does not see:
    NVML's per-process reading is 30 GiB in each timed epoch (12 GiB in the warm-up)."""

    kind = "gpu"

    def __init__(self, *args, **kwargs):
        self.phases = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def phase(self, name):
        import contextlib

        self.phases.append(name)
        return contextlib.nullcontext()

    def summary(self, name):
        peak = (12 if name.endswith("#0") else 30) * 2**30
        return {"kind": "gpu", "samples": 4, "mean": 55.0, "p50": 55.0, "p95": 60.0, "peak_mem": peak}


def test_stage_memory_is_the_process_reading_bench_uses(tiny, tmp_path, monkeypatch):
    """Not torch's max_memory_reserved, which leaves DALI's pool and outputs out: the monitor's NVML
    reading for this process, as `bench` reports it, over the stage's timed epochs."""
    import dali_fast.tools.stages as stages
    import dali_fast.train.monitor as monitor

    monkeypatch.setattr(monitor, "UtilizationMonitor", FakeGpuMonitor)
    monkeypatch.setattr(stages, "STAGES", stages.STAGES[:1])
    monkeypatch.setattr(stages, "memory_capacity", lambda kind: 80 * 2**30 if kind == "gpu" else None, raising=False)
    row = _run(tiny, tmp_path, epochs=2)["rows"][0]
    assert row["util_kind"] == "gpu" and row["peak_mem_bytes"] == 30 * 2**30
    assert row["peak_mem_fraction"] == pytest.approx(30 / 80)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--total-epochs", "0"], "argument --total-epochs: 0 is too small; use 1 or more"),
        (["--total-images", "-5"], "argument --total-images: -5 is too small; use 1 or more"),
        (["--total-epochs", "many"], "argument --total-epochs: 'many' is not a whole number"),
    ],
)
def test_bad_projection_arguments_one_line(argv, says, capsys):
    from dali_fast.cli import main

    with pytest.raises(SystemExit) as e:
        main(["stages", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0]


def test_stages_refuses_a_cache_without_a_budget_in_one_line(tiny, tmp_path):
    with pytest.raises(ValueError) as e:
        run_stages(tiny, cache_bytes=0, out=tmp_path, progress=False)
    assert str(e.value) == "--cache-bytes 0: the cache rows need a budget; leave it out for half the data"


def test_library_refuses_bad_projection_in_one_line(tiny, tmp_path):
    with pytest.raises(ValueError) as e:
        run_stages(tiny, total_epochs=0, out=tmp_path, progress=False)
    assert str(e.value) == "--total-epochs 0: must be a whole number of 1 or more"


def test_durations_read_like_the_article():
    assert fmt_duration(3600 * 5) == "5.0 h" and fmt_duration(3600 * 24 * 15) == "15.0 days"
    assert IMAGENET_IMAGES == 1_281_167


def test_progressive_row_projects_the_run_size_by_size(tiny, tmp_path, monkeypatch):
    """The last row: each size of the schedule timed on the controller's DALI loader, and the projected run
    the sum of each epoch at its size's speed; its img/s the run's average."""
    pytest.importorskip("nvidia.dali")
    import dali_fast.tools.stages as stages
    from dali_fast import Progressive
    from dali_fast.tools.report import stages_summary

    monkeypatch.setattr(stages, "STAGES", stages.STAGES[:1] + stages.STAGES[-1:])
    ramp = Progressive(16, 32, 2, 6, step=8)  # 10 epochs: 16 px x 4 (20 rounds to 16), 24 px x 1, 32 px x 5
    result = _run(tiny, tmp_path, total_epochs=10, total_images=1000, progressive=ramp)
    row = result["rows"][1]
    assert row["stage"] == "+ progressive resizing" and "skipped" not in row
    assert row["adds"].endswith("16:32:2:6:8 (START:END:FROM_EPOCH:TO_EPOCH), eval at 32 px")
    speed = row["img_per_s_by_size"]
    assert sorted(speed) == [16, 24, 32] and row["epochs_by_size"] == {16: 4, 24: 1, 32: 5}
    assert row["projected_s"] == pytest.approx(1000 * (4 / speed[16] + 1 / speed[24] + 5 / speed[32]))
    assert row["img_per_s"] == pytest.approx(1000 * 10 / row["projected_s"])
    assert row["batch_decisions"]  # the controller's row, carried on
    printed = stages_summary(result, tmp_path)
    assert "+ progressive resizing: 16:32:2:6:8 (START:END:FROM_EPOCH:TO_EPOCH); img/s at each size: 16 px" in printed
    assert result["settings"]["progressive"] == "16:32:2:6:8"


def test_default_ramp_is_ffcvs_scaled_to_the_run():
    from dali_fast import Progressive
    from dali_fast.tools.stages import default_ramp

    assert default_ramp(224, 88) == Progressive(160, 224, 65, 76)
    assert default_ramp(224, 90) == Progressive(160, 224, 66, 78)
    assert default_ramp(32, 10) == Progressive(24, 32, 7, 9, step=8)
