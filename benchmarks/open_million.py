"""How long opening a packed data set takes, at 1,000,000 records (sparse data file).

python benchmarks/open_million.py [--records N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from dali_fast.data.format import (
    DATA_FILE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    INDEX_FILE,
    MAGIC,
    META_FILE,
    PATHS_FILE,
    RECORD_DTYPE,
)
from dali_fast.data.packed import MemmapReader


def write_fake(root: Path, n: int, rec_len: int = 110_000) -> None:
    rows = np.zeros(n, RECORD_DTYPE)
    rows["offset"] = np.arange(n, dtype=np.uint64) * rec_len
    rows["length"] = rec_len
    rows["label"] = np.arange(n) % 1000
    header = np.zeros(1, HEADER_DTYPE)
    header[0] = (
        MAGIC,
        FORMAT_VERSION,
        RECORD_DTYPE.itemsize,
        n,
        n * rec_len,
        0,
        zlib.crc32(rows.tobytes()),
        1000,
        0,  # no shards: one data.bin
        0,
    )
    root.mkdir()
    with open(root / INDEX_FILE, "wb") as f:
        f.write(header.tobytes())
        f.write(rows.tobytes())
    with open(root / DATA_FILE, "wb") as f:
        f.truncate(n * rec_len)  # sparse
    (root / PATHS_FILE).write_bytes(b"")
    (root / META_FILE).write_text(json.dumps({"classes": [f"c{i}" for i in range(1000)]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "million"
        write_fake(root, args.records)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            r = MemmapReader(root)
            _ = r[args.records - 1]
            times.append(time.perf_counter() - t0)
            del r
        print(
            f"open + read last record, {args.records:,} records: "
            f"best {min(times) * 1e3:.2f} ms, median {sorted(times)[2] * 1e3:.2f} ms (5 runs)"
        )


if __name__ == "__main__":
    main()
