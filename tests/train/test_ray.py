"""Ray (examples/ray_train.py, run by `make test-ray`): a Ray Data job writes an ImageFolder as shards with
`write_shards`; a Ray Train `TorchTrainer` of 2 CPU workers reads them with `DALIIterator`, each sample once
per epoch across the ranks, checkpoints mid-epoch, stops, and a second run resumes at exactly the next sample."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'dali-fast[ray]' (make test-ray)")
pytest.importorskip("ray.train")
pytest.importorskip("nvidia.dali")

from dali_fast import make_synthetic, open_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import ray_train  # noqa: E402

pytestmark = pytest.mark.slow
IMAGES, CLASSES, BATCH, WORKERS = 50, 5, 4, 2


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    path = os.pathsep.join([str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path.rstrip(os.pathsep)}},  # the workers import the example
    )
    yield root
    ray.shutdown()


def source(root: Path) -> Counter:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    return Counter((f.read_bytes(), label) for label, c in enumerate(classes) for f in (root / c).iterdir())


def records(work: Path, run: str) -> dict[int, list[dict]]:
    """Each rank's batches of a run, in order."""
    out = {}
    for path in sorted((work / "records").glob(f"{run}-rank*.jsonl")):
        out[int(path.stem.rsplit("rank", 1)[1])] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def test_ray_data_writes_shards_and_ray_train_resumes_each_sample_once(ray_cluster, monkeypatch):
    work = ray_cluster / "work"
    src = make_synthetic(ray_cluster / "src", images=IMAGES, classes=CLASSES, seed=3, progress=False)
    monkeypatch.setenv("DALI_FAST_CACHE", str(ray_cluster / "cache"))

    # Ray Data: four partitions of at most 16 files, written by write_shards into one folder
    reports = ray_train.shard_with_ray(str(src), str(work / "shards"), files_per_partition=16, shard_size=64 * 1024)
    assert sum(r["samples"] for r in reports) == IMAGES and len(reports) >= 4
    assert len({r["prefix"] for r in reports}) == len(reports)
    shards = open_dataset(str(work / "shards"))
    assert Counter((bytes(shards[i][0]), shards[i][1]) for i in range(len(shards))) == source(src)
    assert sorted(p.name for p in (work / "shards").iterdir()) == sorted(
        f"{r['prefix']}-{s:06d}.tar" for r in reports for s in range(r["shards"])
    )

    # Ray Train: 2 workers, a checkpoint after 2 steps, stopped after 3; then a run that resumes
    kw = {"workers": WORKERS, "batch_size": BATCH}
    ray_train.train(str(work / "shards"), str(work), run="first", checkpoint_at=2, stop_at=3, **kw)
    result = ray_train.train(str(work / "shards"), str(work), run="resumed", **kw)
    assert result.error is None
    first, resumed = records(work, "first"), records(work, "resumed")
    assert sorted(first) == sorted(resumed) == list(range(WORKERS))
    per_rank = -(-IMAGES // WORKERS)
    steps = -(-per_rank // BATCH)  # 25 samples per rank: 7 batches, the last of one
    for rank in range(WORKERS):
        assert [b["step"] for b in first[rank]] == [1, 2, 3]
        assert [b["step"] for b in resumed[rank]] == list(range(3, steps + 1))
        # the batch trained after the checkpoint, before the stop, is trained again: the resume is exact
        assert resumed[rank][0]["indices"] == first[rank][2]["indices"]
    seen = [i for rank in range(WORKERS) for b in first[rank][:2] + resumed[rank] for i in b["indices"]]
    assert Counter(seen) == Counter(range(IMAGES))  # each sample exactly once across ranks and both runs
    ranks = [{i for b in first[r][:2] + resumed[r] for i in b["indices"]} for r in range(WORKERS)]
    assert not ranks[0] & ranks[1] and len(ranks[0]) == len(ranks[1]) == per_rank
    assert result.checkpoint is not None and result.metrics["step"] == 2
