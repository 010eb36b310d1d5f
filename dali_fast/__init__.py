"""dali_fast: feed the GPU. A DALI pipeline behind a PyTorch iterator, with a pure-PyTorch fallback."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .cache import CachedReader, LRUCache
from .records import ImageFolderReader, MemmapReader, PackReport, open_dataset, pack
from .sampler import EpochSampler

__version__ = "0.1.0"

# Heavier modules (torch, DALI) load on first use, so `import dali_fast` stays cheap.
_LAZY = {
    "DALIIterator": "iterator",
    "TorchIterator": "fallback",
    "create_optimized_dataloader": "fallback",
    "make_loader": "fallback",
    "BatchSizeController": "controller",
    "make_synthetic": "synthetic",
    "Recipe": "recipe",
    "MixupCutmix": "recipe",
}

__all__ = [
    "CachedReader",
    "EpochSampler",
    "ImageFolderReader",
    "LRUCache",
    "MemmapReader",
    "PackReport",
    "open_dataset",
    "pack",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'dali_fast' has no attribute {name!r}")
