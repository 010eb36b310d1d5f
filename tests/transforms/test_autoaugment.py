"""The Pillow twins of DALI's automatic augmentations."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from dali_fast.transforms.autoaugment import OPS


@pytest.mark.parametrize("name", sorted(set(OPS) - {"Identity"}))
def test_every_pillow_operation_changes_an_image(name):
    """The Pillow twins of DALI's operations: each does something (at a middle magnitude) and keeps the size."""
    y, x = np.mgrid[0:32, 0:32]
    noise = np.random.default_rng(0).integers(0, 40, (32, 32, 3))
    im = Image.fromarray((np.stack([x * 5, y * 5, (x + y) * 2], -1) + noise).astype(np.uint8))
    magnitude = {"Posterize": 2, "Solarize": 128, "Rotate": 30, "TranslateX": 8, "TranslateY": 8}.get(name, 0.5)
    out = OPS[name](im, magnitude, 128)
    assert out.size == im.size and out.mode == "RGB"
    assert not np.array_equal(np.asarray(out), np.asarray(im))
