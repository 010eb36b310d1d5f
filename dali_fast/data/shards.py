"""WebDataset tar shards: naming them (brace patterns, folders), walking a tar's headers, and WebDataset's
rules for what a sample is, applied to one shard at a time (`index_shard`). Local shards (`webdataset`)
and remote ones (`remote`) are both indexed here.

A shard ``train-000000.tar`` holds samples as members sharing a key: ``key.jpg`` (or ``.jpeg``, ``.png``)
with ``key.cls`` (the label as text) or ``key.json`` (the label under ``label_key``). Indexed with
``lists=True`` (for multihot or float targets), the ``.json`` holds the sample's target list instead: the
JSON is the list, or an object with the list under ``"labels"`` (a ``.cls``, if any, still gives the label).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..text import plural
from .classes import classes_of_labels
from .tar import scan_tar

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
LABEL_EXTENSIONS = ("cls", "json")
MAX_LABEL = 2**31 - 1  # what the packed format's label field holds
TARGET_KEY = "labels"  # where an object-shaped .json holds a sample's target list
SPARSE_LABELS = 100  # classes without a sample, beyond which a label range with more empty than used is named

log = logging.getLogger(__name__)
_MISSING = object()


def expand_shards(spec: str | os.PathLike) -> list[Path]:
    """Shard paths from ``dir/`` (its .tar files, sorted), ``a.tar``, or a brace pattern such as
    ``train-{000000..000146}.tar`` or ``{train,val}-000.tar`` (as the webdataset package writes them)."""
    text = str(spec)
    if Path(text).is_dir():
        found = sorted(p for p in Path(text).iterdir() if p.name.endswith(SHARD_SUFFIXES))
        if not found:
            raise FileNotFoundError(f"{text}: no .tar shards in this folder")
        return found
    names = expand_braces(text)
    missing = [n for n in names if not Path(n).is_file()]
    if len(names) > 1 and len(missing) == len(names):
        raise FileNotFoundError(f"{text}: the pattern matches no file (none of {names[0]} ... {names[-1]} exists)")
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{missing[0]}{more}: no such shard")
    return [Path(n) for n in names]


def expand_braces(text: str) -> list[str]:
    """``train-{000000..000002}.tar`` → the three names; ``{a,b}-0.tar`` → two (nested patterns too)."""
    m = re.search(r"\{([^{}]*)\}", text)
    if m is None:
        return [text]
    body, head, tail = m.group(1), text[: m.start()], text[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") else 0
        parts = [f"{k:0{width}d}" for k in range(int(lo), int(hi) + 1)]
    else:
        parts = body.split(",")
    return [s for p in parts for s in expand_braces(head + p + tail)]


_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: members it passes over (``__key__`` files)
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: key . extension(s)

# Why members form no sample (one text per rule, so that a warning can count them by rule).
NO_KEY = "no key: WebDataset's rule reads a name as key.extension, and this one has no dot in its file name"
DOTTED = (
    "a dot in the key's file name: WebDataset's rule ends a key at the file name's first dot, so the rest "
    "(such as 001.jpg) is the extension, and names no image or label; write keys without dots (img_001, not img.001)"
)
NO_IMAGE = "a label without an image: no .jpg/.jpeg/.png member under its key"
NO_LABEL = "no label (.cls, or .json with the label key)"
OTHER_ONLY = "members of other extensions only: no image and no label under its key"


def split_key(name: str) -> tuple[str, str] | None:
    """WebDataset's rule: (key, extension) of a member name, the key ending at the file name's first dot and
    the extension lowercased; None for a name without one (webdataset passes over such a member)."""
    m = _KEY_EXT.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


def _dotted(ext: str) -> bool:
    """Whether an extension is a dotted key's: ``001.jpg`` (more dots, the last part an image or label)."""
    return "." in ext and ext.rpartition(".")[2] in IMAGE_EXTENSIONS + LABEL_EXTENSIONS


@dataclass
class ShardIndex:
    """One shard's samples, in the shard's order: each image's offset and size in the shard, its label and
    name (``key.ext``); the samples left out (``skipped``: (shard:key, why)), what is known of damage to
    the shard itself (``damaged``: (shard, what); the samples it cost cannot be counted), and the members
    read by no sample although they belong to one, by extension (a caption's ``.txt``; ``(metadata)`` for
    ``__meta__`` files, ``(symbolic link)`` and such for what is not a regular file)."""

    offsets: np.ndarray
    sizes: np.ndarray
    labels: np.ndarray
    names: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: Counter[str] = field(default_factory=Counter)
    damaged: list[tuple[str, str]] = field(default_factory=list)
    target_values: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))  # with lists=True
    target_ends: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # each sample's end in them


def index_shard(path: Path, *, label_key: str = "label", on_error: str = "skip", lists: bool = False) -> ShardIndex:
    """Index one uncompressed shard by WebDataset's rules (the one place they live: local and remote
    shards are indexed by it). A sample is the members sharing a key; its image is ``.jpg``, ``.jpeg`` or
    ``.png``, its label a ``.cls`` (text) or the ``label_key`` field of a ``.json``. With ``lists``, its
    ``.json`` holds its target list (see the module docstring) and its label is its ``.cls`` or 0. A sample
    without an image or a label (or target list) is left out and listed (``skipped``), a damaged shard
    listed with what is known of it (``damaged``: where it ends; the samples after that are lost), with
    ``on_error="skip"``; ``"raise"`` refuses either in one line naming the shard (and key)."""
    out = ShardIndex(np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.int64), [])
    values: list[float] = []
    ends: list[int] = []

    def bad(where: str, reason: str, into: list[tuple[str, str]] = out.skipped) -> None:
        if on_error == "raise":
            raise ValueError(f"{where}: {reason}; fix the shard, or open it with on_error='skip'")
        into.append((where, reason))

    members, problem = scan_tar(path)
    if problem is not None:
        bad(str(path), problem, out.damaged)
    offsets, sizes, labels = [], [], []
    with open(path, "rb") as f:
        # WebDataset's grouping: a sample is a run of consecutive members with one key, so a key that comes
        # back later in the shard is another sample (the webdataset package yields both; so do we). Like
        # webdataset, it sees regular files only, and passes over ``__meta__`` members.
        samples: list[tuple[str, dict[str, tuple[int, int]], list[str], str]] = []
        for member in members:
            if member.kind != "file" or _META.match(member.name):
                out.ignored["(metadata)" if member.kind == "file" else f"({member.kind})"] += 1
                continue
            split = split_key(member.name)
            if split is None:
                bad(f"{path}:{member.name}", NO_KEY)
                continue
            key, ext = split
            if not samples or samples[-1][0] != key:
                samples.append((key, {}, [], member.name))
            parts, twice = samples[-1][1], samples[-1][2]
            if ext in parts and ext in IMAGE_EXTENSIONS + LABEL_EXTENSIONS:
                twice.append(ext)
            parts[ext] = (member.offset, member.size)
        for k, (key, parts, twice, first) in enumerate(samples):
            where = f"{path}:{key}"
            # In a damaged shard the last sample may have lost members to the damage: if it is incomplete,
            # it is among the samples the damage cost (said once, with the shard), not a sample left out.
            lost = problem is not None and k == len(samples) - 1
            fail = (lambda _w, _r: None) if lost else bad
            if twice:  # which of the two is meant cannot be told (webdataset refuses such a shard)
                fail(where, f"two .{twice[0]} members under one key, one after the other; keep one of them")
                continue
            image = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
            known = [e for e in parts if e in IMAGE_EXTENSIONS + LABEL_EXTENSIONS]
            if not known:
                images = [e for e in parts if _dotted(e) and e.rpartition(".")[2] in IMAGE_EXTENSIONS]
                if images:  # each dotted image is a sample its writer meant: named one by one
                    for e in images:
                        fail(f"{path}:{key}.{e}", DOTTED)
                else:
                    fail(f"{path}:{first}", DOTTED if any(_dotted(e) for e in parts) else OTHER_ONLY)
                continue
            if image is None:
                fail(where, NO_IMAGE)
                continue
            out.ignored.update(e for e in parts if e not in IMAGE_EXTENSIONS + LABEL_EXTENSIONS)
            target = _target_list(f, parts, where, fail) if lists else None
            if lists and target is None:
                continue
            label = _label(f, parts, label_key, where, fail) if not lists or "cls" in parts else 0
            if label is None:
                continue
            if target is not None:
                values += target
                ends.append(len(values))
            offset, size = parts[image]
            offsets.append(offset)
            sizes.append(size)
            labels.append(label)
            out.names.append(f"{key}.{image}")
    out.offsets = np.asarray(offsets, dtype=np.uint64)
    out.sizes = np.asarray(sizes, dtype=np.uint64)
    out.labels = np.asarray(labels, dtype=np.int64)
    out.target_values = np.asarray(values, dtype=np.float64)
    out.target_ends = np.asarray(ends, dtype=np.int64)
    return out


def _target_list(
    f: io.BufferedReader, parts: dict[str, tuple[int, int]], where: str, bad: Callable[[str, str], None]
) -> list[float] | None:
    """The sample's target list from its ``.json`` (the list itself, or an object's ``"labels"``), or None
    (then ``bad`` was told why)."""
    if "json" not in parts:
        bad(where, f"no .json member with its target list (a list, or an object with a {TARGET_KEY!r} list)")
        return None
    try:
        f.seek(parts["json"][0])
        doc = json.loads(f.read(parts["json"][1]))
    except (ValueError, UnicodeDecodeError) as e:
        bad(where, f"unreadable .json ({e})")
        return None
    found = doc.get(TARGET_KEY) if isinstance(doc, dict) else doc
    if not isinstance(found, list):
        bad(where, f"its .json is neither a list nor an object with a {TARGET_KEY!r} list")
        return None
    other = next((x for x in found if isinstance(x, bool) or not isinstance(x, int | float)), _MISSING)
    if other is not _MISSING:
        bad(where, f"its .json target list holds {other!r}, not a number")
        return None
    return [float(x) for x in found]


def _label(
    f: io.BufferedReader,
    parts: dict[str, tuple[int, int]],
    label_key: str,
    where: str,
    bad: Callable[[str, str], None],
) -> int | None:
    if "cls" not in parts and "json" not in parts:
        bad(where, NO_LABEL)
        return None
    try:
        if "cls" in parts:
            f.seek(parts["cls"][0])
            value: object = f.read(parts["cls"][1]).decode().strip()
            what = ".cls"
        else:
            f.seek(parts["json"][0])
            doc = json.loads(f.read(parts["json"][1]))
            value, what = (doc.get(label_key, _MISSING) if isinstance(doc, dict) else _MISSING), f".json {label_key!r}"
    except (ValueError, UnicodeDecodeError) as e:
        value, what = e, ""
    if isinstance(value, Exception):
        bad(where, f"unreadable label ({value})")
        return None
    if value is _MISSING:
        bad(where, f"its .json has no {label_key!r}; pass label_key= the field with the label")
        return None
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):  # "3" in a .cls or a .json
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LABEL:
        bad(where, f"label {value!r} in its {what}: a label is a whole number from 0 to {MAX_LABEL}")
        return None
    other = _json_label(f, parts, label_key) if what == ".cls" else _MISSING
    comparable = isinstance(other, int) and not isinstance(other, bool)  # a class name there names, not numbers
    if comparable and other != value:  # which of the two is meant cannot be told
        bad(where, f"its .cls says {value} and its .json {label_key!r} says {other!r}; keep one label")
        return None
    return value


def _json_label(f: io.BufferedReader, parts: dict[str, tuple[int, int]], label_key: str) -> object:
    """The ``label_key`` of a sample's ``.json`` beside its ``.cls`` ("3" read as 3), or `_MISSING` when
    there is none: no .json, another shape, or no such key."""
    if "json" not in parts:
        return _MISSING
    try:
        f.seek(parts["json"][0])
        doc = json.loads(f.read(parts["json"][1]))
    except (ValueError, UnicodeDecodeError):
        return _MISSING
    value = doc.get(label_key, _MISSING) if isinstance(doc, dict) else _MISSING
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    return value


def shard_classes(labels: np.ndarray, source: Callable[[int], str]) -> list[str]:
    """The class names of shards' ``labels`` ("0" .. the largest label; refused above `classes.MAX_CLASSES`),
    with a warning naming the largest label and the sample that carries it when most of that range has no
    sample (a stray .cls of 99999 would otherwise make 100,000 classes in silence). ``source(i)`` names
    sample ``i``."""
    names = classes_of_labels(labels, source)
    if not names:
        return names
    used = len(np.unique(labels))
    unused = len(names) - used
    if unused >= SPARSE_LABELS and unused > used:
        log.warning(
            "the largest label is %d (%s): %d classes, of which %s; check that label, or ignore this if "
            "the shards hold a subset of a larger label set",
            len(names) - 1,
            source(int(np.argmax(labels))),
            len(names),
            plural(used, "has samples", "have samples"),
        )
    return names


def describe_ignored(ignored: Counter[str]) -> str:
    """The members no sample reads, by extension: ``400 .txt, 2 (symbolic link)``."""
    return ", ".join(f"{n} {e}" if e.startswith("(") else f"{n} .{e}" for e, n in sorted(ignored.items()))


def refuse_compressed(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b" or path.name.endswith((".gz", ".tgz")):
        raise ValueError(
            f"{path}: a compressed tar has no random access; decompress it (gunzip) next to the others, "
            "or convert the shards with `dali-fast pack SHARDS DST`"
        )


SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def is_webdataset(path: str | os.PathLike) -> bool:
    """Whether ``path`` names WebDataset shards: a .tar, a brace pattern (which names shards: nothing else
    takes one), or a folder of .tar files. A folder is told by what it holds: shards, or class sub-folders
    (an ImageFolder); one holding both is refused in one line, naming one of each."""
    text = str(path)
    p = Path(text)
    if "{" in text and not p.exists() and expand_braces(text) != [text]:  # one shard's pattern too
        return True
    if p.is_file():
        return p.name.endswith(SHARD_SUFFIXES)
    if p.is_dir():
        entries = sorted(e for e in p.iterdir() if not e.name.startswith("."))
        shards = [e.name for e in entries if e.name.endswith(SHARD_SUFFIXES) and e.is_file()]
        folders = [e.name for e in entries if e.is_dir()]
        if shards and folders:
            raise ValueError(
                f"{p}: holds both WebDataset shards ({plural(len(shards), 'shard')}: {shards[0]}, ...) and sub-folders "
                f"({plural(len(folders), 'folder')}: {folders[0]}, ...); a data set is one or the other: move the "
                "shards or the class folders into a folder of their own"
            )
        return bool(shards)
    return False


def refuse_mixed_folder(folder: str, shards: Sequence[str], parquet: Sequence[Any]) -> None:
    """A folder holding both WebDataset shards (names) and Parquet files is one line naming one of each:
    which of them is the data set is not for a reader to guess."""
    if shards and parquet:
        first = str(parquet[0]).rstrip("/").rpartition("/")[2]
        raise ValueError(
            f"{folder}: holds both WebDataset shards ({plural(len(shards), 'shard')}: {shards[0]}, ...) and "
            f"Parquet files ({plural(len(parquet), 'file')}: {first}, ...); a data set is one or the other: "
            "move one kind into a folder of its own, or name its files (a pattern)"
        )
