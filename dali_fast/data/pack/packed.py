"""`pack`: an ImageFolder (WebDataset shards, Parquet files, any data set `open_dataset` opens) written as a
packed data set (see `format`), atomically.

Worker processes read, verify and re-encode; one writer writes in the source order, so the output is
byte-identical for any number of workers, and only a fixed number of images is in flight.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...files import atomic_dir
from ...text import progress_bar
from ..base import Reader
from ..format import (
    DATA_FILE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    INDEX_FILE,
    MAGIC,
    META_FILE,
    PATHS_FILE,
    SHARD_FILE,
    TARGET_CODES,
    encode_targets,
    record_dtype,
)
from ..open import open_dataset
from ..parquet_index import is_parquet
from ..remote.store import is_remote
from ..shards import is_webdataset
from ..targets import check_target
from .pool import PACK_CHUNK, check_destination, check_pack_options, pool_size, prepared_in_order
from .report import PackReport
from .sources import Item, PackSources, load_chunk, pack_sources, reader_sources, use_reader

log = logging.getLogger(__name__)


def _prepared(
    items: list[Item], verify: bool, max_side: int | None, workers: int
) -> Iterator[tuple[Item, tuple[bytes | None, str | None, bool]]]:
    """(item, prepared) for each item, in order, read and prepared by `pool.prepared_in_order` (a chunk of
    `PACK_CHUNK` images per task)."""
    from PIL import Image  # its MAX_IMAGE_PIXELS goes with each task

    def tasks() -> Iterator[tuple[list[Item], tuple]]:
        for k in range(0, len(items), PACK_CHUNK):
            chunk = items[k : k + PACK_CHUNK]
            yield chunk, ([(item.source, item.shown) for item in chunk], verify, max_side, Image.MAX_IMAGE_PIXELS)

    for chunk, results in prepared_in_order(tasks(), load_chunk, workers):
        yield from zip(chunk, results, strict=True)


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
    src: str | os.PathLike | Reader,
    dst: str | os.PathLike,
    *,
    verify: bool = True,
    max_side: int | None = None,
    progress: bool = True,  # pragma: no mutate (display only)
    workers: int | None = None,
    shard_size: int | None = None,
    target: str | None = None,
    num_classes: int | None = None,
) -> PackReport:
    """Pack an ImageFolder root into a packed data set at ``dst``, atomically.

    Classes are the sorted sub-folders of ``src`` (as in torchvision's ImageFolder). ``src`` may also be
    WebDataset shards, Parquet files, anything `open_dataset` opens, or a reader: its records, classes
    and names are packed, and its bad records (a null image or label in Parquet) left out and listed.
    ``verify`` decodes each image once and leaves out what does not decode (listed in the
    report); ``max_side`` re-encodes larger images as JPEG (quality 90). Nothing appears at
    ``dst`` until the whole data set is written.

    ``workers`` processes (default: every CPU this process may use) read, verify and re-encode;
    one writer writes in the source order, so the output is byte-identical for any number of
    workers, and only a fixed number of images is in flight, whatever the data set's size.

    ``shard_size`` (bytes) writes the images into ``data-00000.bin``, ``data-00001.bin``, ... of at most
    that size each (no record spans two), under one index: files stay under file-system and object-store
    limits, and a record is still found in O(1) (its offset is shard * shard_size + offset in the shard).

    ``target="multihot"`` (with ``num_classes``) or ``"float"`` packs each record's target too, as a
    fixed-width block at the end of its index row (see `format`), read from the source's target lists
    (`open_dataset`'s ``target``: each sample's ``.json``, ``labels.csv`` beside the class folders, a
    Parquet list column); a reader packs its own targets. A record whose target is bad (an index outside
    the classes, a number that is not finite) is left out and listed, as an undecodable image is.

    Args:
        src: an ImageFolder root, anything `open_dataset` opens (a URL too), or a reader.
        dst: the packed set's folder; must not exist.
        verify: decode every image once and leave out (and list) what does not decode.
        max_side: re-encode images whose longer side exceeds this many pixels (None: keep every image).
        progress: show a progress bar.
        workers: processes that read, verify and re-encode (None: every CPU for large sets).
        shard_size: the most bytes of each data file (None: one ``data.bin``).
        target: pack each record's target rows too: "multihot" or "float" (None: the source's own kind).
        num_classes: K of ``target="multihot"``.

    Returns:
        A `PackReport`: records, classes, bytes, what was left out and why.
    """
    t0 = time.perf_counter()
    for name, given in (("src", src), ("dst", dst)):
        if not isinstance(given, Reader) and not os.fspath(given):  # Path("") is the current folder
            raise ValueError(f"{name} is an empty path (''); name a folder")
    check_target(target, num_classes)
    targets = {"target": target, "num_classes": num_classes}
    if isinstance(src, Reader) and (target is not None or num_classes is not None):
        raise ValueError("target= and num_classes= are for a path; a reader packs its own targets (open it with them)")
    if is_remote(src):  # data at a URL is read through its reader (a Path would make "s3:/..." of it)
        src = open_dataset(str(src), **targets)  # type: ignore[arg-type]
    reader = src if isinstance(src, Reader) else None
    if reader is not None:  # a reader: named by its folder where it has one (meta.json's source_root)
        src = getattr(reader, "path", type(reader).__name__)
    src, dst = Path(src), Path(dst)  # type: ignore[arg-type]
    kind = _check_pack_arguments(src, dst, max_side, workers, shard_size, reader is not None)
    if kind == "reader":
        reader = reader if reader is not None else open_dataset(src, **targets)  # type: ignore[arg-type]
        found = reader_sources(reader)
    else:
        found = pack_sources(src, kind == "webdataset", target, num_classes)
    classes, items, report = found.classes, found.items, _report(found, dst)
    workers = pool_size(workers, len(items))
    if reader is not None and sys.platform != "linux":
        workers = 1  # a reader reaches the workers by fork (`pack_sources.use_reader`): Linux's start method here
    use_reader(reader)
    with atomic_dir(dst, doing="packing", what="pack") as tmp:
        bar = _PackProgress(len(items), f"pack {src.name}", progress)
        try:  # the bar is closed before any error is written under it
            prepared = _prepared(items, verify, max_side, workers)
            rows, data_bytes, paths_bytes = _write_records(
                tmp, prepared, len(items), shard_size, report, bar, found.targets
            )
        finally:
            bar.close()
        use_reader(None)
        _write_index(tmp, rows, data_bytes, paths_bytes, len(classes), shard_size, report)
        meta = {
            "format_version": FORMAT_VERSION,
            "classes": classes,
            "source_root": str(src.resolve()),
            "records": len(rows),
            "skipped": len(report.skipped),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if report.target != "class":
            meta.update(target=report.target, target_width=report.target_width)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))  # pragma: no mutate (layout of the text only)
    report.records, report.data_bytes = len(rows), data_bytes
    report.seconds = time.perf_counter() - t0
    for path, what in report.ignored:
        log.warning("not an image, ignored: %s (%s)", path, what)
    for path, reason in report.skipped:
        log.warning("left out %s: %s", path, reason)
    for shard, what in report.damaged:
        log.warning("damaged shard %s: %s", shard, what)
    log.debug(report.summary())  # pragma: no mutate (debug log)
    return report


def _check_pack_arguments(
    src: Path, dst: Path, max_side: int | None, workers: int | None, shard_size: int | None, reader: bool = False
) -> str:
    """Refuse bad arguments in one line before any work; returns what ``src`` is: "folder" (an ImageFolder),
    "webdataset" (shards) or "reader" (Parquet, a packed set, a reader: read through `open_dataset`)."""
    other = reader or is_parquet(src) or (src / INDEX_FILE).is_file()
    shards = not other and is_webdataset(src)
    if not shards and not other and not src.is_dir():
        raise FileNotFoundError(f"{src}: no such folder; pack expects an ImageFolder root SRC/<class>/<image>")
    check_destination(dst, src)
    check_pack_options(max_side, workers)
    if shard_size is not None and shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: must be a positive number of bytes")
    return "webdataset" if shards else "reader" if other else "folder"


def _report(found: PackSources, dst: Path) -> PackReport:
    """The report so far: what is left out before any image is read, the damaged shards, the non-images,
    the targets' kind."""
    report = PackReport(
        dst=dst,
        records=0,
        classes=len(found.classes),
        data_bytes=0,
        skipped=found.left_out,
        damaged=found.damaged,
        ignored=found.ignored,
    )
    if found.targets is not None:
        report.target, report.target_width = found.targets.kind, found.targets.width
    return report


def _write_records(
    tmp: Path,
    prepared: Iterator[tuple[Item, tuple[bytes | None, str | None, bool]]],
    count: int,
    shard_size: int | None,
    report: PackReport,
    bar: _PackProgress,
    targets: Any = None,
) -> tuple[np.ndarray, int, int]:
    """Write the prepared images and their paths in order: (the index rows, data bytes, path bytes). A
    row's crc32 covers the record's bytes, then its target block."""
    rows = np.zeros(count, dtype=record_dtype(report.target, report.target_width))
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
            crc = zlib.crc32(payload)
            if targets is None:
                rows[n] = (at, len(payload), item.label, crc, len(pbytes), path_offset)
            else:
                block = encode_targets(targets.rows([item.index]), targets.kind, targets.width)[0]
                crc = zlib.crc32(block.tobytes(), crc)
                rows[n] = (at, len(payload), item.label, crc, len(pbytes), path_offset, block)
            paths_f.write(pbytes)
            offset += len(payload)
            path_offset += len(pbytes)
            n += 1
        data_out.close()
        paths_f.flush()
        os.fsync(paths_f.fileno())
    return rows[:n], offset, path_offset


def _write_index(
    tmp: Path,
    rows: np.ndarray,
    data_bytes: int,
    paths_bytes: int,
    classes: int,
    shard_size: int | None,
    report: PackReport,
) -> None:
    """index.bin: the header (with the crc32 of the rows, and what the rows' target blocks hold) and the rows."""
    header = np.zeros(1, dtype=HEADER_DTYPE)
    header[0] = (
        MAGIC,
        FORMAT_VERSION,
        rows.dtype.itemsize,
        len(rows),
        data_bytes,
        paths_bytes,
        zlib.crc32(rows.tobytes()),
        classes,
        shard_size or 0,
        TARGET_CODES[report.target],
        report.target_width,
    )
    with open(tmp / INDEX_FILE, "wb") as f:
        f.write(header.tobytes())
        f.write(rows.tobytes())
        f.flush()
        os.fsync(f.fileno())
