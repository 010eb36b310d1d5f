"""Shared fixtures: tiny data sets built in tmp_path (what they are built from is in helpers/builders.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from builders import IndexReader, jpeg_bytes, make_folder, png_bytes

if "mutmut" in sys.modules:
    # A mutation run forks a process per mutant from one that has run the tests: torch's OpenMP threads do
    # not survive a fork, and the child's first parallel op would hang. One intra-op thread: no pool at all.
    import torch

    torch.set_num_threads(1)
    # mutmut 3.8.1's clean pass keeps a ContextVar stack of callers around every call of a mutated function,
    # even with caller tracking off (pyproject.toml: track_dependencies = false), when nothing reads it. A
    # finalizer that the cycle collector runs in the middle of such a call can reset it out of order
    # (LookupError, or "'Pass' and 'int'" in its trampoline), and the pass failed 2 runs in 3. Unread, the
    # stack is made a no-op: which tests reach which function is recorded all the same.
    try:
        from mutmut.core import MutmutCallStack
    except ImportError:  # another mutmut: its own bookkeeping
        pass
    else:
        MutmutCallStack.set = classmethod(lambda cls, value: None)  # type: ignore[method-assign]
        MutmutCallStack.reset = classmethod(lambda cls, token: None)  # type: ignore[method-assign]


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    """3 classes, 7 images of distinct sizes (JPEGs and one PNG)."""
    return make_folder(
        tmp_path / "imgs",
        {
            "cat": [jpeg_bytes(64, 48), jpeg_bytes(50, 70), png_bytes()],
            "dog": [jpeg_bytes(33, 33, (10, 200, 10)), jpeg_bytes(80, 20)],
            "emu": [jpeg_bytes(21, 60), jpeg_bytes(64, 64, (0, 0, 255))],
        },
    )


@pytest.fixture(scope="session")
def index_reader() -> IndexReader:
    """37 small JPEGs (a prime count, so no batch size divides it) labelled by index."""
    colors = [(200, 30, 60), (10, 200, 10), (0, 0, 255), (250, 250, 0)]
    return IndexReader([jpeg_bytes(32 + i % 5, 24 + i % 3, colors[i % 4]) for i in range(37)])


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory) -> Path:
    """60 synthetic photos in 3 classes, one of them truncated (left out alike by every pack)."""
    from dali_fast.data.synthetic import make_synthetic

    root = tmp_path_factory.mktemp("photos")
    make_synthetic(root / "src", images=60, classes=3, progress=False)
    bad = sorted((root / "src").rglob("*.jpg"))
    bad[7].write_bytes(bad[7].read_bytes()[:500])  # one truncated, left out the same way by every worker count
    return root / "src"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """``$DALI_FAST_CACHE`` in ``tmp_path``: what a test's readers save (shard indexes) stays with the test."""
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
