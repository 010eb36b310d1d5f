"""The packed record format, its writer (`pack`) and the readers.

A packed data set is a folder::

    dst/
      index.bin   HEADER_DTYPE (64 bytes) followed by `count` RECORD_DTYPE rows
      data.bin    the encoded images, concatenated
      paths.bin   the source paths (UTF-8), concatenated; rows point into it
      meta.json   class names and provenance (small; not per record)

Every number on disk is little-endian and declared once below. Opening reads the
64-byte header and memory-maps the rest, so it costs the same for ten records or
ten million.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

from .system import available_cpus

log = logging.getLogger(__name__)
T, R = TypeVar("T"), TypeVar("R")

MAGIC = b"DALIFAST"
FORMAT_VERSION = 2  # 2: the header carries a crc32 of the index rows (labels included) and the class count
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("record_size", "<u4"),
        ("count", "<u8"),
        ("data_size", "<u8"),
        ("paths_size", "<u8"),
        ("index_crc32", "<u4"),
        ("classes", "<u4"),
        ("shard_size", "<u8"),
        ("reserved", "<u8"),
    ]
)
RECORD_DTYPE = np.dtype(
    [
        ("offset", "<u8"),
        ("length", "<u4"),
        ("label", "<u4"),
        ("crc32", "<u4"),
        ("path_length", "<u4"),
        ("path_offset", "<u8"),
    ]
)
assert HEADER_DTYPE.itemsize == 64 and RECORD_DTYPE.itemsize == 32

INDEX_FILE, DATA_FILE, PATHS_FILE, META_FILE = "index.bin", "data.bin", "paths.bin", "meta.json"
SHARD_FILE = "data-{:05d}.bin"  # with a shard size: data-00000.bin, data-00001.bin, ... instead of data.bin


@runtime_checkable
class Reader(Protocol):
    """What every data set looks like to the loaders."""

    classes: list[str]

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> tuple[np.ndarray, int]: ...
    def source(self, i: int) -> str: ...


CheckedBatch = tuple[list[np.ndarray | None], np.ndarray, dict[int, str]]
"""A batch read with its checks: the records' bytes (None where unreadable), their int64 labels, and
``{position in the batch: why that record is bad}`` (empty when every record is good)."""


def _check_index(reader: Reader, i: int) -> int:
    n = len(reader)
    j = int(i)
    if j < 0:
        j += n
    if not 0 <= j < n:
        raise IndexError(f"record {i} out of range for a data set of {n} records")
    return j


def check_encoded(data: np.ndarray | bytes) -> str | None:
    """Structural check of an encoded image; returns the reason it is bad, or None.

    Catches what would otherwise kill a DALI pipeline, without decoding: empty records, bytes
    that are not JPEG/PNG, a broken JPEG marker structure or PNG chunk structure, and truncation
    (no end-of-image marker after the JPEG's first scan, no PNG IEND chunk). Data after the end
    of the image (phones' motion photos, editors' trailers) is allowed, as decoders allow it.

    It reads the headers, not the compressed image: the JPEG's end-of-image marker is looked for
    from the end, where a whole image has it. ``bytes`` are read in place; an array or another
    buffer is walked in place and its scan data copied once (no search over it either way).
    """
    buf = data if isinstance(data, bytes) else memoryview(np.ascontiguousarray(data, dtype=np.uint8)).cast("B")
    if not len(buf):
        return "empty record"
    if buf[:3] == JPEG_SOI:
        return _check_jpeg(buf)
    if buf[:8] == PNG_SIGNATURE:
        return _check_png(buf)
    return "not a JPEG or PNG (unknown signature)"


JPEG_SOI, JPEG_EOI = b"\xff\xd8\xff", b"\xff\xd9"  # a JPEG's first three bytes; its end-of-image marker
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # a PNG's last chunk: length 0, type IEND, its crc
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0-7: markers without a length
_JPEG_SOI_BYTES, _JPEG_EOI_BYTES = np.frombuffer(JPEG_SOI, np.uint8), np.frombuffer(JPEG_EOI, np.uint8)
_PNG_SIGNATURE_BYTES, _PNG_IEND_BYTES = np.frombuffer(PNG_SIGNATURE, np.uint8), np.frombuffer(PNG_IEND, np.uint8)
QUICK_MIN = 20  # bytes: records shorter (no real image is) get the full check instead of the quick look


def _check_jpeg(buf: bytes | memoryview) -> str | None:
    """Walk the marker segments to the first scan, then look for an end-of-image marker after it.

    Entropy-coded data cannot contain 0xFFD9 (0xFF is stuffed), and an EXIF thumbnail's own end
    marker sits inside an APP segment that the walk skips, so it cannot pass for the image's.
    The marker is searched from the end (`rfind`): at the last two bytes of a whole image, it is
    found at once, where a search from the scan's start would read the whole image.
    """
    n, pos = len(buf), 2
    for _ in range(n):  # each segment moves on by 2 bytes or more: bounded, whatever the bytes say
        while pos + 1 < n and buf[pos] == 0xFF and buf[pos + 1] == 0xFF:
            pos += 1  # fill bytes
        if pos + 2 > n:
            return "truncated JPEG (ends inside its headers)"
        if buf[pos] != 0xFF:
            return f"corrupt JPEG (no marker at byte {pos})"
        marker = buf[pos + 1]
        if marker == 0xD9:
            return "corrupt JPEG (end of image before any scan)"
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if pos + 4 > n:
            return "truncated JPEG (ends inside its headers)"
        length = (buf[pos + 2] << 8) | buf[pos + 3]
        if length < 2:
            return f"corrupt JPEG (segment length {length} at byte {pos})"
        end = pos + 2 + length
        if end > n:
            return "truncated JPEG (ends inside its headers)"
        if marker == 0xDA:  # start of scan: compressed data follows
            found = buf.rfind(JPEG_EOI, end) if isinstance(buf, bytes) else buf[end:].tobytes().rfind(JPEG_EOI)
            return None if found >= 0 else "truncated JPEG (no end-of-image marker)"
        pos = end
    return "truncated JPEG (no scan)"


def _check_png(buf: bytes | memoryview) -> str | None:
    """Walk the chunks (length, type, data, crc) to IEND."""
    n, pos = len(buf), 8
    for _ in range(n):  # each chunk moves on by 12 bytes or more: bounded
        if pos + 12 > n:
            return "truncated PNG (no IEND chunk)"
        length = int.from_bytes(buf[pos : pos + 4], "big")
        kind = bytes(buf[pos + 4 : pos + 8])
        if not kind.isalpha():
            return f"corrupt PNG (bad chunk type {kind!r} at byte {pos})"
        pos += 12 + length
        if pos > n:
            return "truncated PNG (a chunk runs past the end)"
        if kind == b"IEND":
            return None
    return "truncated PNG (no IEND chunk)"


def pillow_reason(error: BaseException) -> str:
    """Why Pillow could not read a record, without Pillow's `<_io.BytesIO object at 0x…>` stand-in for its name."""
    text = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the record", str(error))
    return f"undecodable: {type(error).__name__}: {text}"


def _read_classes(meta_path: Path) -> list[str]:
    """The class names in a packed set's meta.json, or a one-line error naming the file."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e}); pack the data set again") from None
    classes = meta.get("classes") if isinstance(meta, dict) else None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ValueError(f"{meta_path}: has no 'classes' list of names; pack the data set again")
    return classes


def check_label(label: int, classes: int) -> str | None:
    """Why ``label`` is not a class index of a data set with ``classes`` classes, or None."""
    if 0 <= label < classes:
        return None
    return f"label {label} is not one of the data set's {classes} classes (0..{classes - 1})"


# --------------------------------------------------------------------------- readers


class MemmapReader:
    """Read-only, memory-mapped reader of a packed data set.

    ``reader[i]`` returns a zero-copy ``uint8`` view of record ``i`` and its label.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._open()

    def _open(self) -> None:
        root = self.path
        index_path = root / INDEX_FILE
        for p in (index_path, root / PATHS_FILE, root / META_FILE):
            if not p.is_file():
                raise FileNotFoundError(
                    f"{p}: missing; {root} is not a complete packed data set, pack it again "
                    f"with `dali-fast pack SRC {root}`"
                )
        index_size = index_path.stat().st_size
        if index_size < HEADER_DTYPE.itemsize:
            raise ValueError(f"{index_path}: truncated header ({index_size} bytes); pack the data set again")
        header = np.fromfile(index_path, dtype=HEADER_DTYPE, count=1)[0]
        if bytes(header["magic"]) != MAGIC:
            raise ValueError(f"{index_path}: wrong magic {bytes(header['magic'])!r}; not a dali_fast index")
        version = int(header["version"])
        if version == 1:
            raise ValueError(
                f"{index_path}: format version 1 (an older dali_fast, whose labels were not checksummed), "
                f"this dali_fast reads version {FORMAT_VERSION}; pack the data set again with `dali-fast pack`"
            )
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{index_path}: format version {version}, this dali_fast reads version {FORMAT_VERSION}; "
                "pack the data set again with this version"
            )
        if int(header["record_size"]) != RECORD_DTYPE.itemsize:
            raise ValueError(f"{index_path}: record size {int(header['record_size'])} != {RECORD_DTYPE.itemsize}")
        count = int(header["count"])
        expected = HEADER_DTYPE.itemsize + count * RECORD_DTYPE.itemsize
        if index_size != expected:
            raise ValueError(
                f"{index_path}: {index_size} bytes, expected {expected} for {count} records (truncated?); "
                "pack the data set again"
            )
        data_size = int(header["data_size"])
        self.shard_size = int(header["shard_size"])
        data_paths = self._data_files(root)
        actual = sum(p.stat().st_size for p in data_paths)
        if actual != data_size:
            where = data_paths[0] if len(data_paths) == 1 else f"{root}/data-*.bin ({len(data_paths)} shards)"
            raise ValueError(
                f"{where}: {actual} bytes, the index says {data_size} (truncated or modified); pack the data set again"
            )
        paths_size = int(header["paths_size"])
        if (root / PATHS_FILE).stat().st_size != paths_size:
            raise ValueError(f"{root / PATHS_FILE}: size does not match the index; pack the data set again")
        self.classes: list[str] = _read_classes(root / META_FILE)
        if len(self.classes) != int(header["classes"]):
            raise ValueError(
                f"{root / META_FILE}: lists {len(self.classes)} classes, the index was written for "
                f"{int(header['classes'])}; pack the data set again"
            )
        self.index_crc32 = int(header["index_crc32"])
        self.count = count
        self.data_size = data_size
        self.records = (
            np.memmap(index_path, dtype=RECORD_DTYPE, mode="r", offset=HEADER_DTYPE.itemsize, shape=(count,))
            if count
            else np.zeros(0, RECORD_DTYPE)
        )
        self.shards = [
            np.memmap(p, dtype=np.uint8, mode="r") if p.stat().st_size else np.zeros(0, np.uint8) for p in data_paths
        ]
        self.data = self.shards[0] if not self.shard_size else None  # the one data file of an unsharded set
        # Plain-array views of the same maps, for the batch reads: slicing a memmap subclass costs a
        # Python-level __array_finalize__ per record, slicing an ndarray does not.
        self._rows = np.asarray(self.records)
        self._flat = [np.asarray(m) for m in self.shards]
        self._paths = np.memmap(root / PATHS_FILE, dtype=np.uint8, mode="r") if paths_size else np.zeros(0, np.uint8)

    def _data_files(self, root: Path) -> list[Path]:
        """data.bin, or the shards data-00000.bin ... in order (each must exist)."""
        if not self.shard_size:
            path = root / DATA_FILE
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path}: missing; {root} is not a complete packed data set, pack it again "
                    f"with `dali-fast pack SRC {root}`"
                )
            return [path]
        found = sorted(root.glob("data-*.bin"))
        expected = [root / SHARD_FILE.format(k) for k in range(len(found))]
        if not found or found != expected:
            raise FileNotFoundError(
                f"{root}: the data shards are not data-00000.bin ... data-{len(found) - 1:05d}.bin in sequence; "
                f"a shard is missing: pack it again with `dali-fast pack SRC {root}`"
            )
        return found

    def _view(self, offset: int, length: int) -> np.ndarray:
        if not self.shard_size:
            return self.shards[0][offset : offset + length]
        shard, local = divmod(offset, self.shard_size)  # a record never spans two shards
        return self.shards[shard][local : local + length]

    # Memmaps would pickle their whole contents: reopen by path instead (DataLoader workers).
    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._open()

    def __len__(self) -> int:
        return self.count

    @property
    def labels(self) -> np.ndarray:
        """All labels as an int64 array (reads the index column); refuses labels outside the classes."""
        labels = np.asarray(self.records["label"], dtype=np.int64)
        if len(labels) and int(labels.max()) >= len(self.classes):
            bad = int(np.argmax(labels >= len(self.classes)))
            raise ValueError(
                f"{self.path / INDEX_FILE}: record {bad} has label {int(labels[bad])}, but there are "
                f"{len(self.classes)} classes; check it with `dali-fast inspect --verify` and pack the data set again"
            )
        return labels

    @property
    def fingerprint(self) -> str:
        """Identifies the data set's contents (record count, data size, index checksum), e.g. for resuming."""
        return f"packed:{self.count}:{self.data_size}:{self.index_crc32:08x}"

    def index_intact(self) -> bool:
        """True when the index rows (offsets, lengths, labels, checksums) are as `pack` wrote them."""
        rows = self.records.tobytes() if self.count else b""
        return zlib.crc32(rows) == self.index_crc32

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rec = self.records[_check_index(self, i)]
        return self._view(int(rec["offset"]), int(rec["length"])), int(rec["label"])

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """Records for ``indices``: a list of zero-copy views and an int64 label array."""
        views, labels, _, _ = self._batch(indices)
        return views, labels

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """`read_batch` with the read-time checks, O(1) per record: (views, labels, {position: reason}).

        `pack` checked every record's structure (``verify`` decodes it; without it, `check_encoded`
        walks it) and stored its crc, so reading checks only what damage after packing would break
        first: the label is one of the classes, a JPEG starts with its SOI and ends with its EOI, a
        PNG starts with its signature and ends with IEND. Those bytes are gathered for the whole batch
        at once; the few records that do not pass (data after the image's end, damage) get the full
        `check_encoded`, which names what is wrong. Damage between the ends (in the headers or the
        compressed data) passes: the pipeline finds what breaks its decoder by decoding the failed
        batch's records one by one, and `verify` finds all of it beforehand by the crc.
        """
        views, labels, offsets, lengths = self._batch(indices)
        ok = (lengths >= QUICK_MIN) & (labels < len(self.classes))
        rows = np.flatnonzero(ok)  # the others are bad, or too short for the quick look: the full check decides
        edges = self._edges(offsets[rows], lengths[rows])
        heads, tails = edges[:, :8], edges[:, 8:]
        jpeg = (heads[:, :3] == _JPEG_SOI_BYTES).all(axis=1) & (tails[:, -2:] == _JPEG_EOI_BYTES).all(axis=1)
        png = (heads == _PNG_SIGNATURE_BYTES).all(axis=1) & (tails == _PNG_IEND_BYTES).all(axis=1)
        ok[rows] = jpeg | png
        bad: dict[int, str] = {}
        for pos in np.flatnonzero(~ok).tolist():  # rare: data after the image's end, or damage
            reason = check_label(int(labels[pos]), len(self.classes)) or check_encoded(views[pos])
            if reason is not None:
                bad[pos] = reason
        return views, labels, bad

    def _batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """(views, labels, offsets, lengths) of ``indices``, the arrays int64 (negative indices count from the end)."""
        rows = self._rows[np.asarray(indices, dtype=np.int64)]
        offsets, lengths = rows["offset"].astype(np.int64), rows["length"].astype(np.int64)
        if not self.shard_size:
            data = self._flat[0]
            views = [data[a:b] for a, b in np.stack([offsets, offsets + lengths], axis=1).tolist()]
        else:  # shard k holds the global offsets [k * size, (k + 1) * size); a record never spans two
            size, shards = self.shard_size, self._flat
            spans = np.stack([offsets // size, offsets % size, offsets % size + lengths], axis=1).tolist()
            views = [shards[k][a:b] for k, a, b in spans]
        return views, rows["label"].astype(np.int64), offsets, lengths

    def _edges(self, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The first 8 and last 12 bytes of records of ``QUICK_MIN`` bytes or more, as one (records, 20) uint8
        array, gathered from the maps at once (once per shard the records are in)."""
        at = np.concatenate(
            [offsets[:, None] + np.arange(8), (offsets + lengths)[:, None] - np.arange(12, 0, -1)], axis=1
        )
        span = self.shard_size or self.data_size  # unsharded: one shard, in which every such record starts
        shard = offsets // span
        out = np.empty(at.shape, np.uint8)
        for k in np.unique(shard).tolist():
            rows = shard == k
            out[rows] = self._flat[k][at[rows] - k * span]
        return out

    def source(self, i: int) -> str:
        """The path the record was packed from."""
        rec = self.records[_check_index(self, i)]
        off, n = int(rec["path_offset"]), int(rec["path_length"])
        return bytes(self._paths[off : off + n]).decode("utf-8", errors="surrogateescape")

    def verify(self, progress: bool = False) -> list[int]:
        """Check every record's crc32; returns the indices whose bytes do not match (see also `index_intact`)."""
        bad: list[int] = []
        it = range(self.count)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="verify", unit="rec")  # pragma: no mutate (display only)
        for i in it:
            view, _ = self[i]
            if zlib.crc32(view) != int(self.records[i]["crc32"]):
                bad.append(i)
        return bad

    def __repr__(self) -> str:
        return f"MemmapReader({str(self.path)!r}, records={self.count}, classes={len(self.classes)})"


# pragma: no mutate start (ImageFolder reading and the read pool's threads, which mutmut's tracing of tests does not follow)
def _scan_image_folder(root: Path) -> tuple[list[str], list[tuple[Path, int]], list[Path], list[tuple[str, str]]]:
    """Classes (sorted sub-folders), (file, label) pairs, files with other extensions, and the folders
    that could not be listed (with the reason): their files are left out, never silently."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items: list[tuple[Path, int]] = []
    other: list[Path] = []
    unlisted: list[tuple[str, str]] = []

    def failed(error: OSError) -> None:
        unlisted.append((str(error.filename), f"folder cannot be listed: {error.strerror or error}"))

    for label, name in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(root / name, onerror=failed):
            dirnames.sort()
            for f in sorted(filenames):
                p = Path(dirpath) / f
                if f.lower().endswith(IMAGE_EXTENSIONS):
                    items.append((p, label))
                elif not f.startswith("."):
                    other.append(p)
    return classes, items, other, unlisted


def read_checked(reader: Reader, i: int) -> tuple[np.ndarray | None, int, str | None]:
    """``reader[i]`` with the cheap checks: (bytes, label, None), or (bytes or None, label, why it is bad)."""
    data, label, reason = read_record(reader, i)
    if reason is None:
        reason = check_label(label, len(reader.classes)) or check_encoded(data)
    return data, label, reason


def read_batch_checked(reader: Reader, indices: Sequence[int]) -> CheckedBatch:
    """`read_checked` for a batch: through the reader's own ``read_batch_checked`` where it has one
    (a packed set checks in O(1) per record, folders and shards read in parallel), else record by record."""
    batch = getattr(reader, "read_batch_checked", None)
    if batch is not None:
        return batch(indices)
    datas: list[np.ndarray | None] = []
    labels: list[int] = []
    bad: dict[int, str] = {}
    for pos, i in enumerate(np.asarray(indices, dtype=np.int64).tolist()):
        data, label, reason = read_checked(reader, i)
        datas.append(data)
        labels.append(label)
        if reason is not None:
            bad[pos] = reason
    return datas, np.asarray(labels, dtype=np.int64), bad


READ_THREADS = 8  # files read at once per process: what hides a network file system's latency
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def read_pool() -> ThreadPoolExecutor:
    """This process's pool of ``READ_THREADS`` reader threads, shared by every reader; made on first use
    (and again in a forked child, which inherits the object but not its threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dali_fast-read")
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def read_parallel(read: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[read(x) for x in items]`` in order, by the read pool: the items split into one run per thread, so
    that slow reads (a network file system) overlap and the pool's bookkeeping is per run, not per item.
    An exception ``read`` raises reaches the caller once every run has finished: no read outlives the call."""
    if len(items) < 2:
        return [read(x) for x in items]
    step = -(-len(items) // READ_THREADS)
    runs = [read_pool().submit(_read_run, read, items[k : k + step]) for k in range(0, len(items), step)]
    wait(runs)  # every run done, so a failure is raised with no read still holding a file open
    return [r for run in runs for r in run.result()]


def _read_run(read: Callable[[T], R], items: Sequence[T]) -> list[R]:
    return [read(x) for x in items]


def _read_file(path: str) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        return np.frombuffer(f.readall(), dtype=np.uint8)


def _read_file_checked(path: str) -> tuple[np.ndarray | None, str | None]:
    """A file's bytes and why they are not an image (`check_encoded`), or (None, why it cannot be read)."""
    try:
        with open(path, "rb", buffering=0) as f:
            data = f.readall()
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    return np.frombuffer(data, dtype=np.uint8), check_encoded(data)


def read_record(reader: Reader, i: int) -> tuple[np.ndarray | None, int, str | None]:
    """``reader[i]`` as (bytes, label, None), or (None, -1, reason) when the record's file cannot be read
    (permissions, a broken symlink, a file that vanished): a bad record, handled like any other."""
    try:
        data, label = reader[i]
    except OSError as e:
        return None, -1, f"unreadable: {e.strerror or e}"
    return data, label, None


class ImageFolderReader:
    """The reader interface over an ImageFolder root (``root/<class>/<image>``), read on demand."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.path = Path(root)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such folder")
        self.classes, items, _, self.skipped = _scan_image_folder(self.path)
        for folder, reason in self.skipped:
            log.warning("left out %s: %s", folder, reason)
        if not items:
            raise ValueError(
                f"{self.path}: no .jpg/.jpeg/.png files under class sub-folders; expected ROOT/<class>/<image>"
            )
        self._files = [str(p) for p, _ in items]
        self._labels = np.array([lab for _, lab in items], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def fingerprint(self) -> str:
        """Identifies the folder's contents: each file's path, label, size and modification time."""
        h = zlib.crc32(b"")
        for path, label in zip(self._files, self._labels.tolist(), strict=True):
            try:
                st = os.stat(path)
                line = f"{path}\t{label}\t{st.st_size}\t{st.st_mtime_ns}\n"
            except OSError:
                line = f"{path}\t{label}\tunreadable\n"
            h = zlib.crc32(line.encode("utf-8", "surrogateescape"), h)
        return f"folder:{len(self._files)}:{h:08x}"

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = _check_index(self, i)
        with open(self._files[j], "rb") as f:
            data = f.read()
        return np.frombuffer(data, dtype=np.uint8), int(self._labels[j])

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """The files of ``indices``, read in parallel, and their labels; an unreadable file raises OSError."""
        idx = np.asarray(indices, dtype=np.int64)
        labels = self._labels[idx]
        return read_parallel(_read_file, [self._files[i] for i in idx.tolist()]), labels

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """`read_batch` with `check_encoded` on every file, in the reader threads: nothing checked these
        files before. An unreadable file is a bad record, not an error."""
        idx = np.asarray(indices, dtype=np.int64)
        labels = self._labels[idx]
        got = read_parallel(_read_file_checked, [self._files[i] for i in idx.tolist()])
        return [d for d, _ in got], labels, {pos: why for pos, (_, why) in enumerate(got) if why is not None}

    def source(self, i: int) -> str:
        return self._files[_check_index(self, i)]

    def __repr__(self) -> str:
        return f"ImageFolderReader({str(self.path)!r}, records={len(self)}, classes={len(self.classes)})"


# pragma: no mutate end


def open_dataset(path: str | os.PathLike, **webdataset_kw: object) -> Reader:
    """Open a packed data set (folder with ``index.bin``), WebDataset shards (``a.tar``, a folder of .tar
    files, or ``train-{000000..000146}.tar``; ``webdataset_kw`` go to `WebDatasetReader`) or an
    ImageFolder root. A URL (``s3://``, ``gs://``, ``https://``, any fsspec URL) names remote WebDataset
    shards, streamed through a node-local cache (`remote.RemoteShardsReader`, which takes the keywords)."""
    from .remote import is_remote
    from .webdataset import WebDatasetReader, is_webdataset

    if is_remote(path):
        from .remote import RemoteShardsReader

        return RemoteShardsReader(str(path), **webdataset_kw)  # type: ignore[arg-type]
    p = Path(path)
    if is_webdataset(path):
        return WebDatasetReader(str(path), **webdataset_kw)  # type: ignore[arg-type]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such data set; make one with `dali-fast make-synthetic {p}`")
    if p.is_dir() and (p / INDEX_FILE).exists():
        return MemmapReader(p)
    if p.is_dir() and any(d.is_dir() for d in p.iterdir()):
        return ImageFolderReader(p)
    raise ValueError(
        f"{p}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )


# --------------------------------------------------------------------------- writer


@dataclass
class PackReport:
    """What `pack` wrote and what it left out (with the reason for each)."""

    dst: Path
    records: int
    classes: int
    data_bytes: int
    reencoded: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"packed {self.records} records of {self.classes} classes ({self.data_bytes / 2**20:.1f} MiB) "
            f"into {self.dst} in {self.seconds:.1f}s; re-encoded {self.reencoded}, left out {len(self.skipped)}"
        )


# pragma: no mutate start (decoding and re-encoding with Pillow; its results are tested through pack)
def _prepare(raw: bytes, verify: bool, max_side: int | None) -> tuple[bytes | None, str | None, bool]:
    """(bytes to store, reason it was rejected, whether it was re-encoded)."""
    if not raw:
        return None, "empty file", False
    if not verify and max_side is None:
        reason = check_encoded(raw)
        return (None, reason, False) if reason else (raw, None, False)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as im:
            fmt = im.format
            if fmt not in ("JPEG", "PNG"):
                return None, f"unsupported format {fmt}; only JPEG and PNG are packed", False
            im.load()
            if max_side is not None and max(im.size) > max_side:
                scale = max_side / max(im.size)
                size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
                out = io.BytesIO()
                im.convert("RGB").resize(size, Image.BILINEAR, reducing_gap=3.0).save(out, "JPEG", quality=90)
                return out.getvalue(), None, True
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
        return None, pillow_reason(e), False
    return raw, None, False


def clean_stale(dst: Path) -> None:
    """Remove the temporary folders that killed `pack` or `make-synthetic` runs left beside ``dst``."""
    for tmp in dst.parent.glob(f".{dst.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            log.info("removing %s left by a killed run", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


# pragma: no mutate end


Source = str | tuple[str, int, int]  # a file, or (file, offset, size) of a member inside one (a tar shard)


@dataclass(frozen=True)
class _Item:
    """One image to pack: where its bytes are, its label, its name in reports and in paths.bin."""

    source: Source
    label: int
    shown: str
    stored: bytes


def _load_one(source: Source, verify: bool, max_side: int | None) -> tuple[bytes | None, str | None, bool]:
    """Read and prepare one image (in a worker process): (bytes to store, reason it was left out, re-encoded)."""
    try:
        if isinstance(source, tuple):
            with open(source[0], "rb") as f:
                f.seek(source[1])
                raw = f.read(source[2])
        else:
            raw = Path(source).read_bytes()
    except OSError as e:
        return None, f"unreadable: {e}", False
    return _prepare(raw, verify, max_side)


# pragma: no mutate start (runs only in worker processes, where mutmut cannot map tests to it; the
# byte-identical test of 1, 2 and 4 workers covers it)
def _load_chunk(
    sources: list[Source], verify: bool, max_side: int | None
) -> list[tuple[bytes | None, str | None, bool]]:
    return [_load_one(p, verify, max_side) for p in sources]


# pragma: no mutate end


PACK_CHUNK = 16  # images per task handed to a worker
PACK_WINDOW = 4  # tasks in flight per worker: what bounds the memory of a pack
PACK_SMALL = 256  # below this many images the default is one process (starting workers costs more)


def _prepared(
    items: list[_Item], verify: bool, max_side: int | None, workers: int
) -> Iterator[tuple[_Item, tuple[bytes | None, str | None, bool]]]:
    """(path, label, prepared) for each item, in order: in this process, or by ``workers`` processes with
    at most ``workers * PACK_WINDOW * PACK_CHUNK`` images in flight."""
    if workers <= 1:
        for item in items:
            yield item, _load_one(item.source, verify, max_side)
        return
    import multiprocessing
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    chunks = (items[i : i + PACK_CHUNK] for i in range(0, len(items), PACK_CHUNK))
    # fork, as DataLoader's workers on Linux: forkserver and spawn would re-run the caller's script in
    # every worker unless it guards itself with `if __name__ == "__main__"`.
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        pending: deque = deque()

        def submit() -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append((chunk, pool.submit(_load_chunk, [item.source for item in chunk], verify, max_side)))

        for _ in range(workers * PACK_WINDOW):
            submit()
        try:
            while pending:
                chunk, future = pending.popleft()
                submit()
                for item, result in zip(chunk, future.result(), strict=True):
                    yield item, result
        finally:
            for _, future in pending:
                future.cancel()


class _DataWriter:
    """Appends records to data.bin, or to shards of at most ``shard_size`` bytes; returns each one's offset."""

    def __init__(self, folder: Path, shard_size: int | None) -> None:
        self.folder, self.shard_size = folder, shard_size
        self.shard, self.used = 0, 0
        self.f = open(folder / (SHARD_FILE.format(0) if shard_size else DATA_FILE), "wb")  # noqa: SIM115

    def write(self, payload: bytes) -> int:
        if self.shard_size and self.used + len(payload) > self.shard_size and self.used:
            self._finish()
            self.shard, self.used = self.shard + 1, 0
            self.f = open(self.folder / SHARD_FILE.format(self.shard), "wb")  # noqa: SIM115
        at = self.shard * (self.shard_size or 0) + self.used
        self.f.write(payload)
        self.used += len(payload)
        return at

    def _finish(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def close(self) -> None:
        self._finish()


# pragma: no mutate start (progress display)
class _PackProgress:
    """tqdm with images/s and MB/s written."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        self.bytes = 0
        self.t0 = time.perf_counter()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="img")

    def update(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n % 64 == 0:
                mb_s = self.bytes / 2**20 / max(time.perf_counter() - self.t0, 1e-9)
                self.bar.set_postfix_str(f"{mb_s:.1f} MB/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# pragma: no mutate end


def pack(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    verify: bool = True,
    max_side: int | None = None,
    progress: bool = True,  # pragma: no mutate (display only)
    workers: int | None = None,
    shard_size: int | None = None,
) -> PackReport:
    """Pack an ImageFolder root into a packed data set at ``dst``, atomically.

    Classes are the sorted sub-folders of ``src`` (as in torchvision's ImageFolder).
    ``verify`` decodes each image once and leaves out what does not decode (listed in the
    report); ``max_side`` re-encodes larger images as JPEG (quality 90). Nothing appears at
    ``dst`` until the whole data set is written.

    ``workers`` processes (default: every CPU this process may use) read, verify and re-encode;
    one writer writes in the source order, so the output is byte-identical for any number of
    workers, and only a fixed number of images is in flight, whatever the data set's size.

    ``shard_size`` (bytes) writes the images into ``data-00000.bin``, ``data-00001.bin``, ... of at most
    that size each (no record spans two), under one index: files stay under file-system and object-store
    limits, and a record is still found in O(1) (its offset is shard * shard_size + offset in the shard).
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    from .webdataset import WebDatasetReader, is_webdataset

    shards = is_webdataset(src)
    if not shards and not src.is_dir():
        raise FileNotFoundError(f"{src}: no such folder; pack expects an ImageFolder root SRC/<class>/<image>")
    if dst.exists():
        raise FileExistsError(f"{dst}: already exists; remove it or choose another destination")
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side={max_side}: must be a positive number of pixels")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers}: must be 1 or more")
    if shard_size is not None and shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: must be a positive number of bytes")
    if shards:  # WebDataset shards: converted to a packed set
        wds = WebDatasetReader(str(src))
        classes, other, unlisted = wds.classes, [], list(wds.skipped)
        items = []
        for i in range(len(wds)):
            shard = str(wds.shards[int(wds._shard[i])])  # noqa: SLF001 - the index, read in the workers
            name = wds.source(i)
            items.append(
                _Item((shard, int(wds._offset[i]), int(wds._size[i])), int(wds._labels[i]), name, os.fsencode(name))
            )  # noqa: SLF001
    else:
        classes, found, other, unlisted = _scan_image_folder(src)
        items = [_Item(str(p), label, str(p), os.fsencode(p.relative_to(src))) for p, label in found]
    if not items:
        raise ValueError(f"{src}: no .jpg/.jpeg/.png files under class sub-folders; expected SRC/<class>/<image>")
    if workers is None:  # every CPU, where starting the worker processes pays off
        workers = available_cpus() if len(items) >= PACK_SMALL else 1
    report = PackReport(dst=dst, records=0, classes=len(classes), data_bytes=0)
    report.skipped += unlisted
    for p in other:
        report.skipped.append((str(p), "not a .jpg/.jpeg/.png file"))

    dst.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # pragma: no mutate (any unique name)
    tmp.mkdir()
    try:
        rows = np.zeros(len(items), dtype=RECORD_DTYPE)
        n = 0
        offset = path_offset = 0
        bar = _PackProgress(len(items), f"pack {src.name}", progress)
        data_out = _DataWriter(tmp, shard_size)
        with open(tmp / PATHS_FILE, "wb") as paths_f:
            for item, (payload, reason, reencoded) in _prepared(items, verify, max_side, workers):
                bar.update(len(payload) if payload is not None else 0)
                if payload is None:
                    report.skipped.append((item.shown, reason or "rejected"))
                    continue
                report.reencoded += reencoded
                pbytes = item.stored  # any name the file system allows
                if shard_size is not None and len(payload) > shard_size:
                    raise ValueError(
                        f"{item.shown}: {len(payload)} bytes, larger than the shard size {shard_size}; "
                        "use a larger --shard-size"
                    )
                at = data_out.write(payload)
                rows[n] = (at, len(payload), item.label, zlib.crc32(payload), len(pbytes), path_offset)
                paths_f.write(pbytes)
                offset += len(payload)
                path_offset += len(pbytes)
                n += 1
            bar.close()
            data_out.close()
            paths_f.flush()
            os.fsync(paths_f.fileno())
        header = np.zeros(1, dtype=HEADER_DTYPE)
        index_crc = zlib.crc32(rows[:n].tobytes())
        header[0] = (
            MAGIC,
            FORMAT_VERSION,
            RECORD_DTYPE.itemsize,
            n,
            offset,
            path_offset,
            index_crc,
            len(classes),
            shard_size or 0,
            0,
        )
        with open(tmp / INDEX_FILE, "wb") as f:
            f.write(header.tobytes())
            f.write(rows[:n].tobytes())
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "format_version": FORMAT_VERSION,
            "classes": classes,
            "source_root": str(src.resolve()),
            "records": n,
            "skipped": len(report.skipped),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))  # pragma: no mutate (layout of the text only)
        try:
            os.rename(tmp, dst)
        except OSError as e:
            if dst.exists():  # another pack to the same destination finished first
                raise FileExistsError(
                    f"{dst}: appeared while packing (another pack to the same place?); this pack is discarded"
                ) from None
            raise ValueError(f"{dst}: cannot be created ({e.strerror or e}); choose another destination") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.records, report.data_bytes = n, offset
    report.seconds = time.perf_counter() - t0
    for path, reason in report.skipped:
        log.warning("left out %s: %s", path, reason)
    log.debug(report.summary())  # pragma: no mutate (debug log)
    return report
