"""Deprecated: the packed format, its writer and the readers live in `dali_fast.data` now."""

from ._moved import moved

__getattr__ = moved(
    __name__,
    {
        "ImageFolderReader": "dali_fast.data.folder",
        "MemmapReader": "dali_fast.data.packed",
        "PackReport": "dali_fast.data.writer",
        "open_dataset": "dali_fast.data.open",
        "pack": "dali_fast.data.writer",
    },
)
