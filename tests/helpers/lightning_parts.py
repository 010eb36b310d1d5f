"""A Lightning callback that records the labels each stage saw, and a small model: the parts the Lightning
tests train with, in the test process and in DDP's processes."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from framework_loaders import N


class Recorder(pl.Callback):
    """What each stage saw: (epoch, labels) per training batch, labels per val/test/predict batch."""

    def __init__(self):
        self.train: list[tuple[int, list[int]]] = []
        self.val: list[list[int]] = []
        self.test: list[list[int]] = []
        self.predict: list[list[int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train.append((trainer.current_epoch, batch[1].tolist()))

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val.append(batch[1].tolist())

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.test.append(batch[1].tolist())

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.predict.append(batch[1].tolist())

    def epoch(self, e: int) -> list[int]:
        return [i for ep, labels in self.train if ep == e for i in labels]


class Model(pl.LightningModule):
    """A linear model over 16 px images; its loaders are the callables in ``loaders`` by stage."""

    def __init__(self, loaders=None):
        super().__init__()
        self.lin = torch.nn.Linear(3 * 16 * 16, N)
        self.loaders = loaders or {}

    def forward(self, x):
        return self.lin(x.flatten(1))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        pass

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return self.loaders.get("train", list)()

    def val_dataloader(self):
        return self.loaders.get("val", list)()

    def test_dataloader(self):
        return self.loaders.get("test", list)()

    def predict_dataloader(self):
        return self.loaders.get("predict", list)()


def leave_group() -> None:
    """Take down the process group Lightning's DDP leaves up, before the script ends. gloo's worker threads
    drop the last collective's tensors; with the group still up when Python exits, that can land after
    finalization began and abort the process ("terminate called without an active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
