"""Shared fixtures: tiny data sets built in tmp_path."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

if "mutmut" in sys.modules:
    # A mutation run forks a process per mutant from one that has run the tests: torch's OpenMP threads do
    # not survive a fork, and the child's first parallel op would hang. One intra-op thread: no pool at all.
    import torch

    torch.set_num_threads(1)


def jpeg_bytes(w: int = 64, h: int = 48, color=(200, 30, 60), quality: int = 90, **save) -> bytes:
    rng = np.random.default_rng(w * 1000 + h)
    arr = np.clip(np.array(color, np.float32) + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "JPEG", quality=quality, **save)
    return out.getvalue()


def first_batch(loader):
    """The loader's first batch, its pass then left and closed at once (not whenever the garbage collector
    reaches the generator: a pass finalized later, in the middle of other code, runs its cleanup there)."""
    batches = iter(loader)
    try:
        return next(batches)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def png_bytes(w: int = 40, h: int = 30, mode: str = "RGBA") -> bytes:
    arr = np.full((h, w, len(mode)), 120, np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(out, "PNG")
    return out.getvalue()


def make_folder(root: Path, per_class: dict[str, list[bytes]], ext: str = ".jpg") -> Path:
    for cls, items in per_class.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(items):
            suffix = ".png" if data.startswith(b"\x89PNG") else ext
            name = f"{i:03d}{suffix}"
            (root / cls / name).write_bytes(data)
    return root


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


class IndexReader:
    """A data set whose label is the record's index, so a batch of labels names its records."""

    def __init__(self, items: list[bytes], classes: int | None = None):
        self.items = [np.frombuffer(b, np.uint8) for b in items]
        self.classes = [str(i) for i in range(classes or len(items))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], int(i)

    @property
    def labels(self):
        return np.arange(len(self.items), dtype=np.int64)

    def source(self, i):
        return f"mem://{i}.jpg"


@pytest.fixture(scope="session")
def index_reader() -> IndexReader:
    """37 small JPEGs (a prime count, so no batch size divides it) labelled by index."""
    colors = [(200, 30, 60), (10, 200, 10), (0, 0, 255), (250, 250, 0)]
    return IndexReader([jpeg_bytes(32 + i % 5, 24 + i % 3, colors[i % 4]) for i in range(37)])


def one_line(excinfo) -> str:
    """The message of a raised error, which must be one line."""
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


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
