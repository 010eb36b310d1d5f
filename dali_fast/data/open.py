"""`open_dataset`: the one place that knows every kind of data set, and which reader opens it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .base import Reader
from .folder import ImageFolderReader
from .format import INDEX_FILE
from .packed import MemmapReader
from .parquet_index import is_parquet
from .remote.store import is_remote
from .shards import expand_braces, is_webdataset
from .webdataset import WebDatasetReader


def open_dataset(
    path: str | os.PathLike,
    *,
    target: str | None = None,
    num_classes: int | None = None,
    classes: Sequence[str] | None = None,
    **reader_kw: object,
) -> Reader:
    """Open a packed data set (folder with ``index.bin``), WebDataset shards (``a.tar``, a folder of .tar
    files, or ``train-{000000..000146}.tar``; ``reader_kw`` go to `WebDatasetReader`), Parquet files (``a.parquet``,
    a folder of them or a Hugging Face snapshot, ``data/train-*.parquet``; ``reader_kw`` such as
    ``image_column=`` and ``label_column=`` go to `parquet.ParquetReader`, which needs pyarrow) or an
    ImageFolder root. A URL (``s3://``, ``gs://``, ``https://``, any fsspec URL) names remote WebDataset
    shards or Parquet files (a name or pattern ending in ``.parquet``, or a folder holding them), streamed
    through a node-local cache (`remote.RemoteShardsReader`, `remote.parquet.RemoteParquetReader`, which
    take the keywords).

    Args:
        path: the data set.
        target: what a sample's target is, and so what the loaders yield beside the images: ``"class"``
            (one class index, int64 ``(N,)``), ``"multihot"`` (float32 ``(N, num_classes)`` from a list of
            class indices) or ``"float"`` (float32 ``(N, D)`` from a list of D numbers, D the same for every
            sample). The lists come from each sample's ``.json`` (WebDataset: the list, or an object's
            ``"labels"``), from ``labels.csv`` beside an ImageFolder's class folders, from a Parquet list
            column (``label_column=``: a list of ints for multihot, a list of numbers for float), or from a
            pack made from any of them. None: the data set's own kind ("class", or what a pack was made with).
        num_classes: K, the number of classes of ``target="multihot"`` (a pack knows its own).
        classes: the class names in label order, for every split alike: a named class (a folder, a
            ``ClassLabel`` or string label, a pack's class) gets its name's index there; bare integer
            labels keep theirs, and the list names them. None: the data set's own classes. Give a
            validation set its training set's ``classes``, or a validation split that lacks a class numbers
            the others differently (`classes.class_map`; `classes.read_classes_file` reads a list from a file).
        **reader_kw: keywords of `WebDatasetReader`, `remote.RemoteShardsReader` or `parquet.ParquetReader`.
    """
    targets = {"target": target, "num_classes": num_classes, "classes": classes}
    if not str(path):  # Path("") is the current folder
        raise ValueError("the data set is an empty path (''); name a folder, shards or a URL")
    if is_remote(path):
        if _remote_parquet(str(path), reader_kw):
            if target not in (None, "class") or num_classes is not None:
                raise ValueError(
                    f"{path}: multi-hot and float targets of Parquet at a URL are not read yet; copy the files to "
                    "a local folder and open that, or pack them (dali-fast pack --target) and open the pack"
                )
            from .remote.parquet import RemoteParquetReader  # pyarrow, fsspec and its backends load with it

            return RemoteParquetReader(str(path), classes=classes, **reader_kw)  # type: ignore[arg-type]
        from .remote.webdataset import RemoteShardsReader  # fsspec and its backends load with it

        return RemoteShardsReader(str(path), **targets, **reader_kw)  # type: ignore[arg-type]
    p = Path(path)
    if is_parquet(path):
        from .parquet import ParquetReader  # pyarrow loads with it (a one-line error without it)

        return ParquetReader(str(path), **targets, **reader_kw)  # type: ignore[arg-type]
    if reader_kw.get("image_column") is not None or reader_kw.get("label_column") is not None:
        raise ValueError(f"{p}: image_column= and label_column= name the columns of Parquet files; this is not one")
    if p.is_dir() and (p / INDEX_FILE).exists():  # a pack, whatever else its folder holds
        return MemmapReader(p, **targets)
    if is_webdataset(path):
        return WebDatasetReader(str(path), **targets, **reader_kw)  # type: ignore[arg-type]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such data set; make one with `dali-fast make-synthetic {p}`")
    if p.is_dir() and ((p / "state.json").is_file() and any(p.glob("*.arrow")) or (p / "dataset_dict.json").is_file()):
        raise ValueError(
            f"{p}: a Hugging Face save_to_disk folder (Arrow files), which is read by datasets' load_from_disk; "
            "write it as Parquet (ds.to_parquet('train.parquet'), with the images embedded if they are paths: "
            "ds.with_format('arrow').map(datasets.table.embed_table_storage, batched=True)) and open that"
        )
    if p.is_dir() and any(d.is_dir() for d in p.iterdir()):
        return ImageFolderReader(p, **targets)
    raise ValueError(
        f"{p}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar), Parquet files (.parquet) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )


def _remote_parquet(url: str, reader_kw: dict[str, object]) -> bool:
    """Whether ``url`` names Parquet files: by the name it spells (a brace pattern's first choice), or for a
    folder (neither .tar nor .parquet at its end) by one listing of it."""
    name = expand_braces(url)[0]  # a pattern's first name: {a.parquet,b.parquet} -> a.parquet
    if name.endswith(".parquet"):
        return True
    if name.endswith(".tar") or name != url:
        return False
    from .remote.parquet_index import holds_parquet

    return holds_parquet(url, reader_kw.get("storage_options"))  # type: ignore[arg-type]
