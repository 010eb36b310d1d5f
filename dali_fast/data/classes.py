"""The class map: one list of class names for every split of a data set, declared (``classes=``,
``--classes FILE``) or derived once from the training set, and a reader's own labels put on it.

A reader finds its own classes: folder names, a Parquet ``ClassLabel``, dictionary or string column, a
pack's ``meta.json``, or for bare integer labels the names ``"0"`` .. the largest label (*index names*).
Given a declared list (`class_map`):

- named classes are matched by name: a folder ``fish`` gets the index of ``"fish"`` in the list, whatever
  the split holds; a class with samples that the list lacks is a one-line error naming it;
- index names are the labels themselves: the list names them, and a label beyond it is a one-line error.

Derived maps (no list declared) depend on what a split holds: a validation split without one class of
the training split would number the others differently. `loaders.factory.make_loader`, Lightning's
`DaliFastDataModule` and ``dali-fast train`` therefore take the training set's classes and declare them for
the other splits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..text import plural

MAX_CLASSES = 10_000_000  # more class names than any model has outputs: a label beyond it is a wrong label


def index_names(count: int) -> list[str]:
    """The names of bare integer labels 0 .. count-1: their decimal text."""
    return [str(i) for i in range(count)]


def is_index_names(names: Sequence[str]) -> bool:
    """Whether ``names`` are `index_names` (the labels carry no names of their own)."""
    return all(name == str(i) for i, name in enumerate(names))


def classes_of_labels(labels: np.ndarray, source: Callable[[int], str]) -> list[str]:
    """The index names of bare integer ``labels`` ("0" .. the largest), refused in one line when the largest
    would make more than `MAX_CLASSES` classes (one stray label of 2^31 - 1 would otherwise allocate two
    billion names). ``source(i)`` names record ``i``."""
    top = int(labels.max()) if len(labels) else -1  # -1: no label (a null one is -1 too)
    if top >= MAX_CLASSES:
        at = int(np.argmax(labels))
        raise ValueError(
            f"{source(at)}: label {top} would make {top + 1:,} classes, more than {MAX_CLASSES:,}; a label is a "
            "class index 0..K-1: fix that label"
        )
    return index_names(top + 1)


def check_classes(classes: Sequence[str], where: str = "classes") -> list[str]:
    """``classes`` as a list of distinct, non-empty names, at most `MAX_CLASSES` of them; else one line."""
    if isinstance(classes, str | bytes) or not isinstance(classes, Sequence):
        raise ValueError(f"{where}: a list of class names, not {type(classes).__name__}")
    names = list(classes)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        other = bad[0]
        raise ValueError(f"{where}: class {other!r} is not a name; every class is a non-empty string")
    if not names:
        raise ValueError(f"{where}: no class names; list one name per class, in index order")
    if len(names) > MAX_CLASSES:
        raise ValueError(f"{where}: {len(names):,} classes, more than {MAX_CLASSES:,}")
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(f"{where}: class {name!r} is listed twice (indices {seen[name]} and {i}); list it once")
        seen[name] = i
    return names


def read_classes_file(path: str | os.PathLike) -> list[str]:
    """The class names in a file, in index order: a JSON list of names, a JSON object of name -> index
    (torchvision's ``class_to_idx``), or one name per line (blank lines ignored, the spaces around a name
    too). One line naming the file and what is wrong otherwise."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no such class list; give a file with one class name per line, or JSON") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot read the class list ({e}); give a UTF-8 text file") from None
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            doc = json.loads(stripped)
        except ValueError as e:
            raise ValueError(f"{p}: not valid JSON ({e}); give a JSON list of names, or one name per line") from None
        if isinstance(doc, dict):
            return _from_class_to_idx(doc, str(p))
        return check_classes(doc, str(p))
    return check_classes([line.strip() for line in text.splitlines() if line.strip()], str(p))


def _from_class_to_idx(doc: dict, where: str) -> list[str]:
    """A ``{name: index}`` object as the names in index order; the indices must be 0..K-1, each once."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in doc.values()):
        raise ValueError(f"{where}: a JSON object maps each class name to its index (an integer)")
    by_index = sorted(doc.items(), key=lambda kv: kv[1])
    for k, (name, index) in enumerate(by_index):
        if index != k:
            raise ValueError(
                f"{where}: class {name!r} has index {index}, where {k} was expected; the indices run 0..K-1, each once"
            )
    return check_classes([name for name, _ in by_index], where)


def class_map(
    own: Sequence[str] | None,
    labels: np.ndarray,
    declared: Sequence[str] | None,
    *,
    where: str,
    source: Callable[[int], str],
) -> tuple[list[str], np.ndarray | None]:
    """(classes, remap): the declared classes and, where the reader's own class ``k`` has another index
    there, ``remap[k]`` (an int64 array over the own classes; None when every label keeps its index).
    ``own`` None: bare integer labels (their classes are `classes_of_labels`). ``labels`` are the
    reader's own (int64; a negative one, or one beyond ``own``, is a bad label that the caller keeps bad).
    Without ``declared``, the reader's own classes. A class with samples that the declared list lacks, or
    a bare label beyond it, is one line naming it (``source(i)`` names record i)."""
    if declared is None:
        return (list(own) if own is not None else classes_of_labels(labels, source)), None
    names = check_classes(declared)
    valid = labels[(labels >= 0) & (labels < len(own))] if own is not None else labels[labels >= 0]
    used = np.unique(valid)
    if own is None or is_index_names(own):
        if len(used) and int(used[-1]) >= len(names):
            at = int(np.flatnonzero(labels == used[-1])[0])
            raise ValueError(
                f"{where}: {source(at)} has label {int(used[-1])}, beyond the {plural(len(names), 'declared class', 'declared classes')} "
                f"(0..{len(names) - 1}); declare every class of the data set (the training set's list)"
            )
        return names, None
    position = {name: i for i, name in enumerate(names)}
    missing = [own[k] for k in used.tolist() if own[k] not in position]
    if missing:
        at = int(np.flatnonzero(labels == own.index(missing[0]))[0])
        more = f" and {plural(len(missing) - 1, 'other class', 'other classes')}" if len(missing) > 1 else ""
        raise ValueError(
            f"{where}: class {missing[0]!r} (of {source(at)}){more} is not among the "
            f"{plural(len(names), 'declared class', 'declared classes')} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
            "a class every split shares gets one index: add it to the list, or leave its samples out"
        )
    remap = np.array([position.get(name, -1) for name in own], dtype=np.int64)
    if np.array_equal(remap, np.arange(len(own))) and len(own) == len(names):
        return names, None
    return names, remap


def remap_labels(labels: np.ndarray, remap: np.ndarray | None, own: int) -> np.ndarray:
    """``labels`` on the declared map: each valid own label through ``remap``; a bad one (outside
    ``0..own-1``) becomes -1, which stays bad on any map."""
    if remap is None:
        return labels
    out = np.full(labels.shape, -1, dtype=np.int64)
    ok = (labels >= 0) & (labels < own)
    out[ok] = remap[labels[ok]]
    return out


def classes_key(classes: Sequence[str]) -> str:
    """A short key of a class map, ``"K:digest"``: what a loader's state keeps of it, so that a resume on
    another map (the same labels meaning other classes) is refused."""
    h = hashlib.sha1("\n".join(classes).encode("utf-8", "surrogateescape"))
    return f"{len(classes)}:{h.hexdigest()[:12]}"
