"""The object store behind remote shards, through fsspec: what a URL names (`list_shards`), and each
shard's bytes fetched by range requests, retried, and checked against its size and index (`ShardDownloader`).
numpy only: no torch here."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..shards import expand_braces
from .errors import (
    BAD_OPTIONS,
    FAILED,
    NO_SHARD,
    RANGE_IGNORED,
    AccessDeniedError,
    CredentialsRejectedError,
    MissingCredentialsError,
    MissingExtraError,
    NoSuchShardError,
    RangeIgnoredError,
    RemoteDataError,
    StorageOptionsError,
    StoreFailedError,
    TLSError,
    classify,
    wildcard,
)

log = logging.getLogger(__name__)

INDEX_VERSION = 4  # 2: WebDataset's grouping, labels checked; 3: tarfile's names; 4: .cls and .json agree (index_shard)
CHUNK_BYTES = 8 << 20  # one range request
_IDENTITY_FIELDS = ("ETag", "etag", "md5Hash", "Content-MD5", "generation", "VersionId", "crc32c")
_TIME_FIELDS = ("LastModified", "mtime", "updated", "last_modified", "Last-Modified")
CLOUD_INSTALL = "pip install 'dali_fast[cloud]'"
_BACKENDS = {"botocore", "aiobotocore", "s3fs", "aiohttp", "fsspec", "gcsfs", "google", "adlfs", "azure"}


class ShardError(OSError):
    """A shard that cannot be had: gone, changed or truncated on the server, or still failing after retries."""


class ShardChanged(ShardError):
    """A shard whose bytes on the server are no longer the ones its index describes."""


PERMANENT = (  # no retry mends them
    MissingCredentialsError,
    CredentialsRejectedError,
    AccessDeniedError,
    TLSError,
    RangeIgnoredError,
)


class DownloadCancelled(Exception):
    """A download ahead that is no longer wanted (the reader was closed)."""


def is_remote(path: object) -> bool:
    """True for a URL with a scheme other than ``file://`` (``s3://``, ``gs://``, ``https://``, ...)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", path) if isinstance(path, str) else None
    return m is not None and m.group(1).lower() not in ("file", "local")


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path) for ``url``; endpoints and credentials come from ``storage_options`` and
    the backend's usual sources (environment, profiles, instance roles), never from this project."""
    try:
        import fsspec.core
    except ImportError as e:
        raise MissingExtraError(
            f"{url}: remote data needs fsspec and a backend: {CLOUD_INSTALL} (gs:// also gcsfs)"
        ) from e
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        raise MissingExtraError(f"{url}: {e}; {CLOUD_INSTALL} (gs:// also needs `pip install gcsfs`)") from e


@dataclass(frozen=True)
class ShardInfo:
    """A remote shard as listed: its URL, the filesystem path, its size and content identity. A part of an
    object (a Parquet row group's image column) is ``size`` bytes from ``start`` of an object of
    ``object_size`` bytes (-1: the whole object, ``size`` bytes)."""

    url: str
    path: str
    size: int
    identity: str
    start: int = 0
    object_size: int = -1

    @property
    def whole_size(self) -> int:
        """The object's size on the server (what a change of the object is told by)."""
        return self.object_size if self.object_size >= 0 else self.size

    def key(self, salt: str = "") -> str:
        """A file-name-safe key naming this content of this URL."""
        part = f"|{self.start}|{self.object_size}" if self.object_size >= 0 else ""
        h = hashlib.sha1(f"v{INDEX_VERSION}|{self.url}|{self.size}|{self.identity}|{salt}{part}".encode()).hexdigest()[
            :24
        ]
        base = re.sub(r"[^A-Za-z0-9._-]", "_", self.url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".tar"))[-60:]
        return f"{h}-{base}"


def identity(info: dict[str, Any]) -> str:
    """What identifies an object's content in an fsspec ``info()`` or listing entry (ETag first, else a
    version or a modification time; '' when the backend gives none: the crc32 check still applies)."""
    for k in _IDENTITY_FIELDS + _TIME_FIELDS:
        v = info.get(k)
        if v not in (None, ""):
            return f"{k}={str(v).strip(chr(34))}"
    return ""


def list_shards(
    spec: str,
    storage_options: dict[str, Any] | None = None,
    *,
    suffix: str = ".tar",
    folder: Callable[[str, list[str]], list[str]] | None = None,
) -> tuple[Any, list[ShardInfo]]:
    """The shards ``spec`` names (a brace pattern, one ``.tar`` URL, or a prefix holding ``.tar`` files),
    with sizes and identities fetched fresh from the server. What goes wrong is a `RemoteDataError` naming
    its cause (credentials, access, endpoint, TLS, bucket, shard, a wildcard in the URL).

    Other objects (``suffix=".parquet"``): a ``folder`` rule picks, from the objects of that suffix under a
    prefix (its path, every path found), the ones it names; and a URL may then hold ``*`` wildcards
    (expanded by the store's listing; not over HTTP, which has none)."""
    refused = wildcard(spec)
    globs = folder is not None and not spec.lower().startswith(("http://", "https://"))
    if refused is not None and not (globs and not any(c in spec.split("://", 1)[-1] for c in "?[]")):
        raise refused
    try:
        return _list_shards(spec, storage_options, suffix, folder)
    except RemoteDataError:
        raise
    except Exception as e:
        why = classify(e, spec, storage_options)
        if why is not None:
            raise why from e
        if isinstance(e, TypeError) and storage_options:  # the backend's constructor or session refused one
            keys = ", ".join(sorted(storage_options))
            reason = BAD_OPTIONS.format(keys=keys, scheme=spec.split("://", 1)[0], reason=_first_line(e))
            raise StorageOptionsError(f"{spec}: {reason}") from e
        if isinstance(e, OSError) or type(e).__module__.split(".")[0] in _BACKENDS:
            text = " ".join(f"{type(e).__name__}: {e}".split())
            raise StoreFailedError(
                f"{spec}: {FAILED.format(reason=text if len(text) < 300 else text[:297] + '...')}"
            ) from e
        raise


def _list_shards(
    spec: str,
    storage_options: dict[str, Any] | None,
    suffix: str = ".tar",
    folder: Callable[[str, list[str]], list[str]] | None = None,
) -> tuple[Any, list[ShardInfo]]:
    urls = expand_braces(spec)
    fs, _ = url_to_fs(urls[0], storage_options)
    fs.invalidate_cache()
    if folder is not None and any("*" in u for u in urls):  # http:// was refused by the caller
        urls = _globbed(fs, urls, spec, storage_options)
    if len(urls) == 1 and not urls[0].endswith(suffix):
        root = folder_path(fs, urls[0])
        try:
            found = sorted(p for p in fs.find(root) if p.endswith(suffix))
        except FileNotFoundError as e:
            _raise_cause(e, spec, storage_options)
            found = []
        if folder is not None:
            found = folder(root.rstrip("/"), found)
        if not found:
            what = "shards" if suffix == ".tar" else "files"
            raise NoSuchShardError(
                f"{spec}: no {suffix} {what} there; name them, e.g. {spec.rstrip('/')}/train-{{000000..000099}}{suffix}"
            )
        urls = [fs.unstrip_protocol(p) for p in found]
    paths = [fs._strip_protocol(u) for u in urls]  # noqa: SLF001
    entries: dict[str, dict[str, Any]] = {}
    if set(np.atleast_1d(fs.protocol)) & {"s3", "s3a", "gs", "gcs", "abfs", "az"}:
        # One listing per folder instead of one request per shard.
        for parent in sorted({p.rsplit("/", 1)[0] for p in paths}):
            try:
                for entry in fs.ls(parent, detail=True, refresh=True):
                    entries[entry["name"].rstrip("/")] = entry
            except FileNotFoundError as e:  # no such folder: its shards are missing; no such bucket: said now
                _raise_cause(e, spec, storage_options)

    def info(p: str) -> dict[str, Any] | None:
        if p in entries:
            return entries[p]
        try:
            return fs.info(p)
        except FileNotFoundError as e:  # over HTTP a refused connection is a FileNotFoundError too
            _raise_cause(e, fs.unstrip_protocol(p), storage_options)
            return None

    with ThreadPoolExecutor(16) as pool:
        infos = list(pool.map(info, paths))
    missing = [u for u, i in zip(urls, infos, strict=True) if i is None or i.get("type") == "directory"]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise NoSuchShardError(f"{missing[0]}{more}: {NO_SHARD}")
    shards = [ShardInfo(u, p, int(i["size"]), identity(i)) for u, p, i in zip(urls, paths, infos, strict=True)]
    return fs, shards


def folder_path(fs: Any, url: str) -> str:
    """The path of ``fs`` to list the folder ``url`` at. Over HTTP, the folder's URL with its slash: the
    listing is its index page, whose links are relative to that URL (a server answers the URL without
    the slash with a redirect at best, a 404 at worst); elsewhere the path without it."""
    path = fs._strip_protocol(url).rstrip("/")  # noqa: SLF001 - fsspec's own URL-to-path rule
    return f"{path}/" if url.lower().startswith(("http://", "https://")) else path


def _globbed(fs: Any, urls: list[str], spec: str, storage_options: dict[str, Any] | None) -> list[str]:
    """``urls`` with each ``*`` pattern replaced by the objects it matches (sorted); one that matches none
    is a `NoSuchShardError`."""
    out: list[str] = []
    for url in urls:
        if "*" not in url:
            out.append(url)
            continue
        try:
            found = sorted(fs.glob(fs._strip_protocol(url)))  # noqa: SLF001
        except FileNotFoundError as e:
            _raise_cause(e, spec, storage_options)
            found = []
        if not found:
            raise NoSuchShardError(f"{url}: the pattern matches no object on the server; check the URL")
        out += [fs.unstrip_protocol(p) for p in found]
    return out


def _raise_cause(error: BaseException, url: str, storage_options: dict[str, Any] | None) -> None:
    """Raise the cause of a "not found" when it is another one (no bucket, no access, no connection)."""
    why = classify(error, url, storage_options)
    if why is not None:
        raise why from error


def range_ignored(url: str, got: int, asked: int) -> RangeIgnoredError:
    """The error for ``got`` bytes of ``url`` in answer to a range request of ``asked`` (fewer): a server
    that ignores ``Range`` and sent the whole file. (Fewer bytes than asked is a file cut short instead.)"""
    return RangeIgnoredError(f"{url}: {RANGE_IGNORED.format(got=got, asked=asked)}")


def write_at(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of file ``fd`` (the one place shard bytes reach the disk)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class ShardDownloader:
    """Downloads shards ``infos`` from their object store. Each range request of ``chunk_bytes`` is retried
    with exponential backoff for up to ``retry_seconds`` without progress, and one that hangs is abandoned
    after ``timeout`` seconds; a shard that is gone, changed or truncated on the server, or that still
    fails, raises `ShardError`. ``storage_options`` go to fsspec."""

    def __init__(
        self,
        infos: list[ShardInfo],
        storage_options: dict[str, Any],
        *,
        retry_seconds: float,
        timeout: float,
        chunk_bytes: int,
        fs: Any = None,
    ) -> None:
        self.infos, self.storage_options = infos, storage_options
        self.retry_seconds, self.timeout, self.chunk_bytes = retry_seconds, timeout, chunk_bytes
        self._fs = fs
        self.downloaded_bytes = 0  # by this process

    def forget_connections(self) -> None:
        """Drop the filesystem: fsspec's clients (event loops, connections) do not survive a fork."""
        self._fs = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None}

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = url_to_fs(self.infos[0].url, self.storage_options)[0]
        return self._fs

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the object at ``path`` (every range read goes through here); a
        server that sends more, the whole file, raises `RangeIgnoredError`."""
        fs = self.fs
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            from fsspec.asyn import sync

            data = sync(fs.loop, fs._cat_file, path, start=start, end=end, timeout=self.timeout)  # noqa: SLF001
        else:
            data = fs.cat_file(path, start=start, end=end)
        if len(data) > end - start:
            raise range_ignored(fs.unstrip_protocol(path), len(data), end - start)
        return data

    def changed(self, s: int) -> str | None:
        """Why shard ``s`` on the server is no longer the indexed one, or None (same, or unknown now)."""
        info = self.infos[s]
        try:
            self.fs.invalidate_cache(info.path)
            now = self.fs.info(info.path)
        except FileNotFoundError:
            return "no longer on the server (deleted?)"
        except Exception:  # noqa: BLE001 - the server is unreachable: nothing known, the caller retries
            return None
        size, ident, then = int(now.get("size", -1)), identity(now), info.whole_size
        if size != then:
            what = "truncated" if 0 <= size < then else "changed"
            return f"{what} on the server: {size} bytes now, {then} when indexed"
        if ident != info.identity:
            return f"changed on the server since it was indexed ({info.identity or 'no identity'} then, {ident} now)"
        return None

    def download(self, s: int, tmp: Path, expect_crc: int | None, cancel: Callable[[], bool] | None = None) -> int:
        """Fetch shard ``s`` into ``tmp`` by range requests; retry what fails with backoff; check the size
        and (when known) the crc32 of the index. Returns the crc32."""
        info = self.infos[s]
        crc, offset, backoff, since = 0, 0, 0.1, time.monotonic()
        fd = os.open(tmp, os.O_WRONLY)
        try:
            while offset < info.size:
                if cancel is not None and cancel():
                    raise DownloadCancelled
                end = min(offset + self.chunk_bytes, info.size)
                try:
                    data = self.get_range(info.path, info.start + offset, info.start + end)
                    if len(data) != end - offset:
                        raise OSError(f"got {len(data)} bytes of {end - offset} asked for at offset {offset}")
                except FileNotFoundError as e:
                    raise ShardError(f"{info.url}: no longer on the server (deleted?)") from e
                except Exception as e:  # noqa: BLE001 - network and server errors of every backend: retried
                    cause = classify(e, info.url, self.storage_options)
                    if isinstance(cause, PERMANENT):  # credentials, access, TLS, ranges ignored: no retry mends them
                        cause.__cause__ = e
                        raise ShardError(str(cause)) from cause
                    # Is it the object that changed? Asked once per stretch of failures (an unreachable
                    # server would only make each retry slower).
                    why = self.changed(s) if backoff == 0.1 else None
                    if why is not None:
                        raise ShardChanged(f"{info.url}: {why}; open the data set again to re-index it") from e
                    waited = time.monotonic() - since
                    if waited >= self.retry_seconds:
                        text = str(cause).removeprefix(f"{info.url}: ") if cause is not None else _first_line(e)
                        raise ShardError(f"{info.url}: download failed after retrying for {waited:.0f}s: {text}") from e
                    log.info("retrying %s at byte %d in %.1fs: %s: %s", info.url, offset, backoff, type(e).__name__, e)
                    time.sleep(min(backoff, max(0.0, self.retry_seconds - waited)))
                    backoff = min(backoff * 2, 10.0)
                    continue
                write_at(fd, data, offset)
                crc = zlib.crc32(data, crc)
                offset = end
                backoff, since = 0.1, time.monotonic()
            os.fsync(fd)  # a renamed shard is whole, even after a power cut
        finally:
            os.close(fd)
        if expect_crc is not None and crc != expect_crc:
            why = self.changed(s) or "its bytes differ from the indexed ones (crc32)"
            raise ShardChanged(f"{info.url}: {why}; open the data set again to re-index it")
        self.downloaded_bytes += info.size
        return crc
