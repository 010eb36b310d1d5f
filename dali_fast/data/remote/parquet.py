"""`RemoteParquetReader`: Parquet files in object storage (``s3://``, ``gs://``, ``https://``, any fsspec
URL), read by row group through the node-local cache that remote WebDataset shards use.

``open_dataset("s3://bucket/data/train-*.parquet")`` returns one. What it does:

- **Open.** One listing gives each file's size and ETag (`store.list_shards`). The index of (file, row
  group, row) comes from each file's footer, fetched alone (its tail), and its label column (a few bytes
  a row); it is saved, with the footers, keyed on (URL, size, ETag), so a second open reads nothing but
  the listing and a file changed on the server is indexed again (`parquet_index.RemoteIndex`).
- **Reads.** The unit of the cache is one row group's image column, fetched by range requests (the
  other columns are never read): the shard cache (`cache.ShardCache`) keeps it on the node's disk
  within ``cache_limit``, shared by every process of the node, and the streaming order
  (`loaders.order.StreamingOrder`, windows of ``shuffle_window`` row groups) tells the reader what
  comes next (`schedule`/`advance`), so row groups are downloaded ahead and each is read once an epoch.
  A row group is decoded once per process into the local reader's row-group LRU (`parquet.ParquetReader`).
- **Faults.** Range requests are retried with backoff; a row group of a file that is gone or changed on
  the server, or that still fails, is a bad record named ``s3://.../file.parquet:row`` (``on_error``);
  what cannot be had for a reason of the store at open is a `errors.RemoteDataError` naming it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...text import plural
from ..parquet import ROW_GROUP_CACHE, ParquetReader, check_reading
from ..parquet_group import RowGroup
from ..parquet_index import pyarrow_parquet
from ..path_refs import EMBED
from .parquet_index import RangeFile, RemoteIndex, chunk_range, list_parquet, parse_footer
from .store import CHUNK_BYTES, ShardChanged, ShardDownloader, ShardError, ShardInfo
from .streamed import Streamed


class RemoteParquetReader(Streamed, ParquetReader):
    """The reader interface over Parquet files at a URL (see the module docstring); every member of
    `parquet.ParquetReader` holds, with ``source(i)`` naming ``URL:row``; the row groups stream as
    `streamed.Streamed` says (``schedule``, ``advance``, ``close``, ``stats``).

    Args:
        spec: a ``.parquet`` URL, a brace pattern of them, a ``*`` pattern (not over HTTP), or a folder
            (its own .parquet files, or its ``data/`` folder's: a Hugging Face snapshot).
        image_column: the column of encoded images; found by type when None.
        label_column: the column of class labels; found when None.
        streaming: the streaming order over row groups (True, the default), or random access (False:
            each row group a batch needs is fetched when it is read).
        shuffle_window: row groups whose samples are shuffled together (None: as `ParquetReader`).
        row_group_cache: bytes of decoded row groups each process keeps.
        cache_dir: the node-local cache (default ``$DALI_FAST_CACHE/remote``): row groups in ``shards/``,
            indexes in ``parquet-index/`` unless ``index_dir`` says otherwise.
        cache_limit: bytes of row groups on this node's disk (None: what the disk can spare).
        index_dir: where indexes and footers are saved.
        storage_options: for fsspec (e.g. ``{"endpoint_url": ...}``).
        download_threads: row groups downloaded ahead at once.
        retry_seconds: how long a failing range request is retried without progress.
        timeout: seconds after which a hanging range request is abandoned.
        chunk_bytes: bytes of one range request.
        prefetch_next_epoch: download the next epoch's first row groups as this one ends.
        classes: the class names in label order (`classes.class_map`).
    """

    unit = "row_groups"

    def __init__(
        self,
        spec: str,
        *,
        image_column: str | None = None,
        label_column: str | None = None,
        streaming: bool | None = True,
        shuffle_window: int | None = None,
        row_group_cache: int = ROW_GROUP_CACHE,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | None = None,
        index_dir: str | os.PathLike | None = None,
        storage_options: dict[str, Any] | None = None,
        download_threads: int = 4,
        retry_seconds: float = 60.0,
        timeout: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
        prefetch_next_epoch: bool = True,
        classes: Sequence[str] | None = None,
    ) -> None:
        self._pq = pyarrow_parquet()
        check_reading(shuffle_window, row_group_cache)
        root = self._setup(cache_dir, cache_limit, download_threads, retry_seconds, timeout, chunk_bytes, prefetch_next_epoch)
        self.spec = self.path = str(spec)
        self._meta: dict[int, Any] = {}
        options = dict(storage_options or {})
        fs, self.infos = list_parquet(self.spec, options)
        self.files = [info.url for info in self.infos]
        files = ShardDownloader(self.infos, options, retry_seconds=1.0, timeout=float(timeout), chunk_bytes=1, fs=fs)
        found = RemoteIndex(
            files,
            image_column=image_column,
            label_column=label_column,
            index_dir=Path(index_dir) if index_dir is not None else root / "parquet-index",
        )
        self.index_file = found.path
        self._footers = found.footers
        self.chunks = self._chunks(found.index.group_file, found.index.columns.image_leaf)
        self.store = ShardDownloader(
            self.chunks, options, retry_seconds=float(retry_seconds), timeout=float(timeout),
            chunk_bytes=int(chunk_bytes), fs=fs,
        )  # fmt: skip
        self._bad: dict[int, Any] = {}  # row groups that failed, with the error: reading them raises it
        self.chunk_bytes = np.array([c.size for c in self.chunks], dtype=np.int64)
        self._use_index(found.index, True if streaming is None else streaming, shuffle_window, row_group_cache, classes)
        self._check_budget(self.chunk_bytes, "row group")

    # ------------------------------------------------------------------ open
    def _chunks(self, group_file: np.ndarray, leaf: str) -> list[ShardInfo]:
        """Each row group's image column as a part of its file (what the cache holds and a download fetches)."""
        out = []
        base = np.searchsorted(group_file, np.arange(len(self.infos)))
        for gid, k in enumerate(group_file.tolist()):
            info, md = self.infos[k], self._footer(k)
            start, size = chunk_range(md, gid - int(base[k]), leaf)
            out.append(ShardInfo(f"{info.url}#{gid - int(base[k])}", info.path, size, info.identity, start, info.size))
        return out

    def _footer(self, k: int) -> Any:
        """File ``k``'s parsed footer (parsed once per process, from the saved footers)."""
        md = self._meta.get(k)
        if md is None:
            md = self._meta[k] = parse_footer(self._footers[k])
        return md

    # ------------------------------------------------------------------ the row groups
    def _fetch(
        self, gid: int, pin: bool, block_for_room: bool = True, cancel: Callable[[], bool] | None = None
    ) -> int | None | bool:
        """Row group ``gid``'s image column made local in the shard cache; a failure is remembered (the
        stream asks for no row group that failed)."""
        info = self.chunks[gid]

        def download(tmp: Path) -> None:
            self.store.download(gid, tmp, None, cancel)
            why = self.store.changed(gid)  # the bytes are the indexed file's: it was not replaced meanwhile
            if why is not None:
                raise ShardChanged(f"{self.files[int(self.group_file[gid])]}: {why}; open the data set again")

        try:
            return self.cache.acquire(info.key(), info.size, download, pin=pin, block_for_room=block_for_room)
        except ShardError as e:
            self._bad[gid] = e
            raise

    def _path_refs(self, index: Any) -> None:
        """Path references name files of the machine that wrote the file: refused, with the fix."""
        if len(index.ref_rows):
            k = int(np.searchsorted(self._file_start, index.ref_rows[0], side="right") - 1)
            raise ValueError(
                f"{self.files[k]}: column {self.columns.image!r} holds {plural(len(index.ref_rows), 'image')} as paths "
                f"to files (Hugging Face's {{bytes: null, path}}), which a file read from a URL cannot open; {EMBED}"
            )

    def _load(self, gid: int) -> RowGroup | str:
        """Row group ``gid`` decoded from its image column in the cache, or why it cannot be."""
        import pyarrow as pa

        k, info = int(self.group_file[gid]), self.chunks[gid]
        g = int(gid - self._group_base[k])
        try:
            data = self._stream.map(gid)
            source = RangeFile(info.whole_size, {info.start: data})
            pf = self._pq.ParquetFile(pa.PythonFile(source), metadata=self._footer(k))  # one read: the chunk
            table = pf.read_row_group(g, columns=[self.columns.image_leaf], use_threads=False)
            return RowGroup(table.column(0), self.columns.image_field)
        except (OSError, pa.ArrowException) as e:
            return f"unreadable: row group {g} of {self.files[k]}: {e}"

    # ------------------------------------------------------------------ reader interface
    @property
    def fingerprint(self) -> str:
        """What identifies the contents: each file's URL, size and ETag, the row groups and the labels."""
        h = hashlib.sha1()
        for info in self.infos:
            h.update(f"{info.url}|{info.size}|{info.identity}\n".encode())
        h.update(self.group_rows.tobytes())
        h.update(self._labels.tobytes())
        return f"remote-parquet:{len(self)}:{h.hexdigest()[:16]}"

    def _units_of(self, records: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.shard_bounds, records, side="right") - 1

    # ------------------------------------------------------------------ processes
    def reset_process_state(self) -> None:
        """This process's row groups, downloads and connections, fresh (a new reader, an unpickled one, a
        forked child: its parent's pins and threads are not its own)."""
        super().reset_process_state()
        self._start_stream([c.key() for c in self.chunks], [c.url for c in self.chunks], self.chunk_bytes)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_stream"]  # this process's downloads and pins: an unpickled reader starts its own
        return state

    def __repr__(self) -> str:  # pragma: no mutate (display)
        return f"RemoteParquetReader({len(self.files)} files, {len(self.group_rows)} row groups, records={len(self)})"
