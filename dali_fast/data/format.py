"""The packed data set's layout on disk: the one place a format change is made and reviewed.

A packed data set is a folder::

    dst/
      index.bin   HEADER_DTYPE (64 bytes) followed by `count` RECORD_DTYPE rows
      data.bin    the encoded images, concatenated (with a shard size: data-00000.bin, data-00001.bin, ...)
      paths.bin   the source paths (UTF-8), concatenated; rows point into it
      meta.json   class names and provenance (small; not per record)

Every number on disk is little-endian and declared once below. `packed.MemmapReader` reads it and
`writer.pack` writes it; both import it from here.
"""

from __future__ import annotations

import numpy as np

MAGIC = b"DALIFAST"
FORMAT_VERSION = 2  # 2: the header carries a crc32 of the index rows (labels included) and the class count

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
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")  # the files of an ImageFolder that are images
