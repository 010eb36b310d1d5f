"""Parquet image sets before any image is read: naming the files, finding the image and label columns,
and the index of (file, row group, row) built from the footers and the label column, cached on the
files' identities. pyarrow is imported on first use (`pyarrow_parquet`), never with the package.

Files: one ``.parquet`` file; a folder of them, or a Hugging Face snapshot (its ``data/*.parquet``); a
brace pattern (``train-{00000..00003}.parquet``) or a glob (``data/train-*.parquet``). A folder holding
files of several splits (``train-00000-of-00004.parquet`` beside ``test-00000-of-00001.parquet``) is
refused: a pattern names the split.

The columns are found by `parquet_columns.find_columns`. Class names come from the ``ClassLabel``
feature (the schema metadata under ``huggingface``), from a dictionary column (pandas' ``Categorical``,
Polars' ``Enum``: its dictionary's order), from a string label column (sorted), or else are the labels
seen ("0" .. the largest). With a list column of targets, each row's class label is 0. A Hugging Face
image that is a path reference (``{bytes: null, path: ...}``: what ``Dataset.to_parquet`` writes for
images made from files) is listed in the index with its path.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_write
from ..text import plural
from .base import read_parallel
from .member_index import names_blob
from .parquet_columns import Columns, find_columns
from .shards import SHARD_SUFFIXES, expand_braces, refuse_mixed_folder

log = logging.getLogger(__name__)

PARQUET_INSTALL = "pip install 'dali-fast[parquet]'"
INDEX_VERSION = 4  # 2: no null counts per row group; 3: target lists; 4: dictionary order, path references
HF_SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}")  # `datasets`' file names: train-00000-of-00004[-hash]


class ParquetUnavailable(ImportError, ValueError):
    """pyarrow is not installed: a one-line error that says how to install it (a ValueError for the CLI)."""


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or `ParquetUnavailable` saying ``pip install 'dali-fast[parquet]'``."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ParquetUnavailable(f"reading Parquet needs pyarrow: {PARQUET_INSTALL}") from e
    return pq


# ---------------------------------------------------------------------------------------------- the files
def folder_files(root: str, found: Sequence[str]) -> list[str]:
    """The Parquet files of a folder, local or at a URL: its own, else those of its ``data/`` folder (a
    Hugging Face snapshot). ``found``: the .parquet paths under ``root``, joined with ``/``, in order."""
    for where in (root, f"{root}/data"):
        mine = [p for p in found if p.rsplit("/", 1)[0] == where]
        if mine:
            return mine
    return []


def _folder_files(folder: Path) -> list[Path]:
    """`folder_files` of a local folder (a folder that is not there holds none)."""
    found = sorted(str(p) for where in (folder, folder / "data") for p in where.glob("*.parquet") if p.is_file())
    return [Path(p) for p in folder_files(str(folder), found)]


def is_parquet(path: str | os.PathLike) -> bool:
    """Whether ``path`` names Parquet files: a name or pattern ending in ``.parquet``, or a folder holding
    .parquet files (directly or in its ``data/`` folder). A folder that also holds WebDataset shards is
    refused in one line (`refuse_mixed_folder`), as it is at a URL."""
    text = str(path)
    if text.endswith(".parquet"):
        return True
    p = Path(text)
    if not p.is_dir():
        return False
    found = _folder_files(p)
    if found:
        refuse_mixed_folder(text, sorted(e.name for e in p.iterdir() if e.name.endswith(SHARD_SUFFIXES)), found)
    return bool(found)


def expand_parquet(spec: str | os.PathLike) -> list[Path]:
    """The files ``spec`` names (see the module docstring), sorted within each pattern; a missing file, a
    pattern matching nothing, and a folder of several splits are one-line errors."""
    text = str(spec)
    if Path(text).is_dir():
        files = _folder_files(Path(text))
        if not files:
            raise FileNotFoundError(f"{text}: no .parquet files in this folder or in its data/ folder")
        check_one_split([str(f) for f in files], text)
        return files
    names: list[str] = []
    for pattern in expand_braces(text):
        if any(c in pattern for c in "*?["):
            found = sorted(glob.glob(pattern))
            if not found:
                raise FileNotFoundError(f"{pattern}: the pattern matches no file")
            names += found
        else:
            names.append(pattern)
    missing = [n for n in names if not Path(n).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{missing[0]}{more}: no such Parquet file")
    return [Path(n) for n in names]


def check_one_split(files: Sequence[str], where: str) -> None:
    """Refuse, in one line naming the pattern to use, ``files`` (paths or URLs) of several Hugging Face
    splits (``train-00000-of-00002.parquet`` beside ``test-00000-of-00001.parquet``): a folder's or a
    snapshot's files are one split, locally and at a URL."""
    splits: dict[str, int] = {}
    for f in files:
        m = HF_SHARD.match(f.rsplit("/", 1)[-1])
        split = m.group("split") if m else ""
        splits[split] = splits.get(split, 0) + 1
    if len(splits) > 1:
        named = ", ".join(f"{s or '(other)'} ({plural(n, 'file')})" for s, n in sorted(splits.items()))
        first = next(s for s in sorted(splits) if s)
        folder = files[0].rsplit("/", 1)[0]
        raise ValueError(
            f"{where}: holds the files of several splits: {named}; open one split with a pattern, "
            f"e.g. open_dataset('{folder}/{first}-*.parquet')"
        )


def local_identity(path: str | os.PathLike) -> str:
    """What a replacement of a local file changes: size, mtime, inode, device and ctime (a file restored
    with its old size and mtime is still a new inode or ctime). Remote files use their ETag instead."""
    st = os.stat(path)
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}|{st.st_ctime_ns}"


# ---------------------------------------------------------------------------------------------- the index
@dataclass
class ParquetIndex:
    """The rows of ``files`` (with their identities), by row group: each group's rows, file and image bytes
    (uncompressed, from the footer); each row's label and whether it is null; the columns and the class
    names."""

    files: list[str]
    identities: list[str]
    columns: Columns
    group_rows: np.ndarray
    group_file: np.ndarray
    group_bytes: np.ndarray
    labels: np.ndarray
    null_label: np.ndarray
    names: list[str] | None = None
    target_values: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))  # a list column's lists
    target_ends: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # each row's end in them
    ref_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # rows whose image is a path
    ref_names: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))  # their paths (`names_blob`)
    ref_ends: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def save(self, path: Path) -> None:
        arrays = {k: getattr(self, k) for k in _ARRAYS}
        meta = {"files": self.files, "identities": self.identities, "names": self.names, "columns": vars(self.columns)}
        arrays["meta"] = np.asarray(json.dumps(meta).encode())
        try:
            atomic_write(path, lambda f: np.savez(f, **arrays))
        except OSError as e:  # a read-only cache folder costs the next open a new index, nothing more
            log.warning("cannot save the Parquet index to %s (%s); set DALI_FAST_CACHE to a writable folder", path, e)

    @classmethod
    def load(cls, path: Path) -> ParquetIndex | None:
        try:
            with np.load(path) as z:
                arrays = {k: z[k] for k in _ARRAYS}
                meta = json.loads(bytes(z["meta"]))
        except (OSError, KeyError, ValueError):
            return None
        c = meta["columns"]
        names = c["names"] and tuple(c["names"])
        columns = Columns(c["image"], c["image_field"], c["label"], c["label_kind"], names, c.get("path_field"))
        return cls(meta["files"], meta["identities"], columns, **arrays, names=meta["names"])


_ARRAYS = (
    "group_rows", "group_file", "group_bytes", "labels", "null_label", "target_values", "target_ends",
    "ref_rows", "ref_names", "ref_ends",
)  # fmt: skip


def index_key(
    files: Sequence[tuple[str, str]], image_column: str | None, label_column: str | None, lists: bool = False
) -> str:
    """The cache key of an index: the columns asked for (and whether the labels are lists) and each file's
    name and identity."""
    h = hashlib.sha1(f"v{INDEX_VERSION}|{image_column}|{label_column}|{lists}".encode())
    for name, identity in files:
        h.update(f"{name}|{identity}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def load_or_build(
    files: Sequence[tuple[str, str]],
    open_file: Callable[[int], Any],
    *,
    image_column: str | None,
    label_column: str | None,
    cache: Path,
    lists: bool = False,
) -> tuple[ParquetIndex, Path]:
    """The index of ``files`` ((name, identity) pairs; ``open_file(k)`` opens file ``k`` as a
    ``pyarrow.parquet.ParquetFile``), from ``cache`` or built and saved there; and its path."""
    path = cache / f"{index_key(files, image_column, label_column, lists)}.npz"
    index = ParquetIndex.load(path)
    if index is None:
        index = build_index(files, open_file, image_column=image_column, label_column=label_column, lists=lists)
        index.save(path)
    return index, path


def build_index(
    files: Sequence[tuple[str, str]],
    open_file: Callable[[int], Any],
    *,
    image_column: str | None,
    label_column: str | None,
    lists: bool = False,
) -> ParquetIndex:
    """The index of ``files`` from their footers and label columns (no image is read), the files read
    in parallel; files whose columns differ from the first file's are refused in one line."""
    log.info("indexing %s (footers and label column)", plural(len(files), "Parquet file"))  # pragma: no mutate
    columns = find_columns(open_file(0).schema_arrow, image_column, label_column, files[0][0], lists)
    parts = read_parallel(lambda k: _index_file(open_file(k), columns, files[k][0]), range(len(files)))
    group_rows = np.concatenate([p[0] for p in parts])
    group_file = np.concatenate([np.full(len(p[0]), k, np.int32) for k, p in enumerate(parts)])
    group_bytes = np.concatenate([p[1] for p in parts])
    labels, null_label, names, lists_read = _labels([p[2] for p in parts], columns)
    index = ParquetIndex(
        [name for name, _ in files], [identity for _, identity in files], columns,
        group_rows, group_file, group_bytes, labels, null_label, names, *lists_read,
    )  # fmt: skip
    starts = np.cumsum([0] + [int(p[0].sum()) for p in parts[:-1]])
    refs = [(int(start) + row, path) for p, start in zip(parts, starts, strict=True) for row, path in p[3]]
    if refs:
        index.ref_rows = np.array([row for row, _ in refs], dtype=np.int64)
        index.ref_names, index.ref_ends = names_blob([path for _, path in refs])
    return index


def _index_file(pf: Any, columns: Columns, where: str) -> tuple[np.ndarray, np.ndarray, Any, list[tuple[int, str]]]:
    """One file's rows and image bytes per row group, its label column (an Arrow array), and its path
    references: (row in the file, path) of each image stored as a path with no bytes."""
    mine = find_columns(pf.schema_arrow, columns.image, columns.label, where, columns.label_kind == "list")
    if mine != columns:
        raise ValueError(
            f"{where}: its columns differ from the first file's ({mine} against {columns}); "
            "a data set's files share one schema: open them separately"
        )
    md = pf.metadata
    leaf = [md.schema.column(j).path for j in range(md.num_columns)].index(columns.image_leaf)
    groups = [md.row_group(g) for g in range(md.num_row_groups)]
    rows = np.fromiter((g.num_rows for g in groups), np.int64, len(groups))
    nbytes = np.fromiter((g.column(leaf).total_uncompressed_size for g in groups), np.int64, len(groups))
    labels = pf.read(columns=[columns.label], use_threads=False).column(0)  # pragma: no mutate (threads: speed only)
    return rows, nbytes, labels, _path_references(pf, columns, leaf, rows)


def _path_references(pf: Any, columns: Columns, leaf: int, rows: np.ndarray) -> list[tuple[int, str]]:
    """(row in the file, path) of the rows whose image bytes are null and whose path is not. The footer's
    null count of the bytes says which row groups can hold one: only those are read (their bytes and
    paths; in a file of path references the bytes column is all nulls, a few bytes a row)."""
    if columns.path_field is None:
        return []
    import pyarrow.compute as pc

    found: list[tuple[int, str]] = []
    md = pf.metadata
    for g, start in enumerate(np.concatenate([[0], np.cumsum(rows)[:-1]]).tolist()):
        stats = md.row_group(g).column(leaf).statistics
        if stats is not None and stats.has_null_count and stats.null_count == 0:
            continue
        leaves = [f"{columns.image}.{columns.image_field}", f"{columns.image}.{columns.path_field}"]
        column = pf.read_row_group(g, columns=leaves, use_threads=False).column(0)  # pragma: no mutate
        data, path = (pc.struct_field(column, f) for f in (columns.image_field, columns.path_field))
        refs = pc.and_(pc.is_null(data), pc.is_valid(path))
        for row in np.flatnonzero(refs.to_numpy(zero_copy_only=False)).tolist():
            found.append((start + row, str(path[row])))
    return found


def _labels(columns_read: list[Any], columns: Columns) -> tuple[np.ndarray, np.ndarray, list[str] | None, tuple]:
    """(int64 labels, null mask, class names from a string column or None, and for a list column its
    (values, ends): `targets.ListTargets`'s) of every row, in order; a null label is -1 in the labels and
    True in the mask. A list column's rows have the label 0 (-1 where the list is null); a null inside a
    list is NaN, which makes that row's target bad."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if columns.label_kind == "str" and all(pa.types.is_dictionary(c.type) for c in columns_read):
        return _dictionary_labels(columns_read)
    arrays = [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in columns_read]
    whole = pa.chunked_array([chunk for a in arrays for chunk in a.chunks], type=arrays[0].type)
    null = whole.is_null().to_numpy(zero_copy_only=False).astype(bool)
    names = None
    if columns.label_kind == "list":
        ends = np.cumsum(pc.fill_null(pc.list_value_length(whole), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        flat = pc.list_flatten(whole).cast(pa.float64())
        values = flat.to_numpy(zero_copy_only=False).astype(np.float64) if len(flat) else np.empty(0, np.float64)
        return np.where(null, -1, 0).astype(np.int64), null, None, (values, ends)
    if columns.label_kind == "str":
        names = sorted(str(s) for s in pc.unique(whole).to_pylist() if s is not None)
        whole = pc.index_in(whole, value_set=pa.array(names, whole.type))
    labels = pc.fill_null(whole.cast(pa.int64()), -1).to_numpy().astype(np.int64)
    return labels, null, names, ()


def _dictionary_labels(columns_read: list[Any]) -> tuple[np.ndarray, np.ndarray, list[str], tuple]:
    """The labels of a dictionary column of class names (pandas' ``Categorical``, Polars' ``Enum``), as
    indices into its dictionary, in the dictionary's order: the order its writer declared, unused classes
    included, the same in every split written with that dictionary. Dictionaries that differ between
    files or row groups are unified (the first one's order, then each new name as it comes)."""
    import pyarrow as pa

    kind = pa.dictionary(pa.int32(), pa.large_string())
    chunks = [chunk.cast(kind) for a in columns_read for chunk in a.chunks]
    whole = pa.chunked_array(chunks, type=kind).unify_dictionaries()
    names = [str(n) for n in whole.chunks[0].dictionary.to_pylist()] if whole.num_chunks else []
    indices = [c.indices.fill_null(-1).to_numpy(zero_copy_only=False) for c in whole.chunks]
    labels = np.concatenate(indices).astype(np.int64) if indices else np.empty(0, np.int64)
    return labels, labels < 0, names, ()
