"""Fingerprints of the loaders' output under the default recipe, to hold it bit-identical over time.

``python tests/helpers/default_output.py`` rewrites ``tests/fixtures/default_output.json`` with the
fingerprints of this code on these library versions; the test compares against them when the versions match.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "default_output.json"
# simplejpeg and OpenCV: TorchIterator's JPEG decoder and some of its kernels
PACKAGES = ("numpy", "pillow", "torch", "nvidia-dali-cuda120", "simplejpeg", "opencv-python-headless")


def versions() -> dict[str, str]:
    return {p: version(p) for p in PACKAGES}


def images(n: int = 12) -> list[tuple[bytes, int]]:
    """Small JPEGs of several sizes and aspect ratios, gradients plus noise, deterministic."""
    from PIL import Image

    out = []
    for i in range(n):
        rng = np.random.default_rng([7, i])
        h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], -1)
        px = np.clip(base + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="JPEG", quality=90)
        out.append((buf.getvalue(), i % 3))
    return out


class ListReader:
    """A reader over in-memory (bytes, label) pairs."""

    def __init__(self, items: list[tuple[bytes, int]]) -> None:
        self.items = items
        self.classes = ["a", "b", "c"]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        data, label = self.items[i]
        return np.frombuffer(data, np.uint8), label

    def labels(self) -> np.ndarray:
        return np.array([label for _, label in self.items])

    def source(self, i: int) -> str:
        return f"golden[{i}]"


def fingerprint(backend: str, train: bool, **kw) -> str:
    """sha256 over every batch (images and labels) of two epochs at image size 32, seed 3. Backend
    ``torch-no-opencv``: TorchIterator with ``DALI_FAST_OPENCV=0`` (torch's and numpy's kernels only)."""
    if backend == "torch-no-opencv":
        import os
        from unittest import mock

        from dali_fast.transforms.opencv import ENV, opencv

        opencv.cache_clear()
        try:
            with mock.patch.dict(os.environ, {ENV: "0"}):
                return fingerprint("torch", train, **kw)
        finally:
            opencv.cache_clear()
    import torch

    from dali_fast import DALIIterator, TorchIterator

    cls = DALIIterator if backend == "dali" else TorchIterator
    extra = {"num_workers": 0} if backend == "torch" else {"num_threads": 1}
    loader = cls(ListReader(images()), 5, train=train, image_size=32, seed=3, device="cpu", **extra, **kw)
    h = hashlib.sha256()
    for epoch in range(2):
        loader.set_epoch(epoch)
        for x, y in loader:
            h.update(x.contiguous().numpy().tobytes())
            h.update(y.to(torch.int64).numpy().tobytes())
    if hasattr(loader, "close"):
        loader.close()
    return h.hexdigest()


CASES = {f"{b}-{'train' if t else 'eval'}": (b, t) for b in ("torch", "torch-no-opencv", "dali") for t in (True, False)}


def main() -> None:
    out = {"versions": versions(), "fingerprints": {k: fingerprint(b, t) for k, (b, t) in CASES.items()}}
    GOLDEN.write_text(json.dumps(out, indent=2) + "\n")
    json.dump(out, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
