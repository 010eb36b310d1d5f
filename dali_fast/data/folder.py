"""`ImageFolderReader`: an ImageFolder root (``root/<class>/<image>``, torchvision's layout) read on demand,
a batch's files in the shared reader threads."""

from __future__ import annotations

import logging
import os
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
def scan_image_folder(root: Path) -> tuple[list[str], list[tuple[Path, int]], list[Path], list[tuple[str, str]]]:
    """Classes (sorted sub-folders), (file, label) pairs, files with other extensions, and the folders
    that could not be listed (with the reason): their files are left out, never silently."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items: list[tuple[Path, int]] = []
    other: list[Path] = []
    unlisted: list[tuple[str, str]] = []

    def failed(error: OSError) -> None:
        unlisted.append((str(error.filename), f"folder cannot be listed: {error.strerror or error}"))

    for label, name in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(root / name, onerror=failed):
            dirnames.sort()
            for f in sorted(filenames):
                p = Path(dirpath) / f
                if f.lower().endswith(IMAGE_EXTENSIONS):
                    items.append((p, label))
                elif not f.startswith("."):
                    other.append(p)
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
        self.classes, items, _, self.skipped = scan_image_folder(self.path)
        for folder, reason in self.skipped:
            log.warning("left out %s: %s", folder, reason)
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
