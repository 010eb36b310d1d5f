"""`write_shards`: samples written as WebDataset tar shards (see `shards` for how they are read), each
shard atomically, to a folder or an object store; the writer an engine's task calls once per partition.

A shard is a plain tar of ``KEY.jpg`` (or ``.png``) with ``KEY.cls`` (a class index as text) or
``KEY.json`` (``{"labels": [...]}``: class indices or numbers). The headers are fixed (mtime 0, uid and
gid 0, no user names, mode 0644, GNU long names), so the same samples give the same bytes on every
machine and in every run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import reprlib
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from ...files import atomic_file, check_writable_folder, clean_stale
from ...text import plural
from ..base import check_on_error
from ..checks import JPEG_SOI, PNG_SIGNATURE, check_encoded
from ..remote.store import is_remote, url_to_fs
from ..shards import MAX_LABEL

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 256 * 2**20
BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")

Sample = tuple[str, list[tuple[bytes, Any]], int]  # (key, [(tar header, payload)], its bytes in the tar)


def shard_name(prefix: str, index: int) -> str:
    """The file name of shard ``index`` of ``prefix``: ``{prefix}-000000.tar``, ...."""
    return f"{prefix}-{index:06d}.tar"


def sample_key(prefix: str, position: int) -> str:
    """The key of the record at ``position`` of a partition written under ``prefix``: unique across the
    partitions of a data set because their prefixes are."""
    return f"{prefix}-{position:09d}"


@dataclass
class ShardReport:
    """What `write_shards` wrote, what it left out, and the stale shards it removed.

    Attributes:
        dst: the folder or URL written to.
        prefix: the shards' names' start (``PREFIX-000000.tar``, ...).
        shards: the shards' names, in order.
        samples: the samples written.
        bytes: the shards' bytes, tar headers included.
        skipped: (where, why) of each record left out.
        removed: the stale shards of the prefix (from an earlier, longer run) it removed.
        reencoded: images re-encoded to fit ``max_side``.
        seconds: how long it took.
    """

    dst: str
    prefix: str
    shards: list[str] = field(default_factory=list)
    samples: int = 0
    bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    reencoded: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"wrote {plural(self.samples, 'sample')} in {plural(len(self.shards), 'shard')} "
            f"({self.bytes / 2**20:.1f} MiB) to {self.dst} in {self.seconds:.1f}s; "
            f"re-encoded {self.reencoded}, left out {len(self.skipped)}"
        )


def _header(name: str, size: int) -> bytes:
    """A tar header that depends on nothing but ``name`` and ``size``."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "strict")


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _image_extension(data: memoryview) -> str:
    return "jpg" if data[:3] == JPEG_SOI else "png" if data[:8] == PNG_SIGNATURE else ""


def encode_target(target: object) -> tuple[str, bytes]:
    """(extension, bytes) of a target's member: an int class index as ``.cls`` text; a list or 1-D array
    of class indices or numbers (or one float) as ``.json`` ``{"labels": [...]}`` (an empty list: a
    multi-hot sample of no class). Anything else is a ValueError saying what a target may be."""
    if isinstance(target, np.ndarray) and target.ndim == 0:
        target = target.item()
    if isinstance(target, int | np.integer) and not isinstance(target, bool | np.bool_):
        if not 0 <= int(target) <= MAX_LABEL:
            raise ValueError(f"class index {int(target)} is outside 0..{MAX_LABEL}")
        return "cls", str(int(target)).encode()
    if isinstance(target, float | np.floating):
        target = [float(target)]
    if isinstance(target, list | tuple | np.ndarray):
        values = np.asarray(target).tolist() if isinstance(target, np.ndarray) else list(target)
        ok = all(isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool) for v in values)
        if not ok or not np.isfinite(np.asarray(values, dtype=np.float64)).all():
            raise ValueError(f"target {reprlib.repr(target)}: a list target holds finite numbers only")
        plain = [int(v) if isinstance(v, int | np.integer) else float(v) for v in values]
        return "json", json.dumps({"labels": plain}, separators=(",", ":")).encode()
    raise ValueError(
        f"target {reprlib.repr(target)} ({type(target).__name__}): use an int class index, or a list of class indices or numbers"
    )


def _image(data: object) -> memoryview:
    """The bytes of an image as given (bytes, a buffer, a 1-D uint8 array), without a copy."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ValueError(f"a {data.dtype} array of shape {data.shape} is not encoded bytes (a 1-D uint8 array)")
        return memoryview(np.ascontiguousarray(data)).cast("B")
    try:
        return memoryview(data).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{type(data).__name__} is not encoded bytes (bytes, a buffer or a uint8 array)") from None


def _samples(records: Iterable[Any], prefix: str, on_error: str, skipped: list[tuple[str, str]]) -> Iterator[Sample]:
    """Each good record as a sample ready to write; a bad one raises in one line naming its position, or
    is listed in ``skipped`` (``on_error="skip"``)."""
    for position, record in enumerate(records):
        key = sample_key(prefix, position)
        try:
            if not isinstance(record, tuple | list) or len(record) != 2:
                raise ValueError(f"a {type(record).__name__}, not an (encoded bytes, target) pair")
            image = _image(record[0])
            reason = check_encoded(record[0] if isinstance(record[0], bytes) else np.frombuffer(image, np.uint8))
            if reason is not None:
                raise ValueError(f"{reason}; write_shards stores whole JPEG or PNG files")
            ext, label = encode_target(record[1])
        except ValueError as e:
            if on_error == "raise":
                raise ValueError(f"record {position} of prefix {prefix!r}: {e}; fix it, or pass on_error='skip'") from e
            skipped.append((f"record {position} ({key})", str(e)))
            continue
        members = [(_header(f"{key}.{_image_extension(image)}", len(image)), image)]
        members.append((_header(f"{key}.{ext}", len(label)), label))
        yield key, members, sum(len(h) + _padded(len(data)) for h, data in members)


def _write_sample(f: IO[bytes], members: list[tuple[bytes, Any]]) -> None:
    for header, payload in members:
        f.write(header)
        f.write(payload)
        f.write(b"\0" * (_padded(len(payload)) - len(payload)))


def _fill(f: IO[bytes], first: Sample, samples: Iterator[Sample], shard_size: int) -> tuple[Sample | None, int, int]:
    """Write ``first`` and as many of ``samples`` as keep the shard within ``shard_size`` bytes, then the
    end of the archive: (the sample that did not fit, samples written, the shard's bytes)."""
    used, count, pending = 0, 0, None
    sample: Sample | None = first
    while sample is not None:
        key, members, size = sample
        if count and used + size + len(END_OF_ARCHIVE) > shard_size:
            pending = sample
            break
        if size + len(END_OF_ARCHIVE) > shard_size:
            log.warning("%s: %d bytes, more than the shard size %d; it gets a shard of its own", key, size, shard_size)
        _write_sample(f, members)
        used, count = used + size, count + 1
        sample = next(samples, None)
    f.write(END_OF_ARCHIVE)
    return pending, count, used + len(END_OF_ARCHIVE)


def check_shard_arguments(prefix: str, shard_size: int, on_error: str) -> None:
    """Refuse a bad prefix, shard size or ``on_error`` in one line, before any work."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"prefix={prefix!r}: use letters, digits, '_' and '-' (it names the shards and starts each key, so "
            "no '.', '/' or spaces), e.g. prefix=f'train-{partition:05d}'"
        )
    if isinstance(shard_size, bool) or not isinstance(shard_size, int | np.integer) or shard_size < 1:
        raise ValueError(f"shard_size={shard_size!r}: a positive number of bytes, e.g. 256 * 2**20")
    check_on_error(on_error)


def write_shards(
    records: Iterable[tuple[Any, Any]],
    dst: str | os.PathLike,
    *,
    prefix: str = "shard",
    shard_size: int = DEFAULT_SHARD_SIZE,
    on_error: str = "raise",
    storage_options: dict[str, Any] | None = None,
) -> ShardReport:
    """Write ``records`` as WebDataset shards ``{prefix}-000000.tar``, ``{prefix}-000001.tar``, ... in ``dst``.

    Call it once per partition of a data set (an engine's task: Ray Data ``map_batches``, Spark
    ``mapPartitions``), each partition with its own ``prefix`` (``f"train-{partition:05d}"``): the
    partitions written into one folder read back as one data set (`open_dataset`), every key unique (a
    record's key is ``{prefix}-{position:09d}``, its position in the partition).

    Each shard is written to a temporary file beside its final name and renamed when complete (fsynced),
    so a killed writer never leaves a partial shard under a shard's name. A retried task rewrites its
    shards under the same names and removes the ones of its prefix numbered beyond the last it wrote
    (``report.removed``): give two partitions the same prefix and the second replaces the first.

    Args:
        records: ``(encoded bytes, target)`` pairs. The bytes (``bytes``, a buffer or a uint8 array) are a
            whole JPEG or PNG, stored as ``.jpg``/``.png`` by their signature. The target is an int class
            index (written as ``.cls``) or a list of class indices or numbers (``.json``,
            ``{"labels": [...]}``; one float is written as a list of one).
        dst: a folder (made if needed), or a URL (``s3://bucket/train``, any fsspec URL): each finished
            shard is then written to a local temporary file and uploaded while the next is written (an
            object store makes an object visible only once it is whole).
        prefix: names the shards and starts each key: letters, digits, ``_`` and ``-``.
        shard_size: a shard's most bytes (tar headers included); a new shard starts before a sample
            that would pass it, and a sample larger than this alone gets a shard of its own.
        on_error: a record that is not JPEG/PNG bytes with a valid target: ``"raise"`` (a ValueError
            naming its position) or ``"skip"`` (left out and listed in ``report.skipped``).
        storage_options: for a URL, passed to fsspec (e.g. ``{"endpoint_url": ...}``).

    Returns:
        A `ShardReport`: shard names, samples, bytes, what was left out and removed.
    """
    t0 = time.perf_counter()
    check_shard_arguments(prefix, shard_size, on_error)
    report = ShardReport(dst=str(dst), prefix=prefix)
    samples = _samples(records, prefix, on_error, report.skipped)
    remote = is_remote(dst)
    with _Destination(str(dst), storage_options) if remote else _LocalDestination(Path(dst)) as out:
        sample = next(samples, None)
        while sample is not None:
            name = shard_name(prefix, len(report.shards))
            with out.open(name) as f:
                sample, count, size = _fill(f, sample, samples, int(shard_size))
            report.shards.append(name)
            report.samples += count
            report.bytes += size
        report.removed = out.remove_stale(prefix, len(report.shards))
    report.seconds = time.perf_counter() - t0
    if report.skipped:
        log.warning("%s left out (first: %s: %s)", plural(len(report.skipped), "record"), *report.skipped[0])
    log.debug(report.summary())
    return report


_STALE = "{prefix}-(\\d{{6,}})\\.tar"


def stale_shards(names: Iterable[str], prefix: str, count: int) -> list[str]:
    """The shard names of ``prefix`` numbered ``count`` or more (left by an earlier, longer write)."""
    pattern = re.compile(_STALE.format(prefix=re.escape(prefix)))
    found = ((n, pattern.fullmatch(n)) for n in names)
    return sorted(n for n, m in found if m is not None and int(m.group(1)) >= count)


class _LocalDestination:
    """Shards in a local folder, each through `atomic_file`."""

    def __init__(self, folder: Path) -> None:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder}: a file, not a folder; write_shards writes shards into a folder")
        check_writable_folder(folder, "write_shards destination")
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder

    def __enter__(self) -> _LocalDestination:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def open(self, name: str) -> Any:
        return atomic_file(self.folder / name, durable=True)

    def remove_stale(self, prefix: str, count: int) -> list[str]:
        names = [p.name for p in self.folder.iterdir()]
        # the temporaries that killed writers of this prefix left, beyond the shards just written too
        for name in stale_shards((n[1:].split(".tar.", 1)[0] + ".tar" for n in names if n.endswith(".tmp")), prefix, 0):
            clean_stale(self.folder / name)
        stale = stale_shards(names, prefix, count)
        for name in stale:
            log.info("removing %s: a shard of prefix %s beyond the %d just written", self.folder / name, prefix, count)
            (self.folder / name).unlink(missing_ok=True)
        return stale


class _Destination:
    """Shards at a URL: each written to a local temporary folder, then uploaded by one thread while the
    next is written (at most one upload in flight), and its local copy removed."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url, storage_options)
        self.root = self.root.rstrip("/")
        self.staging = Path(tempfile.mkdtemp(prefix="dali_fast-shards-"))
        self.uploader = ThreadPoolExecutor(1, thread_name_prefix="dali_fast-upload")
        self.upload: Future | None = None

    def __enter__(self) -> _Destination:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.upload is not None and exc[0] is None:
                self.upload.result()
        finally:
            self.uploader.shutdown(wait=True, cancel_futures=True)
            shutil.rmtree(self.staging, ignore_errors=True)

    def open(self, name: str) -> Any:
        return _Staged(self.staging / name, lambda path: self._submit(path, f"{self.root}/{name}"))

    def _submit(self, path: Path, remote: str) -> None:
        if self.upload is not None:
            self.upload.result()  # the previous shard is up: one local shard waits at most
        self.upload = self.uploader.submit(self._put, path, remote)

    def _put(self, path: Path, remote: str) -> None:
        try:
            self.fs.put_file(str(path), remote)
        finally:
            path.unlink(missing_ok=True)

    def remove_stale(self, prefix: str, count: int) -> list[str]:
        if self.upload is not None:
            self.upload.result()
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False, refresh=True)]
        except FileNotFoundError:
            names = []
        stale = stale_shards(names, prefix, count)
        for name in stale:
            log.info("removing %s/%s: a shard of prefix %s beyond the %d just written", self.url, name, prefix, count)
            self.fs.rm_file(f"{self.root}/{name}")
        return stale


class _Staged:
    """A local file that is handed to ``done`` once written whole (and removed if writing it fails)."""

    def __init__(self, path: Path, done: Callable[[Path], None]) -> None:
        self.path, self.done = path, done

    def __enter__(self) -> IO[bytes]:
        self.f = open(self.path, "wb")  # noqa: SIM115 - closed in __exit__
        return self.f

    def __exit__(self, kind: object, *exc: object) -> None:
        self.f.close()
        if kind is not None:
            self.path.unlink(missing_ok=True)
            return
        self.done(self.path)
