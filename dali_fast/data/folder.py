"""`ImageFolderReader`: an ImageFolder root (``root/<class>/<image>``, torchvision's layout) read on demand,
a batch's files in the shared reader threads."""

from __future__ import annotations

import logging
import os
import stat
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..text import plural
from .base import CheckedBatch, read_parallel
from .checks import check_encoded, check_index
from .format import IMAGE_EXTENSIONS

log = logging.getLogger(__name__)


# pragma: no mutate start (ImageFolder reading and the read pool's threads, which mutmut's tracing of tests does not follow)
def scan_image_folder(
    root: Path, *, broken_links_are_records: bool = True
) -> tuple[list[str], list[tuple[Path, int]], list[tuple[str, str]], list[tuple[str, str]]]:
    """Classes (sorted sub-folders), (file, label) pairs, what is not an image (path, what it is), and the
    folders that could not be listed (with the reason): their files are left out, never silently.

    An image is a file (or a link to a file) named .jpg/.jpeg/.png. Not images: files of other names (but
    hidden ones), a link to a folder (not followed, as `os.walk` does not), anything else that is not a
    file, and (without ``broken_links_are_records``, as `pack` scans) a link that loops or leads nowhere;
    a reader keeps such a link as a record, bad when read and named by the loaders like a file that
    vanished. Each folder's files come in name order, then its sub-folders'."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items: list[tuple[Path, int]] = []
    other: list[tuple[str, str]] = []
    unlisted: list[tuple[str, str]] = []
    for label, name in enumerate(classes):
        folders = [root / name]
        while folders:
            folder = folders.pop()
            try:
                with os.scandir(folder) as listing:
                    entries = sorted(listing, key=lambda e: e.name)
            except OSError as e:
                unlisted.append((str(folder), f"folder cannot be listed: {e.strerror or e}"))
                continue
            subfolders = []
            for entry in entries:
                p = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    subfolders.append(p)
                    continue
                what = _not_an_image(entry, broken_links_are_records)
                if what is None:
                    items.append((p, label))
                elif what:
                    other.append((str(p), what))
            folders.extend(reversed(subfolders))  # depth first, in name order
    empty = sorted(set(range(len(classes))) - {label for _, label in items})
    if empty and items:
        names = ", ".join(f"{classes[k]!r} (label {k})" for k in empty[:5]) + (" ..." if len(empty) > 5 else "")
        log.warning(
            "%s: %s no .jpg/.jpeg/.png files: %s; each stays a class with no samples (the labels of the "
            "folders after it count it); move such a folder out of %s if it is not a class",
            root,
            plural(len(empty), "class folder has", "class folders have"),
            names,
            root,
        )
    return classes, items, other, unlisted


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
        if stat.S_ISDIR(target.st_mode):
            return "a link to a folder (not followed)"
        if not stat.S_ISREG(target.st_mode):
            return "a link to something that is not a file"
    elif not entry.is_file(follow_symlinks=False):
        return "not a file (a device, pipe or socket)"
    if image:
        return None
    return "" if entry.name.startswith(".") else "not a .jpg/.jpeg/.png file"


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
    """The reader interface over an ImageFolder root (``root/<class>/<image>``), read on demand."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.path = Path(root)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such folder")
        self.classes, items, other, self.skipped = scan_image_folder(self.path)
        for folder, reason in self.skipped:
            log.warning("left out %s: %s", folder, reason)
        for path, what in other:  # named like an image but not one: a user would expect it read
            if path.lower().endswith(IMAGE_EXTENSIONS):
                log.warning("not an image, ignored: %s (%s)", path, what)
        if not items:
            raise ValueError(
                f"{self.path}: no .jpg/.jpeg/.png files under class sub-folders; expected ROOT/<class>/<image>"
            )
        self._files = [str(p) for p, _ in items]
        self._labels = np.array([lab for _, lab in items], dtype=np.int64)

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
