"""Parquet image sets before any image is read: naming the files, finding the image and label columns,
and the index of (file, row group, row) built from the footers and the label column, cached on the
files' identities. pyarrow is imported on first use (`pyarrow_parquet`), never with the package.

Files: one ``.parquet`` file; a folder of them, or a Hugging Face snapshot (its ``data/*.parquet``); a
brace pattern (``train-{00000..00003}.parquet``) or a glob (``data/train-*.parquet``). A folder holding
files of several splits (``train-00000-of-00004.parquet`` beside ``test-00000-of-00001.parquet``) is
refused: a pattern names the split.

Columns, unless named: the image is the column the Hugging Face ``Image`` feature names, else the one
binary column or ``struct<bytes: binary, ...>`` column, else the binary column named ``image``, ``jpg``,
... (`IMAGE_NAMES`); the label is the column of a ``ClassLabel`` feature, else an integer or string
column named ``label``, ``cls``, ... (`LABEL_NAMES`). Class names come from the ``ClassLabel`` feature
(the schema metadata under ``huggingface``), from a string label column (sorted), or else are the labels
seen ("0" .. the largest). Multi-hot and float targets (``lists``) come from a list column (``list<int>``
or ``list<float>``: the one named, else the list column named ``labels``, ``label``, ..., or the only one);
each row's class label is then 0.
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
from .shards import SHARD_SUFFIXES, expand_braces, refuse_mixed_folder

log = logging.getLogger(__name__)

PARQUET_INSTALL = "pip install 'dali-fast[parquet]'"
INDEX_VERSION = 3  # 2: no null counts per row group; 3: target lists
IMAGE_NAMES = ("image", "img", "jpg", "jpeg", "png", "webp")  # binary columns taken as the image, by name
LABEL_NAMES = ("label", "labels", "cls", "class", "target", "category")  # columns taken as the label, by name
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
def _folder_files(folder: Path) -> list[Path]:
    """The folder's own .parquet files, else those of its ``data/`` folder (a Hugging Face snapshot)."""
    for where in (folder, folder / "data"):
        found = sorted(p for p in where.glob("*.parquet") if p.is_file())  # none in a folder that is not there
        if found:
            return found
    return []


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
        _one_split(files, text)
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


def _one_split(files: list[Path], where: str) -> None:
    splits: dict[str, int] = {}
    for f in files:
        m = HF_SHARD.match(f.name)
        split = m.group("split") if m else ""
        splits[split] = splits.get(split, 0) + 1
    if len(splits) > 1:
        named = ", ".join(f"{s or '(other)'} ({plural(n, 'file')})" for s, n in sorted(splits.items()))
        first = next(s for s in sorted(splits) if s)
        raise ValueError(
            f"{where}: holds the files of several splits: {named}; open one split with a pattern, "
            f"e.g. open_dataset('{files[0].parent / first}-*.parquet')"
        )


def local_identity(path: str | os.PathLike) -> str:
    """What a replacement of a local file changes: size, mtime, inode, device and ctime (a file restored
    with its old size and mtime is still a new inode or ctime). Remote files use their ETag instead."""
    st = os.stat(path)
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}|{st.st_ctime_ns}"


# -------------------------------------------------------------------------------------------- the columns
@dataclass(frozen=True)
class Columns:
    """Where the images and labels are: the image column (``image_field`` "bytes" for a Hugging Face
    ``struct<bytes, path>``, None for a binary column), the label column and its kind ("int", "str", or
    "list": a list column of target lists), and the ``ClassLabel`` names (None without that feature)."""

    image: str
    image_field: str | None
    label: str
    label_kind: str
    names: tuple[str, ...] | None = None

    @property
    def image_leaf(self) -> str:
        """The image bytes' column path in the file (what a read projects)."""
        return f"{self.image}.{self.image_field}" if self.image_field else self.image


def hf_features(schema: Any) -> dict[str, Any]:
    """The ``datasets`` features stored in the Arrow schema's metadata (``huggingface``), or {}."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw).get("info", {}).get("features", {}) if raw else {}
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def _image_field(dtype: Any) -> str | None | bool:
    """None for a binary column, "bytes" for a struct with a binary ``bytes`` field, False otherwise."""
    import pyarrow as pa

    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype):
        return None
    if pa.types.is_struct(dtype):
        k = dtype.get_field_index("bytes")
        if k >= 0 and (pa.types.is_binary(dtype.field(k).type) or pa.types.is_large_binary(dtype.field(k).type)):
            return "bytes"
    return False


def _label_kind(dtype: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype):
        value = dtype.value_type
        return "list" if pa.types.is_integer(value) or pa.types.is_floating(value) else None
    if pa.types.is_integer(dtype):
        return "int"
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "str"
    return None


def _pick(found: list[str], preferred: list[str], names: Sequence[str]) -> str | None:
    if len(preferred) == 1:
        return preferred[0]
    if len(found) == 1:
        return found[0]
    by_name = [n for n in names if n in found]
    return by_name[0] if by_name else None


def find_columns(
    schema: Any, image_column: str | None, label_column: str | None, where: str, lists: bool = False
) -> Columns:
    """The image and label columns of ``schema`` (see the module docstring), or one line naming the
    columns there are and the keyword that picks one. ``lists``: the label column is a list column."""
    features = hf_features(schema)
    described = ", ".join(f"{f.name}: {f.type}" for f in schema)
    for arg, name in (("image_column", image_column), ("label_column", label_column)):
        if name is not None and schema.get_field_index(name) < 0:
            raise ValueError(f"{where}: {arg}={name!r} is not a column; the columns are {described}")
    if image_column is None:
        found = [f.name for f in schema if _image_field(f.type) is not False]
        hf = [n for n in found if features.get(n, {}).get("_type") == "Image"]
        image_column = _pick(found, hf, IMAGE_NAMES)
        if image_column is None:
            what = f"{len(found)} image-like columns ({', '.join(found)})" if found else "no image column"
            raise ValueError(
                f"{where}: {what} (binary, or struct<bytes: binary, path: string>) among {described}; "
                "name it with image_column="
            )
    image_field = _image_field(schema.field(image_column).type)
    if image_field is False:
        raise ValueError(
            f"{where}: image_column={image_column!r} is {schema.field(image_column).type}; an image column is "
            "binary, or a struct with a binary 'bytes' field (the Hugging Face Image feature)"
        )
    if label_column is None and lists:
        found = [f.name for f in schema if f.name != image_column and _label_kind(f.type) == "list"]
        label_column = _pick(found, [], ("labels", *LABEL_NAMES))
        if label_column is None:
            raise ValueError(
                f"{where}: no target list column (list<int> or list<float>) named labels/{'/'.join(LABEL_NAMES)} "
                f"among {described}; name it with label_column="
            )
    if label_column is None:
        found = [f.name for f in schema if f.name != image_column and _label_kind(f.type) in ("int", "str")]
        hf = [n for n in found if features.get(n, {}).get("_type") == "ClassLabel"]
        label_column = hf[0] if len(hf) == 1 else next((n for n in LABEL_NAMES if n in found), None)
        if label_column is None:
            raise ValueError(
                f"{where}: no label column (a ClassLabel, or an integer or string column named "
                f"{'/'.join(LABEL_NAMES)}) among {described}; name it with label_column="
            )
    kind = _label_kind(schema.field(label_column).type)
    dtype = schema.field(label_column).type
    if kind is None or (kind == "list") != lists:
        holds = (
            "a target list column holds a list of class indices or numbers per row (list<int> or list<float>)"
            if lists
            else "a label column holds one class per row, as an integer or a class name"
        )
        hint = " (a list column is read with target='multihot' or 'float')" if kind == "list" else ""
        raise ValueError(f"{where}: label_column={label_column!r} is {dtype}; {holds}{hint}")
    feature = features.get(label_column, {})
    names = None
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and kind == "int":
        names = feature.get("names") or [str(k) for k in range(int(feature.get("num_classes") or 0))]
        names = tuple(str(n) for n in names) or None
    return Columns(image_column, image_field, label_column, kind, names)


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
        columns = Columns(c["image"], c["image_field"], c["label"], c["label_kind"], c["names"] and tuple(c["names"]))
        return cls(meta["files"], meta["identities"], columns, **arrays, names=meta["names"])


_ARRAYS = ("group_rows", "group_file", "group_bytes", "labels", "null_label", "target_values", "target_ends")


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
    return ParquetIndex(
        [name for name, _ in files], [identity for _, identity in files], columns,
        group_rows, group_file, group_bytes, labels, null_label, names, *lists_read,
    )  # fmt: skip


def _index_file(pf: Any, columns: Columns, where: str) -> tuple[np.ndarray, np.ndarray, Any]:
    """One file's rows and image bytes per row group, and its label column (an Arrow array)."""
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
    return rows, nbytes, labels


def _labels(columns_read: list[Any], columns: Columns) -> tuple[np.ndarray, np.ndarray, list[str] | None, tuple]:
    """(int64 labels, null mask, class names from a string column or None, and for a list column its
    (values, ends): `targets.ListTargets`'s) of every row, in order; a null label is -1 in the labels and
    True in the mask. A list column's rows have the label 0 (-1 where the list is null); a null inside a
    list is NaN, which makes that row's target bad."""
    import pyarrow as pa
    import pyarrow.compute as pc

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
