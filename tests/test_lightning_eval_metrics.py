"""Exact evaluation under Lightning DDP: what docs/loaders.md says to log. With ranks one batch apart (97
records on 2 ranks: 49 and 48), a value logged with ``sync_dist=True`` is a mean of means whose weights
Lightning keeps as a floored integer; sums and counts logged with ``reduce_fx="sum"``, or a torchmetrics
metric, give the one-process number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torchmetrics")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
sys.path.insert(0, {helpers!r})
import pytorch_lightning as pl, torch, torchmetrics
from builders import IndexReader, jpeg_bytes
from framework_loaders import loader
from lightning_parts import leave_group

class Scores(pl.LightningModule):
    def __init__(self, data):
        super().__init__()
        self.data = data
        self.layer = torch.nn.Linear(1, 1)
        self.mean = torchmetrics.MeanMetric()

    def val_dataloader(self):
        return loader("torch", self.data, batch_size=8, train=False)

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        score = labels.double() + images.double().mean(dim=(1, 2, 3))  # one number per sample
        self.log("naive", score.mean(), sync_dist=True, batch_size=len(score))
        self.log("total", score.sum(), reduce_fx="sum", sync_dist=True)
        self.log("count", float(len(score)), reduce_fx="sum", sync_dist=True)
        self.mean.update(score)
        self.log("metric", self.mean)

data = IndexReader([jpeg_bytes(24 + i % 7, 20 + i % 3) for i in range(97)])
devices = int(sys.argv[1])
trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
out = trainer.validate(Scores(data), verbose=False)[0]
if trainer.global_rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({{k: float(v) for k, v in out.items()}}, f)
leave_group()
"""


@pytest.mark.slow
def test_sums_and_counts_or_torchmetrics_give_the_one_process_number_on_two_ranks(tmp_path):
    script = tmp_path / "eval.py"
    script.write_text(SCRIPT.format(helpers=str(ROOT / "tests" / "helpers")))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    got = {}
    for devices in (1, 2):
        out = tmp_path / f"{devices}.json"
        proc = subprocess.run(
            [sys.executable, str(script), str(devices), str(out)], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[devices] = json.loads(out.read_text())
    one, two = got[1], got[2]
    assert two["count"] == one["count"] == 97
    assert two["total"] / two["count"] == pytest.approx(one["total"] / one["count"], rel=1e-6)
    assert two["metric"] == pytest.approx(one["metric"], rel=1e-6) == one["total"] / one["count"]
    assert two["naive"] != pytest.approx(one["naive"], rel=1e-4)  # what the docs warn about, still so
