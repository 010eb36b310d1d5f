"""A remote shard's member index on the node's disk: its arrays saved as .npz, read back, and the crc of
the shard file they were made from."""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .store import CHUNK_BYTES


def crc_file(path: Path) -> int:
    """The crc32 of a whole file, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


_ARRAYS = ("offset", "size", "labels", "names", "name_ends")
_TARGET_ARRAYS = {"target_values": np.float64, "target_ends": np.int64}  # absent from indexes without lists


def pack_index(part: dict[str, Any]) -> dict[str, np.ndarray]:
    """A shard's index as the arrays `np.savez` writes (what was left out, as JSON, beside them)."""
    out = {k: part[k] for k in (*_ARRAYS, *_TARGET_ARRAYS)}
    out["crc"] = np.asarray(part["crc"], dtype=np.int64)
    meta = {k: part[k] for k in ("skipped", "ignored", "damaged")}
    out["meta"] = np.asarray(json.dumps(meta).encode(), dtype=bytes)
    return out


# np.load parses headers with ast, which CPython 3.11 cannot run in two threads at once (gh-106905)
_NPY_LOAD = threading.Lock()


def load_index(path: Path) -> dict[str, Any] | None:
    """A saved shard index, or None where it is missing, unreadable or of an older version (made again)."""
    try:
        with _NPY_LOAD, np.load(path) as z:
            part = {k: z[k] for k in _ARRAYS}
            part.update((k, z[k] if k in z.files else np.empty(0, dtype)) for k, dtype in _TARGET_ARRAYS.items())
            part["crc"] = int(z["crc"])
            meta = json.loads(bytes(z["meta"]))
    except (OSError, KeyError, ValueError):
        return None
    if "damaged" not in meta:  # an index of an older version (damage counted as a sample): made again
        return None
    part["skipped"] = [tuple(x) for x in meta["skipped"]]
    part["ignored"] = meta["ignored"]
    part["damaged"] = [tuple(x) for x in meta["damaged"]]
    return part
