"""`ImageFolderReader`: an ImageFolder root (``root/<class>/<image>``, torchvision's layout) read on demand,
a batch's files in the shared reader threads; with ``target="multihot"`` or ``"float"``, each image's
targets from ``root/labels.csv`` (`read_labels_csv`)."""

from __future__ import annotations

import csv
import logging
import os
import stat
import zlib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import numpy as np

from ..text import plural
from .base import CheckedBatch, read_parallel
from .checks import check_encoded, check_index
from .classes import class_map, remap_labels
from .format import IMAGE_EXTENSIONS
from .targets import attach_targets, check_target

LABELS_CSV = "labels.csv"  # an ImageFolder's per-image targets, beside its class folders

log = logging.getLogger(__name__)


# pragma: no mutate start (ImageFolder reading and the read pool's threads, which mutmut's tracing of tests does not follow)
def scan_image_folder(
    root: Path, *, broken_links_are_records: bool = True
) -> tuple[list[str], list[tuple[Path, int]], list[tuple[str, str]], list[tuple[str, str]]]:
    """Classes, (file, label) pairs, what is not an image (path, what it is), and the folders that could not
    be listed or were not followed (with the reason): their files are left out, never silently.

    torchvision's rule (`datasets.folder.find_classes` and `make_dataset`): the classes are every
    sub-folder of ``root``, sorted, links to folders and dot-folders included; under each, the folders
    are walked with links followed (``os.walk(followlinks=True)``), visited in the order of their sorted
    paths, each folder's files in name order; an image is a file named with one of `IMAGE_EXTENSIONS`,
    in any case. Where this differs, it says so in a warning: a link back to a folder above it (a loop)
    is not followed (torchvision would list its files again, until the path grows too long); a name
    with an image's extension that is not a file (a FIFO, a device, a link to a folder) is not a record;
    a link that loops or leads nowhere is kept as a record, bad when read (without
    ``broken_links_are_records``, as `pack` scans, it is not a record); a class folder with no image
    stays a class with no samples (torchvision refuses such a root)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    items: list[tuple[Path, int]] = []
    other: list[tuple[str, str]] = []
    unlisted: list[tuple[str, str]] = []
    for label, name in enumerate(classes):
        for folder, entries in _walk(root / name, unlisted):
            for entry in entries:
                p = Path(folder, entry.name)
                what = _not_an_image(entry, broken_links_are_records)
                if what is None:
                    items.append((p, label))
                elif what:
                    other.append((str(p), what))
    dotted = [(k, c) for k, c in enumerate(classes) if c.startswith(".")]
    if dotted:
        log.warning(
            "%s: %s a dot and %s a class, as torchvision counts %s: %s; move %s out of %s if %s not a class",
            root,
            plural(len(dotted), "class folder starts", "class folders start") + " with",
            "is" if len(dotted) == 1 else "are each",
            "it" if len(dotted) == 1 else "them",
            ", ".join(f"{c!r} (label {k})" for k, c in dotted[:5]) + (" ..." if len(dotted) > 5 else ""),
            "it" if len(dotted) == 1 else "them",
            root,
            "it is" if len(dotted) == 1 else "they are",
        )
    empty = sorted(set(range(len(classes))) - {label for _, label in items})
    if empty and items:
        names = ", ".join(f"{classes[k]!r} (label {k})" for k in empty[:5]) + (" ..." if len(empty) > 5 else "")
        log.warning(
            "%s: %s no image files: %s; each stays a class with no samples (the labels of the folders after it "
            "count it; torchvision refuses such a root); move such a folder out of %s if it is not a class",
            root,
            plural(len(empty), "class folder has", "class folders have"),
            names,
            root,
        )
    return classes, items, other, unlisted


def _walk(top: Path, unlisted: list[tuple[str, str]]) -> list[tuple[str, list[os.DirEntry]]]:
    """``sorted(os.walk(top, followlinks=True))`` as (folder, its non-folder entries in name order), with a
    link back to a folder above it not followed and a folder that cannot be listed left out, both named in
    ``unlisted``."""
    found: list[tuple[str, list[os.DirEntry]]] = []
    stack: list[tuple[str, tuple[tuple[int, int], ...]]] = [(str(top), ())]
    while stack:
        folder, above = stack.pop()
        try:
            st = os.stat(folder)
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError as e:
            unlisted.append((folder, f"folder cannot be listed: {e.strerror or e}"))
            continue
        here = (st.st_dev, st.st_ino)
        if here in above:
            unlisted.append((folder, "a link back to a folder above it (a loop): not followed"))
            continue
        files = []
        for entry in entries:
            try:
                is_folder = entry.is_dir()  # follows links, as os.walk(followlinks=True) does
            except OSError:
                is_folder = False
            if is_folder:
                stack.append((os.path.join(folder, entry.name), (*above, here)))
            else:
                files.append(entry)
        found.append((folder, files))
    return sorted(found, key=lambda f: f[0])


def read_labels_csv(root: Path, files: Sequence[Path]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Match ``root/labels.csv`` to ``files`` (images under ``root``): (the positions of the files that have
    a row, their rows' numbers end to end as float64, where each row's numbers end).

    The dialect: UTF-8 (a byte-order mark is allowed), comma-separated, quoted as spreadsheets write CSV
    (Python's ``csv`` "excel" dialect). A row is an image's path relative to ``root`` with ``/`` between
    folders (``cat/001.jpg``; a leading ``./`` is allowed), then its numbers: class indices for multihot, D
    numbers for float, one per cell or several in a cell separated by spaces (``cat/001.jpg,"3 7"``); a
    multihot row with no index is an image with no class. Blank rows are ignored; a first row whose first
    cell is ``path`` is a header. A row that names no image, names one twice or holds a word that is not a
    number is a one-line ValueError with its line number; an image without a row is left out by the caller.
    """
    path = root / LABELS_CSV
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; targets other than the class folders come from {LABELS_CSV} beside them "
            "(a row per image: its path relative to the root, then its class indices or numbers)"
        )
    rows: dict[str, tuple[int, list[float]]] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for cells in reader:
            if not any(c.strip() for c in cells):
                continue
            line, name = reader.line_num, cells[0].strip()
            if not rows and name.lower() == "path":  # the header
                continue
            numbers: list[float] = []
            for word in (w for cell in cells[1:] for w in cell.split()):
                try:
                    numbers.append(float(word))
                except ValueError:
                    header = "; a header row starts with 'path'" if not rows else ""
                    raise ValueError(
                        f"{path} line {line}: {word!r} is not a number; a row is an image's path, then its class "
                        f"indices (multihot) or numbers (float){header}"
                    ) from None
            key = PurePosixPath(name).as_posix()
            if key in rows:
                raise ValueError(
                    f"{path} line {line}: {name} has a row already (line {rows[key][0]}); give each image one row"
                )
            rows[key] = (line, numbers)
    position = {file.relative_to(root).as_posix(): k for k, file in enumerate(files)}
    unknown = [(line, key) for key, (line, _) in rows.items() if key not in position]
    if unknown:
        line, key = unknown[0]
        raise ValueError(
            f"{path} line {line}: no image {key} under {root} ({plural(len(unknown), 'row')} name no image); paths "
            "are relative to the root (class folder, then file); a header row, if any, starts with 'path'"
        )
    keep = sorted(position[key] for key in rows)
    by_position = {position[key]: numbers for key, (_, numbers) in rows.items()}
    lists = [by_position[k] for k in keep]
    values = np.array([x for numbers in lists for x in numbers], dtype=np.float64)
    return keep, values, np.cumsum([len(numbers) for numbers in lists], dtype=np.int64)


def _not_an_image(entry: os.DirEntry, broken_links_are_records: bool) -> str | None:
    """What a folder entry (not a folder itself) is when it is not an image, "" for a hidden file of
    another name (passed over in silence), None for an image file. Only links cost a system call."""
    image = entry.name.lower().endswith(IMAGE_EXTENSIONS)
    if entry.is_symlink():
        try:
            target = os.stat(entry.path)
        except OSError as e:
            if broken_links_are_records and image:
                return None
            return f"a link that loops or leads nowhere ({e.strerror or e})"
        if not stat.S_ISREG(target.st_mode):
            return "a link to something that is not a file"
    elif not entry.is_file(follow_symlinks=False):
        return "not a file (a device, pipe or socket)"
    if image:
        return None
    return "" if entry.name.startswith(".") else "not an image file (by its name)"


def _read_file(path: str) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        return np.frombuffer(f.readall(), dtype=np.uint8)


def _read_file_checked(path: str) -> tuple[np.ndarray | None, str | None]:
    """A file's bytes and why they are not an image (`check_encoded`), or (None, why it cannot be read)."""
    try:
        with open(path, "rb", buffering=0) as f:
            data = f.readall()
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    return np.frombuffer(data, dtype=np.uint8), check_encoded(data)


class ImageFolderReader:
    """The reader interface over an ImageFolder root (``root/<class>/<image>``), read on demand.

    ``target="multihot"`` (with ``num_classes``) or ``"float"`` reads each image's targets from
    ``root/labels.csv`` (`read_labels_csv`); an image without a row there is left out and listed in
    ``skipped``. The class folders still give ``labels`` and ``classes``.

    Args:
        root: the ImageFolder root.
        target: None or "class" (the class folders), "multihot" or "float" (``labels.csv``).
        num_classes: K of ``target="multihot"``.
        classes: the class names in label order (the training set's, for a validation set): each class
            folder gets its name's index there (`classes.class_map`); None: the sorted class folders.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        target: str | None = None,
        num_classes: int | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        check_target(target, num_classes)
        self.path = Path(root)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such folder")
        folders, items, other, self.skipped = scan_image_folder(self.path)
        lists = target not in (None, "class")
        if lists and items:
            keep, values, ends = read_labels_csv(self.path, [p for p, _ in items])
            kept = set(keep)
            self.skipped += [(str(p), f"no row in {LABELS_CSV}") for k, (p, _) in enumerate(items) if k not in kept]
            items = [items[k] for k in keep]
            self.target_lists = (values, ends)
        for folder, reason in self.skipped:
            log.warning("left out %s: %s", folder, reason)
        for path, what in other:  # named like an image but not one: a user would expect it read
            if path.lower().endswith(IMAGE_EXTENSIONS):
                log.warning("not an image, ignored: %s (%s)", path, what)
        if not items:
            raise ValueError(
                f"{self.path}: no image files ({'/'.join(IMAGE_EXTENSIONS)}) under class sub-folders"
                + (f" with a row in {LABELS_CSV}" if lists else "")
                + "; expected ROOT/<class>/<image>"
            )
        self._files = [str(p) for p, _ in items]
        own = np.array([lab for _, lab in items], dtype=np.int64)
        self.classes, remap = class_map(folders, own, classes, where=str(self.path), source=self.source)
        self._labels = remap_labels(own, remap, len(folders))
        attach_targets(self, target, num_classes)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def fingerprint(self) -> str:
        """Identifies the folder's contents: each file's path, label, size and modification time."""
        h = zlib.crc32(b"")
        for path, label in zip(self._files, self._labels.tolist(), strict=True):
            try:
                st = os.stat(path)
                line = f"{path}\t{label}\t{st.st_size}\t{st.st_mtime_ns}\n"
            except OSError:
                line = f"{path}\t{label}\tunreadable\n"
            h = zlib.crc32(line.encode("utf-8", "surrogateescape"), h)
        if self.target_kind != "class":  # the targets are part of the contents
            st = os.stat(self.path / LABELS_CSV)
            h = zlib.crc32(f"{self.target_kind}\t{st.st_size}\t{st.st_mtime_ns}\n".encode(), h)
        return f"folder:{len(self._files)}:{h:08x}"

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = check_index(i, len(self._files))
        with open(self._files[j], "rb") as f:
            data = f.read()
        return np.frombuffer(data, dtype=np.uint8), int(self._labels[j])

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """The files of ``indices``, read in parallel, and their labels; an unreadable file raises OSError."""
        idx = np.asarray(indices, dtype=np.int64)
        labels = self._labels[idx]
        return read_parallel(_read_file, [self._files[i] for i in idx.tolist()]), labels

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """`read_batch` with `check_encoded` on every file, in the reader threads: nothing checked these
        files before. An unreadable file is a bad record, not an error."""
        idx = np.asarray(indices, dtype=np.int64)
        labels = self._labels[idx]
        got = read_parallel(_read_file_checked, [self._files[i] for i in idx.tolist()])
        return [d for d, _ in got], labels, {pos: why for pos, (_, why) in enumerate(got) if why is not None}

    def source(self, i: int) -> str:
        return self._files[check_index(i, len(self._files))]

    def __repr__(self) -> str:
        return f"ImageFolderReader({str(self.path)!r}, records={len(self)}, classes={len(self.classes)})"


# pragma: no mutate end
