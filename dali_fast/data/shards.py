"""WebDataset tar shards: naming them (brace patterns, folders), walking a tar's headers, and WebDataset's
rules for what a sample is, applied to one shard at a time (`index_shard`). Local shards (`webdataset`)
and remote ones (`remote`) are both indexed here.

A shard ``train-000000.tar`` holds samples as members sharing a key: ``key.jpg`` (or ``.jpeg``, ``.png``)
with ``key.cls`` (the label as text) or ``key.json`` (the label under ``label_key``).
"""

from __future__ import annotations

import io
import json
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
LABEL_EXTENSIONS = ("cls", "json")
_BLOCK = 512


def expand_shards(spec: str | os.PathLike) -> list[Path]:
    """Shard paths from ``dir/`` (its .tar files, sorted), ``a.tar``, or a brace pattern such as
    ``train-{000000..000146}.tar`` or ``{train,val}-000.tar`` (as the webdataset package writes them)."""
    text = str(spec)
    if Path(text).is_dir():
        found = sorted(p for p in Path(text).iterdir() if p.name.endswith((".tar", ".tar.gz", ".tgz")))
        if not found:
            raise FileNotFoundError(f"{text}: no .tar shards in this folder")
        return found
    names = expand_braces(text)
    missing = [n for n in names if not Path(n).is_file()]
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


def _octal(field: bytes) -> int:
    text = field.rstrip(b"\0 ").strip()
    if not text:
        return 0
    if field[0] & 0x80:  # GNU base-256 for large sizes
        return int.from_bytes(field[1:], "big")
    return int(text, 8)


def scan_tar(path: Path) -> tuple[list[tuple[str, int, int]], str | None]:
    """(name, data offset, size) of each regular member of an uncompressed tar, and the reason the walk
    stopped early (a truncated or damaged shard), or None."""
    size = path.stat().st_size
    members: list[tuple[str, int, int]] = []
    if size == 0:
        return members, "empty file"
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    pos, long_name = 0, None
    while pos + _BLOCK <= size:
        header = bytes(buf[pos : pos + _BLOCK])
        if header == b"\0" * _BLOCK:
            return members, None  # the end-of-archive blocks
        if header[257:262] != b"ustar" and sum(header[148:156]) == 0:
            return members, f"not a tar header at byte {pos}"
        length = _octal(header[124:136])
        kind = header[156:157]
        start = pos + _BLOCK
        if start + length > size:
            name = long_name or header[:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
            return members, f"truncated: member {name} runs past the end"
        if kind == b"L":  # GNU long name: the next member's name is this member's data
            long_name = bytes(buf[start : start + length]).rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind in (b"0", b"\0", b"7"):
            name = long_name
            if name is None:
                name = header[:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
                prefix = header[345:500].rstrip(b"\0").decode("utf-8", "surrogateescape")
                if prefix and header[257:262] == b"ustar":
                    name = f"{prefix}/{name}"
            members.append((name, start, length))
            long_name = None
        else:  # directories, links, pax headers: not samples
            long_name = None if kind != b"x" else long_name
        pos = start + (length + _BLOCK - 1) // _BLOCK * _BLOCK
    return members, (None if pos == size else f"truncated: {size - pos} bytes after the last whole member")


def _split_key(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is everything before the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


@dataclass
class ShardIndex:
    """One shard's samples, in the shard's order: each image's offset and size in the shard, its label and
    name (``key.ext``); what was left out (``skipped``: (where, why)) and the other members, by extension."""

    offsets: np.ndarray
    sizes: np.ndarray
    labels: np.ndarray
    names: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: Counter[str] = field(default_factory=Counter)


def index_shard(path: Path, *, label_key: str = "label", on_error: str = "skip") -> ShardIndex:
    """Index one uncompressed shard by WebDataset's rules (the one place they live: local and remote
    shards are indexed by it). A sample is the members sharing a key; its image is ``.jpg``, ``.jpeg`` or
    ``.png``, its label a ``.cls`` (text) or the ``label_key`` field of a ``.json``. A sample without an
    image or a label, and a damaged shard, are left out and listed (``on_error="skip"``) or refused in one
    line naming the shard and key (``"raise"``)."""
    out = ShardIndex(np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.int64), [])

    def bad(where: str, reason: str) -> None:
        if on_error == "raise":
            raise ValueError(f"{where}: {reason}; fix the shard, or open it with on_error='skip'")
        out.skipped.append((where, reason))

    members, problem = scan_tar(path)
    if problem is not None:
        bad(str(path), problem)
    offsets, sizes, labels = [], [], []
    with open(path, "rb") as f:
        samples: dict[str, dict[str, tuple[int, int]]] = {}
        order: list[str] = []
        for name, offset, size in members:
            key, ext = _split_key(name)
            if ext not in IMAGE_EXTENSIONS and ext not in LABEL_EXTENSIONS:
                out.ignored[ext or "(none)"] += 1
                continue
            if key not in samples:
                samples[key] = {}
                order.append(key)
            samples[key][ext] = (offset, size)
        for key in order:
            parts = samples[key]
            image = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
            where = f"{path}:{key}"
            if image is None:
                bad(where, "no .jpg/.jpeg/.png member")
                continue
            label = _label(f, parts, label_key, where, bad)
            if label is None:
                continue
            offset, size = parts[image]
            offsets.append(offset)
            sizes.append(size)
            labels.append(label)
            out.names.append(f"{key}.{image}")
    out.offsets = np.asarray(offsets, dtype=np.uint64)
    out.sizes = np.asarray(sizes, dtype=np.uint64)
    out.labels = np.asarray(labels, dtype=np.int64)
    return out


def _label(
    f: io.BufferedReader,
    parts: dict[str, tuple[int, int]],
    label_key: str,
    where: str,
    bad: Callable[[str, str], None],
) -> int | None:
    try:
        if "cls" in parts:
            f.seek(parts["cls"][0])
            return int(f.read(parts["cls"][1]).decode().strip())
        if "json" in parts:
            f.seek(parts["json"][0])
            doc = json.loads(f.read(parts["json"][1]))
            if not isinstance(doc, dict) or label_key not in doc:
                bad(where, f"its .json has no {label_key!r}; pass label_key= the field with the label")
                return None
            return int(doc[label_key])
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        bad(where, f"unreadable label ({e})")
        return None
    bad(where, "no label (.cls, or .json with the label key)")
    return None


def refuse_compressed(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b" or path.name.endswith((".gz", ".tgz")):
        raise ValueError(
            f"{path}: a compressed tar has no random access; decompress it (gunzip) next to the others, "
            "or convert the shards with `dali-fast pack SHARDS DST`"
        )


def is_webdataset(path: str | os.PathLike) -> bool:
    """Whether ``path`` names WebDataset shards: a .tar, a brace pattern of them, or a folder of .tar files."""
    text = str(path)
    if "{" in text and ".tar" in text:
        return True
    p = Path(text)
    if p.is_file():
        return p.name.endswith((".tar", ".tar.gz", ".tgz"))
    if p.is_dir():
        entries = list(p.iterdir())
        return any(e.name.endswith(".tar") for e in entries) and not any(e.is_dir() for e in entries)
    return False
