"""Deprecated: the DALI operators of the recipe live in `dali_fast.transforms.dali` now (the pipeline that
runs them, in `dali_fast.loaders.dali_pipeline`)."""

from ._moved import moved

__getattr__ = moved(
    __name__,
    {"augment": "dali_fast.transforms.dali", "default_num_threads": "dali_fast.transforms.dali"},
)
