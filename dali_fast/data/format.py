"""The packed data set's layout on disk: the one place a format change is made and reviewed.

A packed data set is a folder::

    dst/
      index.bin   HEADER_DTYPE (64 bytes) followed by `count` rows: RECORD_DTYPE, then (version 3) a target
                block of `target_block_bytes` (0 for class targets; `record_dtype` is the whole row)
      data.bin    the encoded images, concatenated (with a shard size: data-00000.bin, data-00001.bin, ...)
      paths.bin   the source paths (UTF-8), concatenated; rows point into it
      meta.json   class names and provenance (small; not per record)

Every number on disk is little-endian and declared once below. `packed.MemmapReader` reads it and
`writer.pack` writes it; both import it from here.
"""

from __future__ import annotations

import numpy as np

MAGIC = b"DALIFAST"
# 2: the header carries a crc32 of the index rows (labels included) and the class count.
# 3: each row may end with a fixed-width target block (the header's target_kind and target_width say which),
#    covered by the index crc32 and by the row's crc32 (the record's bytes, then its target block).
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)  # what this reader opens: a version-2 pack has class targets only

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
        ("target_kind", "<u4"),  # TARGET_CODES; 0 (class) in a version-2 header, whose 8 reserved bytes are 0
        ("target_width", "<u4"),  # K classes (multihot) or D numbers (float) per record; 0 for class targets
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

TARGET_CODES = {"class": 0, "multihot": 1, "float": 2}  # the header's target_kind


def target_block_bytes(kind: str, width: int) -> int:
    """Bytes of one row's target block: none for class targets (the row's label is the target); a bitset
    of ``width`` classes, little-endian bit order, padded to 8 bytes, for multihot; ``width`` little-endian
    float32 for float."""
    if kind == "multihot":
        return (width + 63) // 64 * 8
    if kind == "float":
        return 4 * width
    return 0


def record_dtype(kind: str, width: int) -> np.dtype:
    """One index row: `RECORD_DTYPE`, then the target block (`target_block_bytes`) as ``target`` bytes."""
    block = target_block_bytes(kind, width)
    if not block:
        return RECORD_DTYPE
    return np.dtype(
        [*((name, RECORD_DTYPE.fields[name][0]) for name in RECORD_DTYPE.names), ("target", "u1", (block,))]
    )


def encode_targets(rows: np.ndarray, kind: str, width: int) -> np.ndarray:
    """Target rows (float32 ``(n, width)``: 0/1 for multihot) as target blocks, uint8 ``(n, block bytes)``."""
    rows = np.asarray(rows, dtype=np.float32).reshape(-1, width)
    out = np.zeros((len(rows), target_block_bytes(kind, width)), dtype=np.uint8)
    if kind == "multihot":
        bits = np.packbits(rows > 0.5, axis=1, bitorder="little")
        out[:, : bits.shape[1]] = bits
    else:
        out[:] = rows.astype("<f4").view(np.uint8)
    return out


def decode_targets(blocks: np.ndarray, kind: str, width: int) -> np.ndarray:
    """Target blocks (uint8 ``(n, block bytes)``) as float32 rows ``(n, width)``."""
    if kind == "multihot":
        return np.unpackbits(blocks, axis=1, count=width, bitorder="little").astype(np.float32)
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32)


INDEX_FILE, DATA_FILE, PATHS_FILE, META_FILE = "index.bin", "data.bin", "paths.bin", "meta.json"
SHARD_FILE = "data-{:05d}.bin"  # with a shard size: data-00000.bin, data-00001.bin, ... instead of data.bin
# The files of an ImageFolder that are images: torchvision's IMG_EXTENSIONS, matched without regard to case.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
