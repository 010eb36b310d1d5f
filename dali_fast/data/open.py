"""`open_dataset`: the one place that knows every kind of data set, and which reader opens it."""

from __future__ import annotations

import os
from pathlib import Path

from .base import Reader
from .folder import ImageFolderReader
from .format import INDEX_FILE
from .packed import MemmapReader
from .remote.store import is_remote
from .shards import is_webdataset
from .webdataset import WebDatasetReader


def open_dataset(
    path: str | os.PathLike,
    *,
    target: str | None = None,
    num_classes: int | None = None,
    **webdataset_kw: object,
) -> Reader:
    """Open a packed data set (folder with ``index.bin``), WebDataset shards (``a.tar``, a folder of .tar
    files, or ``train-{000000..000146}.tar``; ``webdataset_kw`` go to `WebDatasetReader`) or an
    ImageFolder root. A URL (``s3://``, ``gs://``, ``https://``, any fsspec URL) names remote WebDataset
    shards, streamed through a node-local cache (`remote.RemoteShardsReader`, which takes the keywords).

    Args:
        path: the data set.
        target: what a sample's target is, and so what the loaders yield beside the images: ``"class"``
            (one class index, int64 ``(N,)``), ``"multihot"`` (float32 ``(N, num_classes)`` from a list of
            class indices) or ``"float"`` (float32 ``(N, D)`` from a list of D numbers, D the same for every
            sample). The lists come from each sample's ``.json`` (WebDataset: the list, or an object's
            ``"labels"``), from ``labels.csv`` beside an ImageFolder's class folders, or from a pack made from
            either. None: the data set's own kind ("class", or what a pack was made with).
        num_classes: K, the number of classes of ``target="multihot"`` (a pack knows its own).
        **webdataset_kw: keywords of `WebDatasetReader` or `remote.RemoteShardsReader`.
    """
    targets = {"target": target, "num_classes": num_classes}
    if is_remote(path):
        from .remote.reader import RemoteShardsReader  # fsspec and its backends load with it

        return RemoteShardsReader(str(path), **targets, **webdataset_kw)  # type: ignore[arg-type]
    p = Path(path)
    if is_webdataset(path):
        return WebDatasetReader(str(path), **targets, **webdataset_kw)  # type: ignore[arg-type]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such data set; make one with `dali-fast make-synthetic {p}`")
    if p.is_dir() and (p / INDEX_FILE).exists():
        return MemmapReader(p, **targets)
    if p.is_dir() and any(d.is_dir() for d in p.iterdir()):
        return ImageFolderReader(p, **targets)
    raise ValueError(
        f"{p}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )
