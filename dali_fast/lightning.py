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
then continues at the exact next sample; the module keeps the training loader's state in each checkpoint
too and restores it itself, where Lightning's counters would not: `DaliFastDataModule.load_state_dict`),
and under DDP the loader shards from the process group Lightning started. Validation, test and predict
loaders keep the data set's order.

Paths are checked when the module is made (not at their stage, maybe hours later), and a stage whose
data set was not given (``trainer.test()`` without ``test=``) raises in one line instead of running nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .data.base import Reader
from .data.format import INDEX_FILE
from .data.open import open_dataset
from .data.parquet_index import expand_parquet, is_parquet
from .data.remote.store import is_remote
from .data.shards import expand_shards, is_webdataset
from .data.targets import check_target
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
    ``target`` and ``num_classes`` open every path as `open_dataset` does: with ``target="multihot"`` or
    ``"float"`` the batches' second tensor is float32 target rows (a Reader given is used as it was opened).

    One class map serves every split: ``classes`` (a list of names, as `open_dataset` takes it), else
    the training set's own classes (else the first split given's), declared for the others when they are
    opened; so a validation split that lacks a class numbers the others as training does. A Reader given
    with other classes than that map is refused in one line.
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
        target: str | None = None,
        num_classes: int | None = None,
        classes: Sequence[str] | None = None,
        **loader_kw: Any,
    ) -> None:
        super().__init__()
        check_target(target, num_classes)
        if train is None and val is None and test is None and predict is None:
            raise ValueError("DaliFastDataModule needs at least one data set: train=, val=, test= or predict=")
        if backend not in ("auto", "dali", "torch"):
            raise ValueError(f"backend={backend!r}: use 'auto', 'dali' or 'torch'")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        self.paths = {"train": train, "val": val, "test": test, "predict": predict}
        for split, source in self.paths.items():
            _check_source(split, source)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.backend = backend
        self.image_size = image_size
        self.controller = controller
        self.loader_kw = loader_kw
        self.open_kw = {"target": target, "num_classes": num_classes}  # how paths are opened
        self.classes = None if classes is None else list(classes)  # the class map, once known
        self._readers: dict[str, Reader] = {}
        self._made: list[LoaderBase] = []  # closed at teardown: worker pools and pipelines end with the stage
        self._train: LoaderBase | None = None  # the training loader last made (its state goes in checkpoints)
        self._train_state: dict[str, Any] | None = None  # a restored state, for the next training loader

    def _reader(self, split: str) -> Reader:
        source = self.paths[split]
        if source is None:
            raise ValueError(f"DaliFastDataModule has no {split} data set; pass {split}=PATH")
        if split not in self._readers:
            first = next(s for s, given in self.paths.items() if given is not None)
            if self.classes is None and split != first:
                self.classes = list(self._reader(first).classes)  # the map, derived once from the first split
            if isinstance(source, Reader):
                if self.classes is not None and list(source.classes) != self.classes:
                    raise ValueError(
                        f"DaliFastDataModule: the {split} reader's classes ({len(source.classes)}: "
                        f"{', '.join(source.classes[:3])}, ...) are not the {first} set's; open it with "
                        f"open_dataset(path, classes=<the {first} set's classes>), or pass its path"
                    )
                reader = source
            else:
                reader = open_dataset(source, **self.open_kw, classes=self.classes)
            self.classes = list(reader.classes) if self.classes is None else self.classes
            self._readers[split] = reader
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

    def setup(self, stage: str) -> None:
        """Refuse, in one line, a stage with no data set (``trainer.test()`` without ``test=``) rather than
        run it over nothing. Fitting without ``val=`` is fine: Lightning then skips validation."""
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn, a str enum ("test", ...)
        split = _STAGE_SPLIT.get(stage)
        if split is not None and self.paths[split] is None:
            raise ValueError(
                f"DaliFastDataModule has no {split} data set, so trainer.{stage}() has nothing to run; "
                f"pass {split}=PATH to DaliFastDataModule"
            )

    def teardown(self, stage: str) -> None:
        """Shut down the loaders this module made (their worker processes or DALI pipelines)."""
        made, self._made = self._made, []
        for loader in made:
            loader.close()

    # Without val= there is no validation loader ([]): Lightning then skips validation while fitting.
    # The other splits are what their stage runs on: asked for without a data set, they raise (see setup).
    def train_dataloader(self) -> LoaderBase:
        loader = self._loader("train")
        saved, self._train_state = self._train_state, None
        if saved is not None:
            loader.load_state_dict(saved)
        self._train = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        """The training loader's state, in every checkpoint Lightning writes (beside its own copy of it)."""
        return {} if self._train is None else {"train_loader": self._train.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training loader from its state when it is made, whatever Lightning's own counters say:
        restored from a checkpoint written at an epoch's last batch, Lightning 2.6 skips the next epoch's
        start in its counters, so its next mid-epoch checkpoint looks like that epoch's start, and Lightning
        alone would restart the epoch there (what the loader had delivered came again)."""
        self._train_state = state_dict.get("train_loader")

    def val_dataloader(self) -> LoaderBase | list:
        return self._loader("val") if self.paths["val"] is not None else []

    def test_dataloader(self) -> LoaderBase:
        return self._loader("test")

    def predict_dataloader(self) -> LoaderBase:
        return self._loader("predict")


_STAGE_SPLIT = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}


def _check_source(split: str, source: Any) -> None:
    """A data set path that cannot be one, refused when the module is made (not at its stage, maybe hours
    later): a missing path, a brace pattern with a missing shard, a folder with no data set in it. Opening
    (indexes, folder scans) waits for the stage; remote URLs are checked when opened."""
    if source is None or isinstance(source, Reader) or is_remote(source):
        return
    if not isinstance(source, str | os.PathLike):
        raise ValueError(f"DaliFastDataModule: {split}={source!r}: pass a data set path (str or Path) or a Reader")
    text = os.fspath(source)
    where = f"DaliFastDataModule: {split}={text!r}"
    if is_parquet(text):
        try:
            expand_parquet(text)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        return
    if is_webdataset(text):
        try:
            expand_shards(text)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{where}: {e}") from None
        return
    path = Path(text)
    if not path.exists():
        raise FileNotFoundError(
            f"{where}: no such file or folder; pass a packed data set, WebDataset shards, Parquet files or an "
            "ImageFolder root"
        )
    if not path.is_dir() or not ((path / INDEX_FILE).exists() or any(d.is_dir() for d in path.iterdir())):
        raise ValueError(
            f"{where}: not a data set; expected a packed folder (index.bin, from `dali-fast pack`), "
            "WebDataset shards (.tar) or an ImageFolder root (ROOT/<class>/<image>)"
        )
