"""Parquet files at a URL before any image is read: naming the files, their footers fetched alone (the
file's tail: the footer length is the 4 bytes before the final ``PAR1``), the (file, row group, row) index
built from the footers and the label column, and each row group's image column as a byte range.

The index is saved as the local one is (`data.parquet_index.load_or_build`), keyed on each file's URL,
size and ETag (or version): a file changed on the server gets a new index. Beside it, the footers
themselves, so a second open reads nothing but the listing. pyarrow loads with this module.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...files import atomic_write
from ..base import read_parallel
from ..parquet_columns import Columns, find_columns
from ..parquet_index import check_one_split, folder_files, load_or_build, pyarrow_parquet
from ..shards import refuse_mixed_folder
from .errors import RemoteDataError, StoreFailedError, classify
from .store import ShardDownloader, ShardInfo, list_shards

log = logging.getLogger(__name__)

TAIL_BYTES = 64 << 10  # fetched from a file's end at first: the footer of most files, in one request
MAGIC = b"PAR1"


# ---------------------------------------------------------------------------------------------- the files
def list_parquet(spec: str, storage_options: dict[str, Any] | None) -> tuple[Any, list[ShardInfo]]:
    """(fsspec filesystem, the files ``spec`` names with their sizes and identities): one ``.parquet`` URL,
    a brace pattern, a ``*`` pattern (``s3://bucket/data/train-*.parquet``), or a folder (its own files or
    its ``data/`` folder's, of one split). Errors as `store.list_shards`'s."""
    fs, infos = list_shards(spec, storage_options, suffix=".parquet", folder=folder_files)
    if "*" not in spec and "{" not in spec:  # a folder (or one file: one split) is one split; a pattern is as given
        check_one_split([info.url for info in infos], spec)
    return fs, infos


def holds_parquet(url: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether the folder ``url`` holds Parquet files (its own or its ``data/`` folder's): one listing; a
    listing that fails says False (the shards' reader then names the cause). A folder that also holds
    .tar shards is refused in one line, as a local one is (`refuse_mixed_folder`)."""
    from .store import folder_path, url_to_fs

    try:
        fs, _ = url_to_fs(url, storage_options)
        root = folder_path(fs, url)  # over HTTP with its slash: its index page's own URL
        found = fs.find(root)
    except Exception:  # noqa: BLE001 - named by the reader that opens it
        return False
    parquet = folder_files(root.rstrip("/"), [p for p in found if p.endswith(".parquet")])
    refuse_mixed_folder(url, sorted(p.rpartition("/")[2] for p in found if p.endswith(".tar")), parquet)
    return bool(parquet)


def file_identity(info: ShardInfo) -> str:
    """What a file's index is keyed on beside its URL: its size and ETag (or version, or mtime)."""
    return f"{info.size}|{info.identity}"


# ---------------------------------------------------------------------------------------------- footers
class RangeFile:
    """A read-only file of ``size`` bytes of which only some ranges are here (``{start: bytes}``): what
    pyarrow reads a Parquet file through when only its footer, or one row group's column, was fetched.
    A read outside them goes to ``fetch(start, end)`` (None: an OSError, which pyarrow reports)."""

    def __init__(self, size: int, ranges: dict[int, Any], fetch: Callable[[int, int], bytes] | None = None) -> None:
        self._size, self.ranges, self.fetch = size, ranges, fetch
        self.pos, self.closed = 0, False

    def size(self) -> int:
        return self._size

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1 else self._size + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def read(self, n: int = -1) -> Any:
        n = self._size - self.pos if n < 0 else min(n, self._size - self.pos)
        start = self.pos
        self.pos += n
        for first, data in self.ranges.items():
            if first <= start and start + n <= first + len(data):
                return memoryview(data)[start - first : start - first + n]
        if self.fetch is None:
            raise OSError(f"bytes {start}..{start + n} of the file were not fetched")
        return self.fetch(start, start + n)

    def close(self) -> None:
        self.closed = True


def fetch_tail(store: ShardDownloader, k: int) -> bytes:
    """File ``k``'s footer with its length and magic (what follows the last row group), fetched alone: one
    range request of `TAIL_BYTES`, and a second one when the footer is longer. Not a Parquet file, or a
    store that refuses, is one line naming the file."""
    info = store.infos[k]
    if info.size < 12:
        raise ValueError(f"{info.url}: {info.size} bytes: not a Parquet file (too short); check the URL")
    first = max(0, info.size - TAIL_BYTES)
    tail = _get(store, info, first, info.size)
    if tail[-4:] != MAGIC:
        raise ValueError(f"{info.url}: not a Parquet file (it does not end with PAR1); check the URL")
    need = int.from_bytes(tail[-8:-4], "little") + 8
    if need + 4 > info.size:
        raise ValueError(f"{info.url}: a footer of {need} bytes in a file of {info.size}: the file is damaged")
    if need > len(tail):
        tail = _get(store, info, info.size - need, first) + tail
    return tail[-need:]


def _get(store: ShardDownloader, info: ShardInfo, start: int, end: int) -> bytes:
    try:
        data = store.get_range(info.path, start, end)
    except RemoteDataError:  # named already (a server that ignores ranges)
        raise
    except Exception as e:
        why = classify(e, info.url, store.storage_options)
        if why is not None:
            raise why from e
        if isinstance(e, FileNotFoundError):
            raise
        raise StoreFailedError(f"{info.url}: the object store failed ({type(e).__name__}: {e})") from e
    if len(data) != end - start:
        raise StoreFailedError(f"{info.url}: got {len(data)} bytes of {end - start} asked for at offset {start}")
    return bytes(data)


def parse_footer(tail: bytes) -> Any:
    """The ``pyarrow.parquet.FileMetaData`` of a footer fetched by `fetch_tail`."""
    import pyarrow as pa

    return pyarrow_parquet().read_metadata(pa.BufferReader(MAGIC + tail))


def chunk_range(md: Any, group: int, leaf: str) -> tuple[int, int]:
    """(first byte, length) of column ``leaf``'s chunk in row group ``group`` (its dictionary page, if any,
    then its data pages)."""
    rg = md.row_group(group)
    c = next(c for c in map(rg.column, range(rg.num_columns)) if c.path_in_schema == leaf)  # from the schema
    starts = [c.data_page_offset]
    if c.dictionary_page_offset:  # None without one; 0 from some writers: no such page
        starts.append(c.dictionary_page_offset)
    return min(starts), int(c.total_compressed_size)


# ---------------------------------------------------------------------------------------------- the index
class RemoteIndex:
    """The index of remote Parquet files (`data.parquet_index.ParquetIndex`) and their footers, from
    ``index_dir`` or built from the files' tails and label columns (fetched in parallel) and saved there."""

    def __init__(
        self,
        store: ShardDownloader,
        *,
        image_column: str | None,
        label_column: str | None,
        index_dir: Path,
    ) -> None:
        self.store, self.infos = store, store.infos
        self.image_column, self.label_column = image_column, label_column
        self._tails: dict[int, bytes] = {}
        self._ranges: dict[int, dict[int, Any]] = {}  # what each file's index reads: fetched once
        named = [(info.url, file_identity(info)) for info in self.infos]
        self.index, self.path = load_or_build(
            named, self._open, image_column=image_column, label_column=label_column, cache=index_dir
        )
        self.footers = self._load_footers()
        if self.footers is None:
            self.footers = read_parallel(self._tail, range(len(self.infos)))
            blob = np.frombuffer(b"".join(self.footers), np.uint8)
            ends = np.cumsum([len(t) for t in self.footers], dtype=np.int64)
            try:
                atomic_write(self._footer_path, lambda f: np.savez(f, blob=blob, ends=ends))
            except OSError as e:
                log.warning("cannot save the Parquet footers to %s (%s)", self._footer_path, e)

    @property
    def _footer_path(self) -> Path:
        return self.path.with_suffix(".footers.npz")

    def _load_footers(self) -> list[bytes] | None:
        try:
            with np.load(self._footer_path) as z:
                blob, ends = z["blob"].tobytes(), z["ends"].tolist()
        except (OSError, KeyError, ValueError):
            return None
        if len(ends) != len(self.infos):
            return None
        return [blob[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]

    def _tail(self, k: int) -> bytes:
        tail = self._tails.get(k)
        if tail is None:
            tail = self._tails[k] = fetch_tail(self.store, k)
        return tail

    def _open(self, k: int) -> Any:
        """File ``k`` as a ``ParquetFile`` of its parsed footer holding its label column's chunks, fetched
        in one request each (the index reads those); any other read fetches its range."""
        import pyarrow as pa

        info, tail = self.infos[k], self._tail(k)
        md = parse_footer(tail)
        ranges = self._ranges.get(k)
        if ranges is None:
            ranges = {}
            try:
                columns = find_columns(md.schema.to_arrow_schema(), self.image_column, self.label_column, info.url)
            except ValueError:
                columns = None  # the index names the problem (or the file's difference from the first one)
            if columns is not None:
                ranges.update(self._label_chunks(k, md, columns))
            self._ranges[k] = ranges

        def fetch(start: int, end: int) -> bytes:
            return _get(self.store, info, start, end)

        source = pa.PythonFile(RangeFile(info.size, ranges, fetch))  # read-only: opened for reading
        return pyarrow_parquet().ParquetFile(source, metadata=md, pre_buffer=False)  # one read per chunk

    def _label_chunks(self, k: int, md: Any, columns: Columns) -> dict[int, bytes]:
        leaves = [
            md.schema.column(j).path
            for j in range(md.num_columns)
            if re.match(rf"{re.escape(columns.label)}(\.|$)", md.schema.column(j).path)
        ]
        spans = [chunk_range(md, g, leaf) for g in range(md.num_row_groups) for leaf in leaves]
        if not spans:
            return {}
        info = self.infos[k]
        try:
            datas = self.store.fs.cat_ranges(
                [info.path] * len(spans), [a for a, _ in spans], [a + n for a, n in spans], on_error="raise"
            )
        except RemoteDataError:
            raise
        except Exception as e:  # noqa: BLE001 - each backend's own errors: named, or read one by one later
            why = classify(e, info.url, self.store.storage_options)
            if why is not None:
                raise why from e
            return {}
        # A body of another length (a server that ignores ranges) is left out: its range is read again
        # through get_range, which names such a server.
        return {a: bytes(d) for (a, n), d in zip(spans, datas, strict=True) if len(d) == n}
