"""benchmarks/iterator_overhead.py, run small on the CPU: its DALI reference row builds the same operators."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
from builders import jpeg_bytes, make_folder

ROOT = Path(__file__).resolve().parents[2]


def test_file_reader_row_bounds_the_decoder_paddings_by_its_threads(tmp_path, monkeypatch):
    """`augment` sizes the `mixed` decoder's per-thread paddings from ``num_threads``: the reference row
    must pass its pipeline's threads, or the paddings are not bounded (a TypeError now: it is required)."""
    pytest.importorskip("nvidia.dali")
    spec = importlib.util.spec_from_file_location("iterator_overhead", ROOT / "benchmarks" / "iterator_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []
    real = bench.augment

    def augment(*args, **kwargs):
        seen.append(kwargs.get("num_threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "augment", augment)
    root = make_folder(tmp_path / "imgs", {"a": [jpeg_bytes(40, 30)] * 4, "b": [jpeg_bytes(30, 40)] * 4})
    args = argparse.Namespace(batch_size=4, image_size=16, epochs=1)
    assert bench.file_reader_epochs(root, args, 2)() == 8
    assert seen == [2]
