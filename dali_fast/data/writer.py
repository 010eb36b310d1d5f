"""`pack`: an ImageFolder (or WebDataset shards) written as a packed data set (see `format`), atomically.

Worker processes read, verify and re-encode; one writer writes in the source order, so the output is
byte-identical for any number of workers, and only a fixed number of images is in flight.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..system import atomic_dir, available_cpus, die_with_parent, plural, progress_bar
from ..transforms.decode import verdict
from .checks import JPEG_SOI, PNG_SIGNATURE, check_encoded, pillow_reason
from .folder import scan_image_folder
from .format import (
    DATA_FILE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    INDEX_FILE,
    MAGIC,
    META_FILE,
    PATHS_FILE,
    RECORD_DTYPE,
    SHARD_FILE,
)
from .shards import is_webdataset
from .webdataset import WebDatasetReader

log = logging.getLogger(__name__)


@dataclass
class PackReport:
    """What `pack` wrote, the images it left out (``skipped``: (path, reason)), and what it found that is not
    an image (``ignored``: (path, what it is): other files, links that loop or lead nowhere...)."""

    dst: Path
    records: int
    classes: int
    data_bytes: int
    reencoded: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    ignored: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"packed {self.records} records of {self.classes} classes ({self.data_bytes / 2**20:.1f} MiB) "
            f"into {self.dst} in {self.seconds:.1f}s; re-encoded {self.reencoded}, left out {len(self.skipped)}"
        ) + (f"; ignored {plural(len(self.ignored), 'non-image')}" if self.ignored else "")


# pragma: no mutate start (decoding and re-encoding with Pillow; its results are tested through pack)
def _prepare(raw: bytes, verify: bool, max_side: int | None, name: str) -> tuple[bytes | None, str | None, bool]:
    """(bytes to store, reason it was left out, whether it was re-encoded) for the image file ``name``.

    ``verify`` decodes it by the one rule (`verdict`: a JPEG strictly, so that damage libjpeg-turbo
    reports leaves it out); without it, only the structural check. Either way the pixel limit holds."""
    if not raw:
        return None, "empty file", False
    reason = verdict(raw, name) if verify else check_encoded(raw)
    if reason is not None:
        return None, _unsupported(raw) or reason, False
    if max_side is None:
        return raw, None, False
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as im:
            if max(im.size) > max_side:
                scale = max_side / max(im.size)
                size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
                out = io.BytesIO()
                im.convert("RGB").resize(size, Image.BILINEAR, reducing_gap=3.0).save(out, "JPEG", quality=90)
                return out.getvalue(), None, True
            im.load()
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
        return None, pillow_reason(e, name), False
    return raw, None, False


def _unsupported(raw: bytes) -> str | None:
    """ "unsupported format X" for an image Pillow knows that is neither JPEG nor PNG, else None."""
    if raw[:3] == JPEG_SOI or raw[:8] == PNG_SIGNATURE:
        return None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as im:
            return f"unsupported format {im.format}; only JPEG and PNG are packed"
    except Exception:  # noqa: BLE001 - not an image Pillow knows either: the structural reason stands
        return None


# pragma: no mutate end


Source = str | tuple[str, int, int]  # a file, or (file, offset, size) of a member inside one (a tar shard)


@dataclass(frozen=True)
class _Item:
    """One image to pack: where its bytes are, its label, its name in reports and in paths.bin."""

    source: Source
    label: int
    shown: str
    stored: bytes


def _load_one(source: Source, name: str, verify: bool, max_side: int | None) -> tuple[bytes | None, str | None, bool]:
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
    return _prepare(raw, verify, max_side, name)


# pragma: no mutate start (runs only in worker processes, where mutmut cannot map tests to it; the
# byte-identical test of 1, 2 and 4 workers covers it)
def _load_chunk(
    sources: list[tuple[Source, str]], verify: bool, max_side: int | None, max_image_pixels: int | None
) -> list[tuple[bytes | None, str | None, bool]]:
    """`_load_one` for each (source, name), in a worker process, under the parent's pixel limit (a spawned
    worker would start from Pillow's default)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_image_pixels
    return [_load_one(p, name, verify, max_side) for p, name in sources]


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
            yield item, _load_one(item.source, item.shown, verify, max_side)
        return
    import multiprocessing
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    chunks = (items[i : i + PACK_CHUNK] for i in range(0, len(items), PACK_CHUNK))
    # fork, as DataLoader's workers on Linux: forkserver and spawn would re-run the caller's script in
    # every worker unless it guards itself with `if __name__ == "__main__"`.
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    from PIL import Image  # its MAX_IMAGE_PIXELS goes with each task

    # workers die with this process, even when it is killed: no worker is left waiting for tasks forever
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        pending: deque = deque()

        def submit() -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append(
                    (
                        chunk,
                        pool.submit(
                            _load_chunk, [(i.source, i.shown) for i in chunk], verify, max_side, Image.MAX_IMAGE_PIXELS
                        ),
                    )
                )

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
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.bar = progress_bar(total, desc, "img", enabled=enabled)

    def update(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.bar.update(1)
        if not self.bar.disable and self.bar.n % 64 == 0:
            mb_s = self.bytes / 2**20 / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{mb_s:.1f} MB/s", refresh=False)

    def close(self) -> None:
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
    for name, given in (("src", src), ("dst", dst)):
        if not os.fspath(given):  # Path("") is the current folder
            raise ValueError(f"{name} is an empty path (''); name a folder")
    src, dst = Path(src), Path(dst)
    shards = _check_pack_arguments(src, dst, max_side, workers, shard_size)
    classes, items, report = _sources(src, dst, shards)
    if workers is None:  # every CPU, where starting the worker processes pays off
        workers = available_cpus() if len(items) >= PACK_SMALL else 1
    workers = min(workers, available_cpus())  # more processes than CPUs only compete (warned above)
    with atomic_dir(dst, doing="packing", what="pack") as tmp:
        bar = _PackProgress(len(items), f"pack {src.name}", progress)
        try:  # the bar is closed before any error is written under it
            prepared = _prepared(items, verify, max_side, workers)
            rows, data_bytes, paths_bytes = _write_records(tmp, prepared, len(items), shard_size, report, bar)
        finally:
            bar.close()
        _write_index(tmp, rows, data_bytes, paths_bytes, len(classes), shard_size)
        meta = {
            "format_version": FORMAT_VERSION,
            "classes": classes,
            "source_root": str(src.resolve()),
            "records": len(rows),
            "skipped": len(report.skipped),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))  # pragma: no mutate (layout of the text only)
    report.records, report.data_bytes = len(rows), data_bytes
    report.seconds = time.perf_counter() - t0
    for path, what in report.ignored:
        log.warning("not an image, ignored: %s (%s)", path, what)
    for path, reason in report.skipped:
        log.warning("left out %s: %s", path, reason)
    log.debug(report.summary())  # pragma: no mutate (debug log)
    return report


def _check_pack_arguments(
    src: Path, dst: Path, max_side: int | None, workers: int | None, shard_size: int | None
) -> bool:
    """Refuse bad arguments in one line before any work; returns whether ``src`` names WebDataset shards."""
    shards = is_webdataset(src)
    if not shards and not src.is_dir():
        raise FileNotFoundError(f"{src}: no such folder; pack expects an ImageFolder root SRC/<class>/<image>")
    if dst.exists():
        raise FileExistsError(f"{dst}: already exists; remove it or choose another destination")
    if src.is_dir() and dst.resolve().is_relative_to(src.resolve()):  # the next pack would read it as a class
        raise ValueError(f"{dst}: inside the source {src}; choose a destination outside it")
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side={max_side}: must be a positive number of pixels")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers}: must be 1 or more")
    if workers is not None and workers > available_cpus():
        log.warning(
            "workers=%d: more than the %s this process may use; packing with %d",
            workers,
            plural(available_cpus(), "CPU"),
            available_cpus(),
        )
    if shard_size is not None and shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: must be a positive number of bytes")
    return shards


def _sources(src: Path, dst: Path, shards: bool) -> tuple[list[str], list[_Item], PackReport]:
    """(classes, the images to pack, the report so far: what is left out before reading any image)."""
    if shards:  # WebDataset shards: converted to a packed set
        wds = WebDatasetReader(str(src))
        classes, other, unlisted = wds.classes, [], list(wds.skipped)
        labels = wds.labels
        items = []
        for i in range(len(wds)):
            name = wds.source(i)
            items.append(_Item(wds.member(i), int(labels[i]), name, os.fsencode(name)))
    else:
        classes, found, other, unlisted = scan_image_folder(src, broken_links_are_records=False)
        items = [_Item(str(p), label, str(p), os.fsencode(p.relative_to(src))) for p, label in found]
    if not items:
        raise ValueError(f"{src}: no .jpg/.jpeg/.png files under class sub-folders; expected SRC/<class>/<image>")
    report = PackReport(dst=dst, records=0, classes=len(classes), data_bytes=0)
    report.skipped += unlisted
    report.ignored += other
    return classes, items, report


def _write_records(
    tmp: Path,
    prepared: Iterator[tuple[_Item, tuple[bytes | None, str | None, bool]]],
    count: int,
    shard_size: int | None,
    report: PackReport,
    bar: _PackProgress,
) -> tuple[np.ndarray, int, int]:
    """Write the prepared images and their paths in order: (the index rows, data bytes, path bytes)."""
    rows = np.zeros(count, dtype=RECORD_DTYPE)
    n = offset = path_offset = 0
    data_out = _DataWriter(tmp, shard_size)
    with open(tmp / PATHS_FILE, "wb") as paths_f:
        for item, (payload, reason, reencoded) in prepared:
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
        data_out.close()
        paths_f.flush()
        os.fsync(paths_f.fileno())
    return rows[:n], offset, path_offset


def _write_index(
    tmp: Path, rows: np.ndarray, data_bytes: int, paths_bytes: int, classes: int, shard_size: int | None
) -> None:
    """index.bin: the header (with the crc32 of the rows) and the rows."""
    header = np.zeros(1, dtype=HEADER_DTYPE)
    header[0] = (
        MAGIC,
        FORMAT_VERSION,
        RECORD_DTYPE.itemsize,
        len(rows),
        data_bytes,
        paths_bytes,
        zlib.crc32(rows.tobytes()),
        classes,
        shard_size or 0,
        0,
    )
    with open(tmp / INDEX_FILE, "wb") as f:
        f.write(header.tobytes())
        f.write(rows.tobytes())
        f.flush()
        os.fsync(f.fileno())
