"""`WebDatasetReader`: WebDataset tar shards (see `shards`) read in place, with random access.

The reader walks the tar headers once, keeps an index of (shard, offset, size, label) per sample, and hands
out zero-copy views into the memory-mapped shards, so the sampler, both iterators, the cache, ``bench``
and ``train`` work on it unchanged. The index is saved under ``$DALI_FAST_CACHE/wds-index``, keyed by
the shards' paths, sizes, modification and change times and inodes (a shard restored with its old size
and mtime is indexed again), so opening the same shards again costs milliseconds.

What this is not: streaming from object storage (that is `remote`). Random access needs the shards on a
local or shared file system; compressed shards (``.tar.gz``) have no random access and are refused with
what to do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..files import atomic_write, default_cache_dir
from .base import CheckedBatch, check_on_error, read_parallel
from .checks import check_encoded, check_index
from .member_index import MemberIndexReader, names_blob
from .shards import expand_shards, index_shard, refuse_compressed
from .targets import attach_targets, check_target

log = logging.getLogger(__name__)

# 2: grouping by consecutive key, labels checked (shards.index_shard); 3: member_index arrays; 4: damaged shards;
# 5: target lists; 6: tarfile's names (PAX, GNU long names, UTF-8), every member grouped, no-sample rules;
# 7: a .cls and a .json label that disagree
INDEX_VERSION = 7


class WebDatasetReader(MemberIndexReader):
    """The reader interface over WebDataset tar shards (see the module docstring).

    ``label_key`` names the label in ``.json`` members (used when a sample has no ``.cls``).
    ``on_error="skip"`` leaves out, counts and names samples without an image or a label (``skipped``) and
    lists damaged shards with what is known of them (``damaged``: a truncated shard, where it ends);
    ``"raise"`` refuses either in one line naming the shard and member. ``target="multihot"`` (with
    ``num_classes``) or ``"float"`` reads each sample's target list from its ``.json`` (the list, or an
    object's ``"labels"``; `shards.index_shard`). ``classes``: the class names, in label order (the
    training set's, for a validation set: `classes.class_map`); a label beyond them is refused in one line.
    """

    def __init__(
        self,
        shards: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        label_key: str = "label",
        on_error: str = "skip",
        cache_dir: str | os.PathLike | None = None,
        target: str | None = None,
        num_classes: int | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        check_target(target, num_classes)
        self.lists = target not in (None, "class")
        paths = expand_shards(shards) if isinstance(shards, str | os.PathLike) else [Path(p) for p in shards]
        if not paths:
            raise ValueError("no shards given")
        for p in paths:
            refuse_compressed(p)
        self.shards = [p.resolve() for p in paths]
        self.label_key = label_key
        self.on_error = check_on_error(on_error)
        self.path = self.shards[0].parent
        self.skipped: list[tuple[str, str]] = []
        self.damaged: list[tuple[str, str]] = []
        self.ignored: Counter[str] = Counter()  # members with other extensions, by extension
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "wds-index"
        self.index_file = cache / f"{self._cache_key()}.npz"
        if not self._load_index():
            self._build_index()
            self._save_index()
        self._maps: list[np.memmap | None] = [None] * len(self.shards)
        self._index_done(classes=classes)
        attach_targets(self, target, num_classes)

    # ------------------------------------------------------------------ index
    def _cache_key(self) -> str:
        h = hashlib.sha1(f"v{INDEX_VERSION}|{self.label_key}|{self.on_error}|{self.lists}".encode())
        for p in self.shards:
            st = p.stat()
            # What a replacement changes: a shard restored with its old size and mtime (cp -p, rsync -t, a
            # backup) is still a new inode, or a new ctime (which no tool sets back), as git's index knows.
            stamp = f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}|{st.st_ctime_ns}"
            h.update(f"{stamp}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def _build_index(self) -> None:
        shard_ids, offsets, sizes, labels, names, values, ends = [], [], [], [], [], [], []
        for s, path in enumerate(self.shards):
            found = index_shard(path, label_key=self.label_key, on_error=self.on_error, lists=self.lists)
            ends.append(found.target_ends + sum(len(v) for v in values))
            values.append(found.target_values)
            self.skipped += found.skipped
            self.damaged += found.damaged
            self.ignored.update(found.ignored)
            shard_ids.append(np.full(len(found.labels), s, dtype=np.int64))
            offsets.append(found.offsets)
            sizes.append(found.sizes)
            labels.append(found.labels)
            names += found.names
        self._shard_of = np.concatenate(shard_ids).astype(np.int64)
        self._offset = np.concatenate(offsets).astype(np.int64)
        self._size = np.concatenate(sizes).astype(np.int64)
        self._labels = np.concatenate(labels).astype(np.int64)
        self._names, self._name_ends = names_blob(names)
        self._target_values = np.concatenate(values).astype(np.float64)
        self._target_ends = np.concatenate(ends).astype(np.int64)

    def _save_index(self) -> None:
        arrays = {
            "shard_of": self._shard_of,
            "offset": self._offset,
            "size": self._size,
            "labels": self._labels,
            "names": self._names,
            "name_ends": self._name_ends,
            "target_values": self._target_values,
            "target_ends": self._target_ends,
            "skipped": np.asarray(json.dumps([list(x) for x in self.skipped]).encode(), dtype=bytes),
            "damaged": np.asarray(json.dumps([list(x) for x in self.damaged]).encode(), dtype=bytes),
            "ignored": np.asarray(json.dumps(dict(self.ignored)).encode(), dtype=bytes),
        }
        try:
            atomic_write(self.index_file, lambda f: np.savez(f, **arrays))
        except OSError as e:  # a read-only cache folder costs the next open a scan, nothing more
            log.warning(
                "cannot save the shard index to %s (%s); set DALI_FAST_CACHE to a writable folder", self.index_file, e
            )

    def _load_index(self) -> bool:
        try:
            with np.load(self.index_file) as z:
                self._shard_of, self._offset, self._size = z["shard_of"], z["offset"], z["size"]
                self._labels, self._names, self._name_ends = z["labels"], z["names"], z["name_ends"]
                self._target_values, self._target_ends = z["target_values"], z["target_ends"]
                self.skipped = [tuple(x) for x in json.loads(bytes(z["skipped"]))]
                self.damaged = [tuple(x) for x in json.loads(bytes(z["damaged"]))]
                self.ignored = Counter(json.loads(bytes(z["ignored"])))
        except (OSError, KeyError, ValueError):
            return False
        return True

    # ------------------------------------------------------------------ reader interface
    @property
    def fingerprint(self) -> str:
        return f"webdataset:{len(self)}:{self.index_file.stem[:16]}"

    def _map(self, shard: int) -> np.memmap:
        m = self._maps[shard]
        if m is None:
            m = self._maps[shard] = np.memmap(self.shards[shard], dtype=np.uint8, mode="r")
        return m

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = check_index(i, len(self))
        off, size = int(self._offset[j]), int(self._size[j])
        return self._map(int(self._shard_of[j]))[off : off + size], int(self._labels[j])

    def read_batch(self, indices: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """The images of ``indices``, read in parallel by the read pool, and their labels (an unreadable
        or shortened shard raises OSError)."""
        got, labels = self._read_members(indices, _read_member)
        return got, labels

    def read_batch_checked(self, indices: Sequence[int]) -> CheckedBatch:
        """`read_batch` with `check_encoded` on every image, in the reader threads (nothing checked the
        members before); a member that cannot be read is a bad record, not an error."""
        got, labels = self._read_members(indices, _read_member_checked)
        return [d for d, _ in got], labels, {pos: why for pos, (_, why) in enumerate(got) if why is not None}

    def _read_members(self, indices: Sequence[int], read: Callable) -> tuple[list, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        shards = [str(self.shards[s]) for s in self._shard_of[idx].tolist()]
        members = zip(shards, self._offset[idx].tolist(), self._size[idx].tolist(), strict=True)
        return read_parallel(read, list(members)), self._labels[idx]

    # DataLoader workers: reopen by paths (the index comes from the cache file).
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = [None] * len(self.shards)
        return state

    def __repr__(self) -> str:
        return f"WebDatasetReader({len(self.shards)} shards, records={len(self)}, classes={len(self.classes)})"


def _pread(member: tuple[str, int, int]) -> bytes:
    """The bytes of a (shard, offset, size) member: one positioned read (no shared file position)."""
    path, offset, size = member
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError(errno.EIO, f"the shard ends at byte {offset + len(data)}, inside this member; index it again")
    return data


def _read_member(member: tuple[str, int, int]) -> np.ndarray:
    return np.frombuffer(_pread(member), dtype=np.uint8)


def _read_member_checked(member: tuple[str, int, int]) -> tuple[np.ndarray | None, str | None]:
    try:
        data = _pread(member)
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    return np.frombuffer(data, dtype=np.uint8), check_encoded(data)
