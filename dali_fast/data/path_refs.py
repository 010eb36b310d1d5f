"""Images stored as paths: a Hugging Face ``Image`` value ``{bytes: null, path: ...}`` (what ``datasets``'
``Dataset.to_parquet`` writes for images made from files; only ``push_to_hub`` embeds the bytes), which
``datasets`` reads back by opening the path. Resolved and checked once at open, read with the row group.

A path is absolute, or relative to the Parquet file's folder, else to the current folder (where
``datasets`` opens a relative path). A path that names no file is refused at open in one line: the
column, the first such path, and the fix (embed the images, or put the files back).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from ..text import plural
from .base import read_parallel
from .member_index import names_blob

log = logging.getLogger(__name__)

EMBED = (
    "embed the images before writing the file (datasets: ds.with_format('arrow').map(datasets.table."
    "embed_table_storage, batched=True).to_parquet(...), or push_to_hub, which embeds them), or put the files back"
)


def _resolve(path: str, folder: str) -> tuple[str, bool]:
    """(the file a path reference names, whether it is there): absolute as it is; relative, beside the
    Parquet file if it is there, else from the current folder."""
    if os.path.isabs(path):
        return path, os.path.isfile(path)
    beside = os.path.join(folder, path)
    if os.path.isfile(beside):
        return beside, True
    return os.path.abspath(path), os.path.isfile(path)


class PathRefs:
    """The rows of a Parquet set whose image is a path reference, and the files they name (resolved).

    Args:
        rows: the rows (ascending, counted over every file).
        names: their paths as `member_index.names_blob` (blob, ends).
        files: the Parquet files; ``file_start`` the first row of each (and the total).
        column: the image column (for messages).
    """

    def __init__(
        self,
        rows: np.ndarray,
        names: tuple[np.ndarray, np.ndarray],
        files: Sequence[str],
        file_start: np.ndarray,
        column: str,
    ) -> None:
        blob, ends = names
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        paths = [bytes(blob[a:b]).decode("utf-8", "surrogateescape") for a, b in zip(starts, ends, strict=True)]
        folders = [os.path.dirname(files[int(np.searchsorted(file_start, r, side="right") - 1)]) for r in rows]
        found = read_parallel(lambda pf: _resolve(*pf), list(zip(paths, folders, strict=True)))
        missing = [k for k, (_, there) in enumerate(found) if not there]
        if missing:
            k = missing[0]
            raise FileNotFoundError(
                f"{files[int(np.searchsorted(file_start, rows[k], side='right') - 1)]}: column {column!r} holds "
                f"{plural(len(rows), 'image')} as paths to files (Hugging Face's {{bytes: null, path}}), and "
                f"{len(missing)} name no file (first: {paths[k]!r}, looked for at {found[k][0]}); {EMBED}"
            )
        self.rows = np.asarray(rows, dtype=np.int64)
        self._names, self._ends = names_blob([path for path, _ in found])
        log.info("%s read from the files they name", plural(len(rows), "image is a path", "images are paths"))

    def __len__(self) -> int:
        return len(self.rows)

    def path(self, k: int) -> str:
        """The file of the ``k``-th path reference."""
        start = int(self._ends[k - 1]) if k else 0
        return bytes(self._names[start : int(self._ends[k])]).decode("utf-8", "surrogateescape")

    def within(self, lo: int, hi: int) -> dict[int, str]:
        """``{row - lo: file}`` of the path references among rows ``lo .. hi-1`` (one row group)."""
        a, b = np.searchsorted(self.rows, [lo, hi])
        return {int(self.rows[k]) - lo: self.path(k) for k in range(int(a), int(b))}
