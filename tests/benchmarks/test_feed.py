"""benchmarks/feed.py runs end to end, small: every source row and the feed inside DALI report a figure
(the script reads readers' internals, so a change of them shows here, not on the next timing run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_feed_benchmark_runs_small_and_reports_every_row(tmp_path):
    pytest.importorskip("nvidia.dali")
    pytest.importorskip("skimage", reason="the benchmark's photos need the photos extra (scikit-image)")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "feed.py"), "--images", "24", "--batch-size", "8",
           "--rounds", "1", "--dali-batch-sizes", "8", "--dali-threads", "1", "--image-size", "32",
           "--threads", "2", "--keep", str(tmp_path / "data")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=True).stdout
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d,]+) \|", out, re.M))
    for source in ("packed", "packed + LRU cache (warm)", "ImageFolder", "WebDataset shards"):
        assert int(rows[source].replace(",", "")) > 0, out
    assert re.search(r"^\| this revision \| 8 \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
