"""`MemmapReader`: a packed data set (see `format`) read in place.

Opening reads the 64-byte header, checks every file's size against it, and memory-maps the rest, so it
costs the same for ten records or ten million; ``reader[i]`` is a zero-copy view of record ``i``.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..text import progress_bar
from .base import CheckedBatch
from .checks import (
    JPEG_EOI_BYTES,
    JPEG_SOI_BYTES,
    PNG_IEND_BYTES,
    PNG_SIGNATURE_BYTES,
    QUICK_MIN,
    check_encoded,
    check_index,
    check_label,
    pixel_limit,
)
from .classes import class_map, remap_labels
from .format import (
    DATA_FILE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    INDEX_FILE,
    MAGIC,
    META_FILE,
    PATHS_FILE,
    READ_VERSIONS,
    SHARD_FILE,
    TARGET_CODES,
    decode_targets,
    record_dtype,
)
from .targets import check_target


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


HEAD = QUICK_MIN  # bytes of each record's start the quick check reads: a PNG's signature and its IHDR's size


class PackedTargets:
    """The target blocks at the end of a packed set's index rows, as rows (`base.TargetReader`'s
    ``targets``). `pack` left out every record with a bad target, and the crc covers the blocks: no record
    here is bad (`check` finds none)."""

    def __init__(self, rows: np.ndarray, kind: str, width: int) -> None:
        self.kind, self.width = kind, width
        self._blocks = rows["target"]

    def __len__(self) -> int:
        return len(self._blocks)

    def rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 ``(len(indices), width)``: 0/1 per class (multihot) or the record's numbers (float)."""
        return decode_targets(self._blocks[np.asarray(indices, dtype=np.int64)], self.kind, self.width)

    def check(self, indices: Sequence[int] | np.ndarray) -> dict[int, str]:
        return {}


class MemmapReader:
    """Read-only, memory-mapped reader of a packed data set.

    ``reader[i]`` returns a zero-copy ``uint8`` view of record ``i`` and its label. A set packed with
    targets (format version 3) yields them (``target_kind``, ``targets``): ``target=None`` takes the
    set's own kind, ``"class"`` its labels instead; ``num_classes``, when given, must be the set's.

    Args:
        path: the packed set's folder (``index.bin`` and its data files).
        target: None, "class", "multihot" or "float", as above.
        num_classes: K of a multi-hot set, checked against the set's.
        classes: the class names in label order (the training set's, for a validation set): the pack's
            own labels are put on them by name (`classes.class_map`; a pack of bare labels, by index).
    """

    reads_views = True  # batch reads are views of the map: reading ahead holds no memory and does no I/O

    def __init__(
        self,
        path: str | os.PathLike,
        target: str | None = None,
        num_classes: int | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        check_target(target, num_classes)
        self.path = Path(path)
        self._target, self._num_classes = target, num_classes
        self._declared = None if classes is None else list(classes)
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
                f"this dali_fast reads versions {READ_VERSIONS[0]} to {FORMAT_VERSION}; pack the data set again "
                "with `dali-fast pack`"
            )
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{index_path}: format version {version}, written by a newer dali_fast; this one reads versions "
                f"{READ_VERSIONS[0]} to {FORMAT_VERSION}: upgrade dali_fast (pip install -U dali-fast) to read it"
            )
        if version not in READ_VERSIONS:
            raise ValueError(
                f"{index_path}: format version {version}, this dali_fast reads versions {READ_VERSIONS[0]} to "
                f"{FORMAT_VERSION}; pack the data set again with `dali-fast pack`"
            )
        stored, width = self._stored_targets(header, index_path)
        row = record_dtype(stored, width)
        if int(header["record_size"]) != row.itemsize:
            raise ValueError(f"{index_path}: record size {int(header['record_size'])} != {row.itemsize}")
        count = int(header["count"])
        expected = HEADER_DTYPE.itemsize + count * row.itemsize
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
        own: list[str] = _read_classes(root / META_FILE)
        if len(own) != int(header["classes"]):
            raise ValueError(
                f"{root / META_FILE}: lists {len(own)} classes, the index was written for "
                f"{int(header['classes'])}; pack the data set again"
            )
        self.classes, self._own_count, self._remap = own, len(own), None
        self.index_crc32 = int(header["index_crc32"])
        self.count = count
        self.data_size = data_size
        self.version = version
        self.records = (
            np.memmap(index_path, dtype=row, mode="r", offset=HEADER_DTYPE.itemsize, shape=(count,))
            if count
            else np.zeros(0, row)
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
        self.stored_target = stored
        self.target_kind = stored if self._target is None else self._target
        self.targets = PackedTargets(self._rows, stored, width) if self.target_kind != "class" else None
        if self._declared is not None:  # the labels put on the declared classes (read once, here)
            own_labels = self._rows["label"].astype(np.int64)
            self.classes, self._remap = class_map(own, own_labels, self._declared, where=str(root), source=self.source)

    def _label_column(self, rows: np.ndarray) -> np.ndarray:
        """The labels of index ``rows`` (int64), on the declared classes where some were declared."""
        return remap_labels(rows["label"].astype(np.int64), self._remap, self._own_count)

    def _stored_targets(self, header: np.void, index_path: Path) -> tuple[str, int]:
        """(kind, width) of the targets the set was packed with, checked against what was asked for."""
        if int(header["version"]) < 3:  # version 2: class targets, and 8 reserved bytes where the kind is now
            stored, width = "class", 0
        else:
            code, width = int(header["target_kind"]), int(header["target_width"])
            kinds = {v: k for k, v in TARGET_CODES.items()}
            if code not in kinds:
                raise ValueError(
                    f"{index_path}: target kind code {code} is not one of {sorted(kinds)}; pack the data set again"
                )
            stored = kinds[code]
        wanted = self._target
        if wanted not in (None, "class", stored):
            ways = f"target='{stored}'" + (" or 'class'" if stored != "class" else "")
            raise ValueError(
                f"{self.path}: packed with {stored} targets, target={wanted!r} was asked for; open it with "
                f"{ways}, or pack it again from a source with {wanted} targets"
            )
        if self._num_classes is not None and self._num_classes != width:
            raise ValueError(
                f"{self.path}: packed with multihot targets of {width} classes, num_classes={self._num_classes} "
                f"was asked for; pass num_classes={width} or leave it out"
            )
        return stored, width

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
        return {"path": self.path, "target": self._target, "num_classes": self._num_classes, "classes": self._declared}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._target, self._num_classes = state["target"], state["num_classes"]
        self._declared = state.get("classes")
        self._open()

    def __len__(self) -> int:
        return self.count

    @property
    def labels(self) -> np.ndarray:
        """All labels as an int64 array (reads the index column); refuses labels outside the classes."""
        labels = self._rows["label"].astype(np.int64)
        if len(labels) and int(labels.max()) >= self._own_count:
            bad = int(np.argmax(labels >= self._own_count))
            raise ValueError(
                f"{self.path / INDEX_FILE}: record {bad} has label {int(labels[bad])}, but there are "
                f"{self._own_count} classes; check it with `dali-fast inspect --verify` and pack the data set again"
            )
        return remap_labels(labels, self._remap, self._own_count)

    @property
    def fingerprint(self) -> str:
        """Identifies the data set's contents (record count, data size, index checksum), e.g. for resuming."""
        return f"packed:{self.count}:{self.data_size}:{self.index_crc32:08x}"

    def index_intact(self) -> bool:
        """True when the index rows (offsets, lengths, labels, checksums, targets) are as `pack` wrote them."""
        rows = self.records.tobytes() if self.count else b""
        return zlib.crc32(rows) == self.index_crc32

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = check_index(i, self.count)
        rec = self._rows[j]
        return self._view(int(rec["offset"]), int(rec["length"])), int(self._label_column(self._rows[j : j + 1])[0])

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """Records for ``indices``: a list of zero-copy views and an int64 label array."""
        views, labels, _, _ = self._batch(indices)
        return views, labels

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """`read_batch` with the read-time checks, O(1) per record: (views, labels, {position: reason}).

        `pack` checked every record's structure (``verify`` decodes it; without it, `check_encoded`
        walks it) and stored its crc, so reading checks only what damage after packing would break
        first: the label is one of the classes, a JPEG starts with its SOI and ends with its EOI, a
        PNG starts with its signature, ends with IEND and has no more pixels than the limit (its IHDR is
        in its first bytes; a JPEG's size is not at a fixed place, and `pack` held it to the limit in force
        when it packed). Those bytes are gathered for the whole batch
        at once; the few records that do not pass (data after the image's end, damage) get the full
        `check_encoded`, which names what is wrong. Damage between the ends (in the headers or the
        compressed data) passes: the pipeline finds what breaks its decoder by decoding the failed
        batch's records one by one, and `verify` finds all of it beforehand by the crc.
        """
        views, labels, offsets, lengths = self._batch(indices)
        ok = (lengths >= QUICK_MIN) & (labels >= 0) & (labels < len(self.classes))
        rows = np.flatnonzero(ok)  # the others are bad, or too short for the quick look: the full check decides
        edges = self._edges(offsets[rows], lengths[rows])
        heads, tails = edges[:, :HEAD], edges[:, HEAD:]
        jpeg = (heads[:, :3] == JPEG_SOI_BYTES).all(axis=1) & (tails[:, -2:] == JPEG_EOI_BYTES).all(axis=1)
        png = (heads[:, :8] == PNG_SIGNATURE_BYTES).all(axis=1) & (tails == PNG_IEND_BYTES).all(axis=1)
        limit = pixel_limit()
        if limit is not None and png.any():  # a PNG's size is in its first bytes (IHDR): the full check names it
            sides = heads[:, 16:].astype(np.int64).reshape(-1, 2, 4) @ np.array([1 << 24, 1 << 16, 1 << 8, 1])
            png &= np.maximum(sides, 1).prod(axis=1) <= limit
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
        return views, self._label_column(rows), offsets, lengths

    def _edges(self, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The first `HEAD` and last 12 bytes of records of ``QUICK_MIN`` bytes or more, as one (records,
        HEAD + 12) uint8 array, gathered from the maps at once (once per shard the records are in)."""
        ends = offsets + lengths
        heads = offsets[:, None] + np.arange(HEAD)  # never past the record: HEAD is QUICK_MIN
        at = np.concatenate([heads, ends[:, None] - np.arange(12, 0, -1)], axis=1)
        span = self.shard_size or self.data_size  # unsharded: one shard, in which every such record starts
        shard = offsets // span
        out = np.empty(at.shape, np.uint8)
        for k in np.unique(shard).tolist():
            rows = shard == k
            out[rows] = self._flat[k][at[rows] - k * span]
        return out

    def source(self, i: int) -> str:
        """The path the record was packed from."""
        rec = self.records[check_index(i, self.count)]
        off, n = int(rec["path_offset"]), int(rec["path_length"])
        return bytes(self._paths[off : off + n]).decode("utf-8", errors="surrogateescape")

    def crc_of(self, i: int, data: np.ndarray | bytes) -> int:
        """The crc32 `pack` writes in record ``i``'s row for the bytes ``data``: of them, then of its target block."""
        crc = zlib.crc32(data)
        if "target" in self.records.dtype.names:
            crc = zlib.crc32(self.records[i]["target"].tobytes(), crc)
        return crc

    def verify(self, progress: bool = False) -> list[int]:
        """Check every record's crc32 (its bytes, then its target block); returns the indices that do not
        match (see also `index_intact`)."""
        bad: list[int] = []
        blocks = self.records["target"] if "target" in self.records.dtype.names else None
        with progress_bar(self.count, "verify", "record", enabled=progress) as bar:  # pragma: no mutate (display)
            for i in range(self.count):
                view, _ = self[i]
                crc = zlib.crc32(view)
                if blocks is not None:
                    crc = zlib.crc32(blocks[i].tobytes(), crc)
                if crc != int(self.records[i]["crc32"]):
                    bad.append(i)
                bar.update(1)
        return bad

    def __repr__(self) -> str:
        kind = "" if self.target_kind == "class" else f", target={self.target_kind!r}"
        return f"MemmapReader({str(self.path)!r}, records={self.count}, classes={len(self.classes)}{kind})"
