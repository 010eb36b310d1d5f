"""dali_fast: feed the GPU. A DALI pipeline behind a PyTorch iterator, with a pure-PyTorch fallback.

Five wings under a thin face, data flowing one way (data -> transforms -> loaders -> train and tools ->
cli): ``data/``, ``transforms/``, ``loaders/``, ``train/``, ``tools/``. The face: this module's public
names (loaded on first use), ``cli`` (the `dali-fast` command) with ``cli_options`` (its parser) and
``cli_values`` (its value types), ``__main__``, ``lightning`` (`DaliFastDataModule`); and three helpers
every wing may use: ``machine`` (readings of the machine), ``files`` (atomic writes, cache folders) and
``text`` (counted nouns, progress bars).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Every public name loads on first use, so `import dali_fast` stays cheap (no torch, no DALI).
_HOME = {
    "BatchSizeController": ".loaders.controller",
    "CachedReader": ".data.cache",
    "DALIIterator": ".loaders.dali_iterator",
    "EpochSampler": ".loaders.order",
    "ImageFolderReader": ".data.folder",
    "LRUCache": ".data.cache",
    "MemmapReader": ".data.packed",
    "MixupCutmix": ".transforms.mix",
    "PackReport": ".data.pack.report",
    "Progressive": ".transforms.recipe",
    "Recipe": ".transforms.recipe",
    "RemoteDataError": ".data.remote.errors",
    "ShardReport": ".data.pack.tar_writer",
    "TorchIterator": ".loaders.torch_iterator",
    "create_optimized_dataloader": ".loaders.dataloader",
    "gather_outputs": ".train.distributed",
    "make_dataloader": ".loaders.dataloader",
    "make_loader": ".loaders.factory",
    "make_synthetic": ".data.synthetic",
    "normalize_images": ".transforms.batch",
    "open_dataset": ".data.open",
    "pack": ".data.pack.packed",
    "write_shards": ".data.pack.tar_writer",
}

__all__ = [
    "BatchSizeController",
    "CachedReader",
    "DALIIterator",
    "EpochSampler",
    "ImageFolderReader",
    "LRUCache",
    "MemmapReader",
    "MixupCutmix",
    "PackReport",
    "Progressive",
    "Recipe",
    "RemoteDataError",
    "ShardReport",
    "TorchIterator",
    "create_optimized_dataloader",
    "gather_outputs",
    "make_dataloader",
    "make_loader",
    "make_synthetic",
    "normalize_images",
    "open_dataset",
    "pack",
    "write_shards",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'dali_fast' has no attribute {name!r}")
    value = getattr(import_module(home, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


assert sorted(__all__) == __all__ and set(__all__) == set(_HOME)
