"""Where a Parquet image set's images and labels are: the columns, found by type, by the Hugging Face
features in the schema's metadata, or by name (`find_columns`), and what kind each is.

The image is the column the Hugging Face ``Image`` feature names, else the one binary column or
``struct<bytes: binary, ...>`` column, else the binary column named ``image``, ``jpg``, ... (`IMAGE_NAMES`);
the label is the column of a ``ClassLabel`` feature, else an integer or string column named ``label``,
``cls``, ... (`LABEL_NAMES`). Multi-hot and float targets (``lists``) come from a list column (``list<int>``
or ``list<float>``: the one named, else the list column named ``labels``, ``label``, ..., or the only one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

IMAGE_NAMES = ("image", "img", "jpg", "jpeg", "png", "webp")  # binary columns taken as the image, by name
LABEL_NAMES = ("label", "labels", "cls", "class", "target", "category")  # columns taken as the label, by name

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
    path_field: str | None = None  # the struct's ``path`` field: where a null ``bytes`` names the image's file

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
            tagged = [n for n, f in features.items() if _list_names(f) is not None and schema.get_field_index(n) >= 0]
            hint = (
                f"; {tagged[0]!r} is a list of ClassLabel ({len(_list_names(features[tagged[0]]))} classes): "
                f"open it with target='multihot' (label_column={tagged[0]!r} if there are several)"
                if tagged
                else "; name it with label_column="
            )
            raise ValueError(
                f"{where}: no label column (a ClassLabel, or an integer or string column named "
                f"{'/'.join(LABEL_NAMES)}) among {described}{hint}"
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
        if kind == "list" and _list_names(features.get(label_column, {})) is not None:
            hint = " (a list of ClassLabel: open it with target='multihot', its names give num_classes)"
        raise ValueError(f"{where}: label_column={label_column!r} is {dtype}; {holds}{hint}")
    feature = features.get(label_column, {})
    names = _label_names(feature) if kind == "int" else _list_names(feature) if kind == "list" else None
    image_type = schema.field(image_column).type
    paths = "path" if image_field and image_type.get_field_index("path") >= 0 else None
    return Columns(image_column, image_field, label_column, kind, names, paths)


def _label_names(feature: Any) -> tuple[str, ...] | None:
    """The names of a ``ClassLabel`` feature (its ``names``, or "0".."K-1" for ``num_classes`` alone)."""
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names") or [str(k) for k in range(int(feature.get("num_classes") or 0))]
    return tuple(str(n) for n in names) or None


def _list_names(feature: Any) -> tuple[str, ...] | None:
    """The names of a list of ``ClassLabel`` (``Sequence(ClassLabel)`` in ``datasets`` before 4, ``List``
    after): what a multi-label column's indices name."""
    if not isinstance(feature, dict) or feature.get("_type") not in ("Sequence", "List", "LargeList"):
        return None
    return _label_names(feature.get("feature"))
