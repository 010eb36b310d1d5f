"""What `writer.pack` packs: the images of an ImageFolder or of WebDataset shards in the source order, each
with its label, the name it is stored under and its target, and what is left out before any image is read
(with the reason for each)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .folder import LABELS_CSV, read_labels_csv, scan_image_folder
from .targets import ListTargets, reader_targets
from .webdataset import WebDatasetReader

Source = str | tuple[str, int, int]  # a file, or (file, offset, size) of a member inside one (a tar shard)


@dataclass(frozen=True)
class PackItem:
    """One image to pack: where its bytes are, its label, its name in reports and in paths.bin, and its
    record in the source (its row in the source's targets, where it has targets)."""

    source: Source
    label: int
    shown: str
    stored: bytes
    index: int


@dataclass
class PackSources:
    """The classes, the images to pack, what is left out ((where, why), before any image is read) and the
    items' targets (None for class targets)."""

    classes: list[str]
    items: list[PackItem]
    left_out: list[tuple[str, str]]
    targets: ListTargets | None


def pack_sources(src: Path, shards: bool, target: str | None, num_classes: int | None) -> PackSources:
    """The `PackSources` of an ImageFolder root or of WebDataset shards (``shards``). With a ``target``
    other than "class", each item's target list is read (`open_dataset`'s rules: each sample's ``.json``,
    or ``labels.csv``) and an item whose target is bad is left out, named with the reason."""
    lists = target not in (None, "class")
    targets: ListTargets | None = None
    if shards:  # WebDataset shards: converted to a packed set
        wds = WebDatasetReader(str(src), target=target, num_classes=num_classes)
        classes, other, left_out = wds.classes, [], list(wds.skipped)
        labels = wds.labels
        targets = reader_targets(wds)
        items = []
        for i in range(len(wds)):
            name = wds.source(i)
            items.append(PackItem(wds.member(i), int(labels[i]), name, os.fsencode(name), i))
    else:
        classes, found, other, left_out = scan_image_folder(src)
        if lists and found:
            keep, values, ends = read_labels_csv(src, [p for p, _ in found])
            kept = set(keep)
            left_out += [(str(p), f"no row in {LABELS_CSV}") for k, (p, _) in enumerate(found) if k not in kept]
            found = [found[k] for k in keep]
            targets = ListTargets(str(target), values, ends, num_classes, lambda i: str(found[i][0]))
        items = [PackItem(str(p), label, str(p), os.fsencode(p.relative_to(src)), k) for k, (p, label) in enumerate(found)]
    if not items:
        raise ValueError(f"{src}: no .jpg/.jpeg/.png files under class sub-folders; expected SRC/<class>/<image>")
    left_out += [(str(p), "not a .jpg/.jpeg/.png file") for p in other]
    if targets is not None:
        left_out += [(item.shown, targets.bad[item.index]) for item in items if item.index in targets.bad]
        items = [item for item in items if item.index not in targets.bad]
    return PackSources(classes, items, left_out, targets)
