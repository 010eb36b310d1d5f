"""`WebDatasetReader`: WebDataset tar shards read in place, with random access.

A shard ``train-000000.tar`` holds samples as members sharing a key: ``key.jpg`` (or ``.jpeg``, ``.png``)
with ``key.cls`` (the label as text) or ``key.json`` (the label under ``label_key``). The reader walks
the tar headers once, keeps an index of (shard, offset, size, label) per sample, and hands out
zero-copy views into the memory-mapped shards, so the sampler, both iterators, the cache, ``bench``
and ``train`` work on it unchanged. The index is saved under ``$DALI_FAST_CACHE/wds-index``, keyed by
the shards' paths, sizes and modification times, so opening the same shards again costs milliseconds.

What this is not: streaming from object storage. Random access needs the shards on a local or shared
file system; compressed shards (``.tar.gz``) have no random access and are refused with what to do.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .records import CheckedBatch, check_encoded, read_parallel
from .system import atomic_write, default_cache_dir

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
LABEL_EXTENSIONS = ("cls", "json")
INDEX_VERSION = 1
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
    names = _expand_braces(text)
    missing = [n for n in names if not Path(n).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{missing[0]}{more}: no such shard")
    return [Path(n) for n in names]


def _expand_braces(text: str) -> list[str]:
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
    return [s for p in parts for s in _expand_braces(head + p + tail)]


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


class WebDatasetReader:
    """The reader interface over WebDataset tar shards (see the module docstring).

    ``label_key`` names the label in ``.json`` members (used when a sample has no ``.cls``).
    ``on_error="skip"`` leaves out, counts and names samples without an image or a label and damaged
    shards; ``"raise"`` refuses them in one line naming the shard and member.
    """

    def __init__(
        self,
        shards: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        label_key: str = "label",
        on_error: str = "skip",
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        paths = expand_shards(shards) if isinstance(shards, str | os.PathLike) else [Path(p) for p in shards]
        if not paths:
            raise ValueError("no shards given")
        for p in paths:
            _refuse_compressed(p)
        self.shards = [p.resolve() for p in paths]
        self.label_key = label_key
        self.on_error = on_error
        self.path = self.shards[0].parent
        self.skipped: list[tuple[str, str]] = []
        self.ignored: Counter[str] = Counter()  # members with other extensions, by extension
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "wds-index"
        self.index_file = cache / f"{self._cache_key()}.npz"
        if not self._load_index():
            self._build_index()
            self._save_index()
        self._maps: list[np.memmap | None] = [None] * len(self.shards)
        labels = self._labels
        self.classes = [str(i) for i in range(int(labels.max()) + 1)] if len(labels) else []
        if self.skipped:
            log.warning(
                "%d samples left out of %d shards (first: %s: %s)",
                len(self.skipped),
                len(self.shards),
                *self.skipped[0],
            )
        if not len(self._labels):
            raise ValueError(f"{self.shards[0]}: no samples with an image and a label in {len(self.shards)} shard(s)")

    # ------------------------------------------------------------------ index
    def _cache_key(self) -> str:
        h = hashlib.sha1(f"v{INDEX_VERSION}|{self.label_key}|{self.on_error}".encode())
        for p in self.shards:
            st = p.stat()
            h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def _build_index(self) -> None:
        shard_ids, offsets, sizes, labels, names = [], [], [], [], []
        for s, path in enumerate(self.shards):
            members, problem = scan_tar(path)
            if problem is not None:
                self._bad(str(path), problem)
            with open(path, "rb") as f:
                samples: dict[str, dict[str, tuple[int, int]]] = {}
                order: list[str] = []
                for name, offset, size in members:
                    key, ext = _split_key(name)
                    if ext not in IMAGE_EXTENSIONS and ext not in LABEL_EXTENSIONS:
                        self.ignored[ext or "(none)"] += 1
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
                        self._bad(where, "no .jpg/.jpeg/.png member")
                        continue
                    label = self._label(f, parts, where)
                    if label is None:
                        continue
                    offset, size = parts[image]
                    shard_ids.append(s)
                    offsets.append(offset)
                    sizes.append(size)
                    labels.append(label)
                    names.append(f"{key}.{image}")
        self._shard = np.asarray(shard_ids, dtype=np.uint32)
        self._offset = np.asarray(offsets, dtype=np.uint64)
        self._size = np.asarray(sizes, dtype=np.uint64)
        self._labels = np.asarray(labels, dtype=np.int64)
        blob = "\n".join(names).encode("utf-8", "surrogateescape")
        self._names = np.frombuffer(blob, dtype=np.uint8).copy()
        self._name_ends = np.cumsum([len(n.encode("utf-8", "surrogateescape")) + 1 for n in names], dtype=np.int64)

    def _label(self, f: io.BufferedReader, parts: dict[str, tuple[int, int]], where: str) -> int | None:
        try:
            if "cls" in parts:
                f.seek(parts["cls"][0])
                return int(f.read(parts["cls"][1]).decode().strip())
            if "json" in parts:
                f.seek(parts["json"][0])
                doc = json.loads(f.read(parts["json"][1]))
                if not isinstance(doc, dict) or self.label_key not in doc:
                    self._bad(where, f"its .json has no {self.label_key!r}; pass label_key= the field with the label")
                    return None
                return int(doc[self.label_key])
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            self._bad(where, f"unreadable label ({e})")
            return None
        self._bad(where, "no label (.cls, or .json with the label key)")
        return None

    def _bad(self, where: str, reason: str) -> None:
        if self.on_error == "raise":
            raise ValueError(f"{where}: {reason}; fix the shard, or open it with on_error='skip'")
        self.skipped.append((where, reason))

    def _save_index(self) -> None:
        arrays = {
            "shard": self._shard,
            "offset": self._offset,
            "size": self._size,
            "labels": self._labels,
            "names": self._names,
            "name_ends": self._name_ends,
            "skipped": np.asarray(json.dumps([list(x) for x in self.skipped]).encode(), dtype=bytes),
            "ignored": np.asarray(json.dumps(dict(self.ignored)).encode(), dtype=bytes),
        }
        try:
            atomic_write(self.index_file, lambda f: np.savez(f, **arrays))
        except OSError as e:  # a read-only cache folder costs the next open a scan, nothing more
            log.warning(
                "cannot save the shard index to %s (%s); set DALI_FAST_CACHE to a writable folder", self.index_file, e
            )

    def _load_index(self) -> bool:
        try:
            with np.load(self.index_file) as z:
                self._shard, self._offset, self._size = z["shard"], z["offset"], z["size"]
                self._labels, self._names, self._name_ends = z["labels"], z["names"], z["name_ends"]
                self.skipped = [tuple(x) for x in json.loads(bytes(z["skipped"]))]
                self.ignored = Counter(json.loads(bytes(z["ignored"])))
        except (OSError, KeyError, ValueError):
            return False
        return True

    # ------------------------------------------------------------------ reader interface
    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def total_bytes(self) -> int:
        """Bytes of all images (the index's sizes)."""
        return int(self._size.sum())

    @property
    def fingerprint(self) -> str:
        return f"webdataset:{len(self)}:{self.index_file.stem[:16]}"

    def _map(self, shard: int) -> np.memmap:
        m = self._maps[shard]
        if m is None:
            m = self._maps[shard] = np.memmap(self.shards[shard], dtype=np.uint8, mode="r")
        return m

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = self._check(i)
        off, size = int(self._offset[j]), int(self._size[j])
        return self._map(int(self._shard[j]))[off : off + size], int(self._labels[j])

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """The images of ``indices``, read in parallel by the read pool, and their labels (an unreadable
        or shortened shard raises OSError)."""
        got, labels = self._read_members(indices, _read_member)
        return got, labels

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """`read_batch` with `check_encoded` on every image, in the reader threads (nothing checked the
        members before); a member that cannot be read is a bad record, not an error."""
        got, labels = self._read_members(indices, _read_member_checked)
        return [d for d, _ in got], labels, {pos: why for pos, (_, why) in enumerate(got) if why is not None}

    def _read_members(self, indices: Sequence[int], read: Callable) -> tuple[list, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        shards = [str(self.shards[s]) for s in self._shard[idx].tolist()]
        members = zip(shards, self._offset[idx].tolist(), self._size[idx].tolist(), strict=True)
        return read_parallel(read, list(members)), self._labels[idx]

    def source(self, i: int) -> str:
        """``shard.tar:member`` of record ``i``."""
        j = self._check(i)
        start = int(self._name_ends[j - 1]) if j else 0
        name = bytes(self._names[start : int(self._name_ends[j]) - 1]).decode("utf-8", "surrogateescape")
        return f"{self.shards[int(self._shard[j])]}:{name}"

    def _check(self, i: int) -> int:
        n, j = len(self), int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"record {i} out of range for a data set of {n} records")
        return j

    # DataLoader workers: reopen by paths (the index comes from the cache file).
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = [None] * len(self.shards)
        return state

    def __repr__(self) -> str:
        return f"WebDatasetReader({len(self.shards)} shards, records={len(self)}, classes={len(self.classes)})"


def _pread(member: tuple[str, int, int]) -> bytes:
    """The bytes of a (shard, offset, size) member: one positioned read (no shared file position)."""
    path, offset, size = member
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError(errno.EIO, f"the shard ends at byte {offset + len(data)}, inside this member; index it again")
    return data


def _read_member(member: tuple[str, int, int]) -> np.ndarray:
    return np.frombuffer(_pread(member), dtype=np.uint8)


def _read_member_checked(member: tuple[str, int, int]) -> tuple[np.ndarray | None, str | None]:
    try:
        data = _pread(member)
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    return np.frombuffer(data, dtype=np.uint8), check_encoded(data)


def _refuse_compressed(path: Path) -> None:
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
