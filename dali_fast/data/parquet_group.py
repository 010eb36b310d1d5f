"""One Parquet row group's images in memory: the image column's Arrow buffer as read-only uint8, each
row's offsets into it, why each row is not an image (checked once, when the group is read), and the
bytes of the rows whose image is a path reference (`path_refs`). Local and remote readers keep these in
their row-group LRU; a record is a zero-copy view into one."""

from __future__ import annotations

from typing import Any

import numpy as np

from .checks import check_encoded

NULL_IMAGE = "null image"


class RowGroup:
    """One row group's images: the Arrow data buffer as uint8 (read-only), each row's offsets into it,
    which rows are null, and why each row is not an image (None when it is one)."""

    __slots__ = ("data", "offsets", "reasons", "nbytes", "files")

    def __init__(self, column: Any, image_field: str | None, refs: dict[int, str] | None = None) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        chunks = [pc.struct_field(c, image_field) if image_field else c for c in column.chunks]
        if len(chunks) == 1:
            arr = chunks[0]
        else:  # a row group of several chunks (or none): one array, with 64-bit offsets
            arr = pa.concat_arrays([c.cast(pa.large_binary()) for c in chunks] or [pa.array([], pa.large_binary())])
        wide = pa.types.is_large_binary(arr.type)
        _, offsets, data = arr.buffers()
        self.offsets = np.frombuffer(offsets, np.int64 if wide else np.int32)[arr.offset : arr.offset + len(arr) + 1]
        self.data = np.frombuffer(data if data is not None else b"", np.uint8)
        self.data.flags.writeable = False  # the cache's bytes: a consumer cannot change them
        nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), bool)
        ends = self.offsets.tolist()
        self.reasons = [
            NULL_IMAGE if null else check_encoded(self.data[a:b])
            for a, b, null in zip(ends[:-1], ends[1:], nulls.tolist(), strict=True)
        ]
        self.files: dict[int, np.ndarray] = {}  # rows whose image is a path reference: the file's bytes
        for row, path in (refs or {}).items():
            try:
                with open(path, "rb", buffering=0) as f:
                    data = f.readall()
            except OSError as e:
                self.reasons[row] = f"unreadable: {path}: {e.strerror or e}"
                continue
            self.files[row] = np.frombuffer(data, np.uint8)
            self.reasons[row] = check_encoded(data)
        self.nbytes = self.data.nbytes + self.offsets.nbytes + sum(f.nbytes for f in self.files.values())

    def view(self, row: int) -> np.ndarray:
        found = self.files.get(row)
        return found if found is not None else self.data[int(self.offsets[row]) : int(self.offsets[row + 1])]
