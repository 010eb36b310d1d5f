"""Deprecated: `DALIIterator` lives in `dali_fast.loaders.dali_iterator` now."""

from ._moved import moved

__getattr__ = moved(__name__, {"DALIIterator": "dali_fast.loaders.dali_iterator"})
