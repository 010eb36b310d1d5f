"""What `pack` reads: the images of an ImageFolder, of WebDataset shards or of any reader `open_dataset` opens
(Parquet files, another packed set), in the source order, each with its label, its name and its target,
what is left out before any image is read (`pack_sources`; a reader's records by its checked reads), and each image read and
prepared (verified, re-encoded) in this process or in `pack`'s worker processes. A reader reaches forked
workers as this module's reader (`use_reader`)."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base import LabelledReader, Reader, provides, read_batch_checked
from ..checks import JPEG_SOI, PNG_SIGNATURE, check_encoded, pillow_reason
from ..folder import LABELS_CSV, read_labels_csv, scan_image_folder
from ..targets import ListTargets, reader_targets
from ..verify import verdict
from ..webdataset import WebDatasetReader

_READER: Reader | None = None


# pragma: no mutate start (decoding and re-encoding with Pillow; its results are tested through pack)
def prepare(raw: bytes, verify: bool, max_side: int | None, name: str) -> tuple[bytes | None, str | None, bool]:
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


PACKED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF", "PPM")  # what the structural check reads (PPM: PGM too)


def _unsupported(raw: bytes) -> str | None:
    """ "unsupported format X" for an image Pillow knows that the loaders do not read (GIF, JPEG 2000...),
    else None (then the structural or decoding reason stands)."""
    if raw[:3] == JPEG_SOI or raw[:8] == PNG_SIGNATURE:
        return None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.format in PACKED_FORMATS:
                return None
            return f"unsupported format {im.format}; the formats packed are JPEG, PNG, WebP, BMP, TIFF and PPM/PGM"
    except Exception:  # noqa: BLE001 - not an image Pillow knows either: the structural reason stands
        return None


# pragma: no mutate end


Source = str | tuple[str, int, int] | int  # a file, (file, offset, size) of a member of one, or a reader's record


@dataclass(frozen=True)
class Item:
    """One image to pack: where its bytes are, its label, its name in reports and in paths.bin, and its
    record in the source (its row in the source's targets, where it has targets)."""

    source: Source
    label: int
    shown: str
    stored: bytes
    index: int


@dataclass
class PackSources:
    """The classes, the images to pack, what is left out ((where, why), before any image is read), the
    damaged shards ((shard, what): the samples they lost are not counted) and the items' targets (None for
    class targets: an object with ``kind``, ``width``, ``rows`` and ``check``, `base.TargetReader`'s)."""

    classes: list[str]
    items: list[Item]
    left_out: list[tuple[str, str]]
    targets: Any = None
    damaged: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (path, what it is): not an image


def pack_sources(src: Path, shards: bool, target: str | None, num_classes: int | None) -> PackSources:
    """The `PackSources` of an ImageFolder root or of WebDataset shards (``shards``). With a ``target``
    other than "class", each item's target list is read (`open_dataset`'s rules: each sample's ``.json``,
    or ``labels.csv``) and an item whose target is bad is left out, named with the reason."""
    targets: Any = None
    damaged: list[tuple[str, str]] = []
    if shards:  # WebDataset shards: converted to a packed set
        wds = WebDatasetReader(str(src), target=target, num_classes=num_classes)
        classes, other, left_out, damaged = wds.classes, [], list(wds.skipped), list(wds.damaged)
        labels = wds.labels
        targets = reader_targets(wds)
        items = []
        for i in range(len(wds)):
            name = wds.source(i)
            items.append(Item(wds.member(i), int(labels[i]), name, os.fsencode(name), i))
    else:
        classes, found, other, left_out = scan_image_folder(src, broken_links_are_records=False)
        if target not in (None, "class") and found:
            keep, values, ends = read_labels_csv(src, [p for p, _ in found])
            kept = set(keep)
            left_out += [(str(p), f"no row in {LABELS_CSV}") for k, (p, _) in enumerate(found) if k not in kept]
            found = [found[k] for k in keep]
            targets = ListTargets(str(target), values, ends, num_classes, lambda i: str(found[i][0]))
        items = [Item(str(p), label, str(p), os.fsencode(p.relative_to(src)), k) for k, (p, label) in enumerate(found)]
    if not items:
        raise ValueError(f"{src}: no image files under class sub-folders; expected SRC/<class>/<image>")
    items, bad = _without_bad_targets(items, targets)
    return PackSources(classes, items, left_out + bad, targets, damaged, list(other))


def reader_sources(reader: Reader) -> PackSources:
    """The `PackSources` of a reader: each record by its index, with the reader's own targets (a record
    whose target is bad is left out when it is read, named with the reason, as the reader's checked reads
    name it: `read_rows`)."""
    items = [Item(i, label, name, os.fsencode(name), i) for i, label, name in reader_records(reader)]
    return PackSources(list(reader.classes), items, [], reader_targets(reader))


def _without_bad_targets(items: list[Item], targets: Any) -> tuple[list[Item], list[tuple[str, str]]]:
    """(the items whose targets are good, (name, why) of the others)."""
    if targets is None:
        return items, []
    bad = targets.check([item.index for item in items])
    return [item for k, item in enumerate(items) if k not in bad], [(items[k].shown, why) for k, why in bad.items()]


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
    return prepare(raw, verify, max_side, name)


# pragma: no mutate start (runs only in worker processes, where mutmut cannot map tests to it; the
# byte-identical test of 1, 2 and 4 workers covers it)
def load_chunk(
    sources: list[tuple[Source, str]], verify: bool, max_side: int | None, max_image_pixels: int | None
) -> list[tuple[bytes | None, str | None, bool]]:
    """`_load_one` of each (source, name), or of the reader's records read with their checks, in a worker
    process, under the parent's pixel limit (a spawned worker would start from Pillow's default)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_image_pixels
    if sources and isinstance(sources[0][0], int):  # a reader's records: read as one batch
        rows = read_rows([source for source, _ in sources])  # type: ignore[misc]
        return [
            _prepare_read(raw, why, verify, max_side, name) for (raw, why), (_, name) in zip(rows, sources, strict=True)
        ]
    return [_load_one(p, name, verify, max_side) for p, name in sources]


# pragma: no mutate end


def _prepare_read(raw: bytes | None, why: str | None, verify: bool, max_side: int | None, name: str) -> tuple:
    return (None, why, False) if raw is None else prepare(raw, verify, max_side, name)


def use_reader(reader: Reader | None) -> None:
    """The reader `read_rows` reads, in this process and in the workers forked after the call."""
    global _READER
    _READER = reader


def reader_records(reader: Reader) -> list[tuple[int, int, str]]:
    """(index, label, name) of every record of ``reader``: the labels from its label column where it has one."""
    if provides(reader, LabelledReader):
        labels = np.asarray(reader.labels, dtype=np.int64).tolist()  # type: ignore[attr-defined]
    else:
        labels = [int(reader[i][1]) for i in range(len(reader))]
    return [(i, labels[i], reader.source(i)) for i in range(len(reader))]


def read_rows(rows: Sequence[int]) -> list[tuple[bytes | None, str | None]]:
    """(bytes, None), or (None, why the record is bad), of each of ``rows`` of the reader `use_reader` set,
    read as one batch (a Parquet row group is read once for all of its rows)."""
    if _READER is None:
        raise RuntimeError("pack's reader is not set in this process (use_reader)")
    datas, _, bad = read_batch_checked(_READER, list(rows))
    return [(None, bad[k]) if k in bad else (bytes(datas[k]), None) for k in range(len(rows))]  # type: ignore[arg-type]
