"""`open_dataset`: the one place that knows every kind of data set, and which reader opens it."""

from __future__ import annotations

import os
from pathlib import Path

from .base import Reader
from .folder import ImageFolderReader
from .format import INDEX_FILE
from .packed import MemmapReader
from .remote_store import is_remote
from .shards import is_webdataset
from .webdataset import WebDatasetReader


def open_dataset(path: str | os.PathLike, **webdataset_kw: object) -> Reader:
    """Open a packed data set (folder with ``index.bin``), WebDataset shards (``a.tar``, a folder of .tar
    files, or ``train-{000000..000146}.tar``; ``webdataset_kw`` go to `WebDatasetReader`) or an
    ImageFolder root. A URL (``s3://``, ``gs://``, ``https://``, any fsspec URL) names remote WebDataset
    shards, streamed through a node-local cache (`remote.RemoteShardsReader`, which takes the keywords)."""
    if not str(path):  # Path("") is the current folder
        raise ValueError("the data set is an empty path (''); name a folder, shards or a URL")
    if is_remote(path):
        from .remote import RemoteShardsReader  # fsspec and its backends load with it

        return RemoteShardsReader(str(path), **webdataset_kw)  # type: ignore[arg-type]
    p = Path(path)
    if is_webdataset(path):
        return WebDatasetReader(str(path), **webdataset_kw)  # type: ignore[arg-type]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such data set; make one with `dali-fast make-synthetic {p}`")
    if p.is_dir() and (p / INDEX_FILE).exists():
        return MemmapReader(p)
    if p.is_dir() and any(d.is_dir() for d in p.iterdir()):
        return ImageFolderReader(p)
    raise ValueError(
        f"{p}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )
