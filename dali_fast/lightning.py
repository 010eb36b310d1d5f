"""`DaliFastDataModule`: dali_fast's loaders for PyTorch Lightning in one line.

    from dali_fast.lightning import DaliFastDataModule
    trainer.fit(model, datamodule=DaliFastDataModule(train="data/train", val="data/val", batch_size=256))

Importing this module needs Lightning (``pip install 'dali-fast[lightning]'``): the class subclasses
the ``LightningDataModule`` of the Lightning package already imported (``lightning`` or
``pytorch_lightning``; the first of the two that imports otherwise), so it is accepted by that
package's ``Trainer``.

What Lightning does with our loaders, and why it is safe: it calls ``loader.sampler.set_epoch(epoch)``
each epoch (that is the loader's own ``set_epoch``, which keeps a resumed position), saves
``loader.state_dict()`` in its checkpoints and restores it with ``fit(ckpt_path=...)`` (the loader
then continues at the exact next sample), and under DDP the loader shards from the process group
Lightning started. Validation, test and predict loaders keep the data set's order.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .data.base import Reader
from .data.open import open_dataset
from .loaders.base import LoaderBase
from .loaders.controller import BatchSizeController
from .loaders.factory import make_loader


def _lightning_data_module() -> type:
    for name in ("lightning.pytorch", "pytorch_lightning"):  # the one the user already imported wins
        if name in sys.modules:
            return sys.modules[name].LightningDataModule
    try:
        import pytorch_lightning

        return pytorch_lightning.LightningDataModule
    except ImportError:
        pass
    try:
        import lightning.pytorch

        return lightning.pytorch.LightningDataModule
    except ImportError:
        raise ImportError(
            "dali_fast.lightning needs PyTorch Lightning: pip install 'dali-fast[lightning]' (or lightning)"
        ) from None


class DaliFastDataModule(_lightning_data_module()):  # type: ignore[misc]
    """Train/val/test/predict loaders over data set paths (ImageFolder or packed), made by `make_loader`.

    ``backend``: "auto" (DALI when it works here, else `TorchIterator`), "dali" or "torch". ``controller``:
    a `BatchSizeController` for the training loader. ``loader_kw`` go to every loader (``seed``,
    ``num_threads``, ``cache_bytes``, ``on_error``, ``memory_format``, ``recipe``, ...); a recipe with a
    resolution schedule (``Recipe(resolution=Progressive(...))``) sizes the training loader epoch by epoch
    through Lightning's own ``set_epoch`` calls, and the other loaders keep its ``image_size``. Loaders are made in the
    ``*_dataloader`` hooks, after Lightning has started the process group, so each rank gets its shard.
    """

    def __init__(
        self,
        train: str | os.PathLike | Reader | None = None,
        val: str | os.PathLike | Reader | None = None,
        test: str | os.PathLike | Reader | None = None,
        predict: str | os.PathLike | Reader | None = None,
        *,
        batch_size: int = 64,
        backend: str = "auto",
        image_size: int | None = None,
        controller: BatchSizeController | None = None,
        eval_batch_size: int | None = None,
        **loader_kw: Any,
    ) -> None:
        super().__init__()
        if train is None and val is None and test is None and predict is None:
            raise ValueError("DaliFastDataModule needs at least one data set: train=, val=, test= or predict=")
        if backend not in ("auto", "dali", "torch"):
            raise ValueError(f"backend={backend!r}: use 'auto', 'dali' or 'torch'")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        self.paths = {"train": train, "val": val, "test": test, "predict": predict}
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.backend = backend
        self.image_size = image_size
        self.controller = controller
        self.loader_kw = loader_kw
        self._readers: dict[str, Reader] = {}
        self._made: list[LoaderBase] = []  # closed at teardown: worker pools and pipelines end with the stage

    def _reader(self, split: str) -> Reader:
        source = self.paths[split]
        if source is None:
            raise ValueError(f"DaliFastDataModule has no {split} data set; pass {split}=PATH")
        if split not in self._readers:
            self._readers[split] = source if isinstance(source, Reader) else open_dataset(source)
        return self._readers[split]

    def _loader(self, split: str) -> LoaderBase:
        train = split == "train"
        loader = make_loader(
            self._reader(split),
            self.batch_size if train else self.eval_batch_size,
            backend=self.backend,
            train=train,
            image_size=self.image_size,
            controller=self.controller if train else None,
            **self.loader_kw,
        )
        self._made.append(loader)
        return loader

    def teardown(self, stage: str) -> None:
        """Shut down the loaders this module made (their worker processes or DALI pipelines)."""
        made, self._made = self._made, []
        for loader in made:
            loader.close()

    # A split without a data set gives no loaders ([]): Lightning then skips that stage's loop.
    def train_dataloader(self) -> LoaderBase | list:
        return self._loader("train") if self.paths["train"] is not None else []

    def val_dataloader(self) -> LoaderBase | list:
        return self._loader("val") if self.paths["val"] is not None else []

    def test_dataloader(self) -> LoaderBase | list:
        return self._loader("test") if self.paths["test"] is not None else []

    def predict_dataloader(self) -> LoaderBase | list:
        return self._loader("predict") if self.paths["predict"] is not None else []
