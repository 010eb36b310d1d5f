"""Deprecated: `TorchIterator` lives in `dali_fast.loaders.torch_iterator`, `make_loader` in
`dali_fast.loaders.factory` now."""

from ._moved import moved

__getattr__ = moved(
    __name__,
    {"TorchIterator": "dali_fast.loaders.torch_iterator", "make_loader": "dali_fast.loaders.factory"},
)
