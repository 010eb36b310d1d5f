"""bench under ranks: every step waits for the slowest rank, as DDP's all-reduce makes it; a rank's failure
stops the others at the same step; rank 0 merges the ranks' figures."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dali_fast.data.synthetic import make_synthetic
from dali_fast.machine import available_cpus
from dali_fast.text import plural
from dali_fast.tools import bench_ranks
from dali_fast.tools.bench import run_bench
from dali_fast.tools.bench_rows import Row, batch_tails


class _Monitor:
    def phase(self, name):
        import contextlib

        return contextlib.nullcontext()

    def summary(self, name):
        return {"kind": "cpu", "mean": 50.0, "p50": 50.0, "p95": 50.0, "peak_mem": 1.0}


def _two_ranks(out: str, progress: bool = False) -> None:
    """Rank 1 takes 60 ms a step for 2 epochs, rank 0 none; in a third epoch rank 1 fails at its 3rd step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    sync = bench_ranks.StepSync()
    batches = [(None, [0] * 4)] * 5

    def consume(batch):
        if rank == 1:
            time.sleep(0.06)
        return len(batch[1])

    row = Row("fake", "fake", batches, 20, consume, monitor=_Monitor(), progress=False, sync=sync)
    for _ in range(3):
        row.epoch()
    seen = {"batch_times": row.batch_times}
    failing = {"n": 0}

    def fails(batch):
        failing["n"] += 1
        if rank == 1 and failing["n"] == 3:
            raise RuntimeError("decode worker lost")
        return 4

    row.consume = fails
    try:
        row.epoch()
        seen["error"] = None
    except RuntimeError as e:
        seen["error"], seen["at_step"] = type(e).__name__, failing["n"]
        sync.fail()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


def test_every_step_lasts_as_long_as_the_slowest_rank_and_a_failure_stops_all(tmp_path):
    bench_ranks.spawn(2, _two_ranks, {"out": str(tmp_path)})
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(fast["batch_times"]) == 2 and all(len(e) == 5 for e in fast["batch_times"])
    # rank 0 does nothing in a step, yet each of its steps waited for rank 1's 60 ms (less the jitter of
    # the two ranks leaving the same all-reduce)
    assert min(min(e) for e in fast["batch_times"]) > 0.05
    assert min(min(e) for e in slow["batch_times"]) >= 0.06
    assert slow["error"] == "RuntimeError" and slow["at_step"] == 3
    assert fast["error"] == "RankFailed" and fast["at_step"] == 3  # at the same step, not a hang


def test_merge_takes_each_step_from_the_slowest_rank_and_names_the_failing_rank():
    row = {"loader": "torch", "util_kind": "cpu", "util_mean": 40.0, "cache": None, "pss_peak_bytes": 100}
    a = {**row, "epoch_times": [1.0, 2.0], "epoch_counts": [16, 16], "batch_times": [[0.5, 0.1, 0.3], [0.2, 0.4, 0.1]]}
    b = {**row, "epoch_times": [1.5, 1.0], "epoch_counts": [16, 16], "batch_times": [[0.1, 0.2, 0.2], [0.9, 0.1, 0.3]]}
    b["pss_peak_bytes"] = 300
    merged = bench_ranks.merge([a, b], batch_tails)
    assert merged["batch_times"] == [[0.5, 0.2, 0.3], [0.9, 0.4, 0.3]]
    assert merged["epoch_times"] == [1.5, 2.0] and merged["img_per_s"] == 64 / 3.5 and merged["images_per_epoch"] == 32
    assert merged["batch_p50_s"] == batch_tails([[0.5, 0.2, 0.3], [0.9, 0.4, 0.3]])["batch_p50_s"] == 0.3
    assert merged["pss_peak_bytes"] == 300 and merged["pss_peak_bytes_by_rank"] == [100, 300]
    assert merged["util_mean"] == 80.0 and merged["ranks"] == 2
    failed = bench_ranks.merge(
        [{**a, "error": "RankFailed: another rank's row failed"}, {"error": "OSError: gone"}], batch_tails
    )
    assert failed["error"] == "rank 1: OSError: gone"


def test_shards_cover_the_data_with_the_same_steps_on_every_rank():
    shards = [bench_ranks.shard(10, r, 4) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    assert sorted(set(sum(shards, []))) == list(range(10))


def test_bench_with_two_ranks_merges_the_rows(tmp_path):
    make_synthetic(tmp_path / "images", images=36, classes=3, progress=False)
    result = run_bench(
        str(tmp_path / "images"),
        loaders=["torch"],
        epochs=1,
        batch_size=6,
        image_size=24,
        out=tmp_path / "out",
        ranks=2,
    )
    torch_row, limit = result["rows"][0], result["limit"]
    assert "error" not in torch_row and "error" not in limit
    assert torch_row["ranks"] == 2 and torch_row["images_per_epoch"] == 36  # two shards of 18
    assert len(torch_row["batch_times_by_rank"]) == 2 and [len(e) for e in torch_row["batch_times"]] == [3]
    by_rank = torch_row["batch_times_by_rank"]
    assert torch_row["batch_times"][0] == [max(x, y) for x, y in zip(by_rank[0][0], by_rank[1][0], strict=True)]
    per_rank = max(1, available_cpus() // 2)
    assert limit["ranks"] == 2 and limit["images_per_epoch"] == 36 and limit["workers"] == per_rank
    assert result["settings"]["ranks"] == 2 and "(per rank)" in result["table"].splitlines()[0]
    assert f"limit: decode only, {plural(per_rank, 'process', 'processes')} x 2 ranks" in result["table"]
    with pytest.raises(ValueError, match="the ffcv row runs on one rank"):
        run_bench(str(tmp_path / "images"), loaders=["ffcv"], out=tmp_path / "x", ranks=2)
