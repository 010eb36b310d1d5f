"""dali_fast with a real Hugging Face Accelerator (no mocks): prepare() leaves our loader as it is, and
under `accelerate launch` with 2 processes each rank gets its own shard from the loader itself."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[1]
N = 37

SCRIPT = """
import json, os, sys
sys.path.insert(0, {helpers!r})
import torch
from accelerate import Accelerator
from framework_loaders import loader, reader
backends, out = sys.argv[1].split(","), sys.argv[2]
acc = Accelerator(cpu=True)
for backend in backends:  # one launch, one process group, each backend in turn
    ld = loader(backend, reader(), batch_size=4)
    model = torch.nn.Linear(3 * 16 * 16, 37)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, prepared = acc.prepare(model, opt, ld)
    assert prepared is ld  # not a torch DataLoader: Accelerate leaves it (and its sharding) alone
    seen = []
    for epoch in range(2):
        prepared.set_epoch(epoch)
        labels = []
        for x, y in prepared:
            loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            labels += y.tolist()
        seen.append(labels)
    with open(os.path.join(out, f"{{backend}}-rank{{acc.process_index}}.json"), "w") as f:
        json.dump({{"epochs": seen, "world": acc.num_processes}}, f)
acc.wait_for_everyone()
acc.end_training()
"""


def _launch(tmp_path: Path, backends: list[str], nproc: int) -> dict[str, list[dict]]:
    """Run the script under ``nproc`` processes for each of ``backends``; per backend, each rank's record."""
    backend = ",".join(backends)
    script = tmp_path / "acc_run.py"
    script.write_text(SCRIPT.format(helpers=str(ROOT / "tests" / "helpers")))
    if nproc == 1:
        cmd = [sys.executable, str(script), backend, str(tmp_path)]
    else:
        # accelerate's torchrun launcher; `--cpu` with several processes would need MPI
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc)]
        cmd = [*launcher, "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += [str(script), backend, str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {b: [json.loads((tmp_path / f"{b}-rank{r}.json").read_text()) for r in range(nproc)] for b in backends}


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_prepare_in_one_process(backend):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from framework_loaders import loader, reader

    acc = Accelerator(cpu=True)
    try:
        ld = loader(backend, reader(), batch_size=8)
        model = torch.nn.Linear(3 * 16 * 16, N)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, prepared = acc.prepare(model, opt, ld)
        assert prepared is ld
        epochs = []
        for epoch in range(2):
            prepared.set_epoch(epoch)
            labels = []
            for x, y in prepared:
                acc.backward(torch.nn.functional.cross_entropy(model(x.flatten(1)), y))
                opt.step()
                opt.zero_grad()
                labels += y.tolist()
            epochs.append(labels)
        assert all(sorted(e) == list(range(N)) for e in epochs) and epochs[0] != epochs[1]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # noqa: SLF001 - one Accelerator per test


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_accelerate_without_a_process_group_is_not_sharded_by_rank(backend, monkeypatch, caplog):
    """The CPU case: the launcher says rank 1 of 2 (RANK/WORLD_SIZE), but `Accelerator()` without cpu=True
    starts no process group and runs each process alone. The loaders shard by what Accelerate really runs
    (one process: every sample), made before or after the Accelerator, and say so in one line."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from framework_loaders import loader, reader

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    early = loader(backend, reader(), batch_size=8)  # made before the Accelerator: the launcher's word
    assert (early.rank, early.world_size) == (1, 2)
    acc = Accelerator()
    try:
        assert acc.num_processes == 1 and not torch.distributed.is_initialized()
        late = loader(backend, reader(), batch_size=8)
        for ld in (early, late):
            with caplog.at_level(logging.WARNING, logger="dali_fast.loaders.base"):
                caplog.clear()
                labels = []
                for _, y in ld:
                    labels += y.tolist()
                for _batch in ld:  # a second epoch: the line is not repeated
                    pass
            assert sorted(labels) == list(range(N)), f"{len(labels)} of {N} samples: sharded by RANK/WORLD_SIZE"
            assert (ld.rank, ld.world_size) == (0, 1)
            assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
                "loader: RANK/WORLD_SIZE say rank 1 of 2, but Accelerate runs this process as rank 0 of 1 (no "
                "torch.distributed process group, so nothing synchronises the processes): sharding as rank 0 of 1, "
                "so each process reads all the data; on CPUs, make the Accelerator with cpu=True for distributed "
                "training"
            ]
            ld.close()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # noqa: SLF001 - one Accelerator per test


@pytest.mark.slow
def test_accelerate_launch_two_processes_each_rank_its_shard(tmp_path):
    backends = [b for b in ("dali", "torch") if b != "dali" or importlib.util.find_spec("nvidia.dali")]
    for ranks in _launch(tmp_path, backends, 2).values():
        assert [r["world"] for r in ranks] == [2, 2]
        for e in (0, 1):
            a, b = ranks[0]["epochs"][e], ranks[1]["epochs"][e]
            assert len(a) == len(b) == 19
            counts = Counter(a + b)
            assert set(counts) == set(range(N)) and sum(counts.values()) == N + 1  # disjoint but for one padded


def test_loader_state_round_trips_through_torch_save_weights_only(tmp_path):
    from builders import IndexReader, jpeg_bytes

    from dali_fast import BatchSizeController, TorchIterator

    ctrl = BatchSizeController(
        4, 16, probe=type("P", (), {"reset_peak": lambda s: None, "peak_fraction": lambda s: 0.1})()
    )
    data = IndexReader([jpeg_bytes() for _ in range(N)])
    ld = TorchIterator(data, 4, image_size=16, num_workers=0, controller=ctrl)
    epoch = iter(ld)
    next(epoch)
    del epoch
    state = {"loader": ld.state_dict()}
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)  # what Lightning and torch load by default
    assert loaded == state
