"""`open_dataset`: the one place that knows every kind of data set, and which reader opens it."""

from __future__ import annotations

import os
from pathlib import Path

from .base import Reader
from .folder import ImageFolderReader
from .format import INDEX_FILE
from .packed import MemmapReader
from .parquet_index import is_parquet
from .remote.store import is_remote
from .shards import is_webdataset
from .webdataset import WebDatasetReader


def open_dataset(path: str | os.PathLike, **reader_kw: object) -> Reader:
    """Open a packed data set (folder with ``index.bin``), WebDataset shards (``a.tar``, a folder of .tar
    files, or ``train-{000000..000146}.tar``; ``reader_kw`` go to `WebDatasetReader`), Parquet files (``a.parquet``,
    a folder of them or a Hugging Face snapshot, ``data/train-*.parquet``; ``reader_kw`` such as
    ``image_column=`` and ``label_column=`` go to `parquet.ParquetReader`, which needs pyarrow) or an
    ImageFolder root. A URL (``s3://``, ``gs://``, ``https://``, any fsspec URL) names remote WebDataset
    shards, streamed through a node-local cache (`remote.RemoteShardsReader`, which takes the keywords)."""
    if not str(path):  # Path("") is the current folder
        raise ValueError("the data set is an empty path (''); name a folder, shards or a URL")
    if is_remote(path):
        if is_parquet(str(path).rstrip("/")):
            raise ValueError(
                f"{path}: Parquet in object storage is not read yet; copy the files to a local folder "
                "(e.g. `aws s3 sync`, `huggingface-cli download`) and open that"
            )
        from .remote.reader import RemoteShardsReader  # fsspec and its backends load with it

        return RemoteShardsReader(str(path), **reader_kw)  # type: ignore[arg-type]
    p = Path(path)
    if is_parquet(path):
        from .parquet import ParquetReader  # pyarrow loads with it (a one-line error without it)

        return ParquetReader(str(path), **reader_kw)  # type: ignore[arg-type]
    if reader_kw.get("image_column") is not None or reader_kw.get("label_column") is not None:
        raise ValueError(f"{p}: image_column= and label_column= name the columns of Parquet files; this is not one")
    if is_webdataset(path):
        return WebDatasetReader(str(path), **reader_kw)  # type: ignore[arg-type]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such data set; make one with `dali-fast make-synthetic {p}`")
    if p.is_dir() and (p / INDEX_FILE).exists():
        return MemmapReader(p)
    if p.is_dir() and any(d.is_dir() for d in p.iterdir()):
        return ImageFolderReader(p)
    raise ValueError(
        f"{p}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar), Parquet files (.parquet) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )
