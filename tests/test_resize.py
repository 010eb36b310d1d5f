"""Crop boxes, the resize to the output square (Pillow's filters, antialiased, written in place), and a
record decoded, cropped and resized as the recipe says."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import jpeg_bytes
from PIL import Image

from dali_fast.transforms.recipe import Recipe
from dali_fast.transforms.resize import (
    PIL_RESAMPLE,
    decode_crop,
    pixel_box,
    random_resized_crop_box,
    resize,
    resize_into,
)


def photo(h: int = 370, w: int = 470, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x * y) % 256], -1)
    return np.clip(base + rng.integers(-50, 50, (h, w, 3)), 0, 255).astype(np.uint8)


def pillow(src: np.ndarray, box: tuple[int, int, int, int], size: int, interpolation: str) -> np.ndarray:
    """Pillow's crop, then its resize (torchvision's `resized_crop` on a PIL image)."""
    resample = getattr(Image, PIL_RESAMPLE[interpolation])
    return np.asarray(Image.fromarray(src).crop(box).resize((size, size), resample))


def level_diff(a, b) -> tuple[float, int]:
    d = np.abs(np.asarray(a, dtype=np.int32) - np.asarray(b, dtype=np.int32))
    return float(d.mean()), int(d.max())


# (left, top, right, bottom) boxes from a 3x upscale to a 3.3x shrink of a 470x370 photo at 112 px
BOXES = [(10, 20, 47, 57), (0, 0, 112, 112), (100, 50, 268, 218), (30, 10, 330, 310), (0, 0, 370, 370)]


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_bilinear_and_bicubic_are_pillows_filters(interpolation):
    """Measured over shrinks and upscales: within a few hundredths of a level on average, 1 level at most."""
    src = photo()
    out = torch.empty((112, 112, 3), dtype=torch.uint8)
    for x0, y0, x1, y1 in BOXES:
        resize_into(src[y0:y1, x0:x1], out, interpolation)
        mean, top = level_diff(out.numpy(), pillow(src, (x0, y0, x1, y1), 112, interpolation))
        assert mean < 0.05 and top <= 1, (interpolation, (x0, y0, x1, y1), mean, top)


@pytest.mark.parametrize("interpolation", ["nearest", "lanczos"])
def test_nearest_and_lanczos_are_pillows_exactly(interpolation):
    src = photo()
    for x0, y0, x1, y1 in BOXES:
        got = resize(src[y0:y1, x0:x1], (112, 112), interpolation)
        np.testing.assert_array_equal(got.numpy(), pillow(src, (x0, y0, x1, y1), 112, interpolation))


def test_a_shrink_is_antialiased_as_pillows_is():
    """A 1-pixel checkerboard shrunk 4x is flat grey with an antialiasing filter; plain sampling keeps
    a pattern (levels far from grey)."""
    board = (np.indices((448, 448)).sum(0) % 2 * 255).astype(np.uint8)
    src = np.repeat(board[..., None], 3, axis=2)
    got = resize(src, (112, 112)).numpy().astype(int)
    assert abs(got.mean() - 127.5) < 1 and got.std() < 1
    ref = pillow(src, (0, 0, 448, 448), 112, "bilinear")
    assert level_diff(got, ref)[1] <= 1


def test_only_the_border_differs_from_pillows_box_resize():
    """Pillow's ``resize(box=...)`` (the baseline's) also reads pixels just outside the box at the edges;
    a crop then a resize (torchvision's, DALI's, this one) does not. Inside, the two agree."""
    src = photo()
    resample = Image.BILINEAR
    for x0, y0, x1, y1 in BOXES[2:]:  # shrinks: the filter reaches about one output pixel outside
        got = resize(src[y0:y1, x0:x1], (112, 112)).numpy()
        ref = np.asarray(Image.fromarray(src).resize((112, 112), resample, box=(x0, y0, x1, y1)))
        assert level_diff(got[2:-2, 2:-2], ref[2:-2, 2:-2])[1] <= 1
        assert level_diff(got, ref)[0] < 0.2


def test_writes_in_place_into_a_strided_view():
    """The worker resizes straight into a slot: the output's memory is used, not replaced."""
    slot = torch.zeros((2, 64, 64, 3), dtype=torch.uint8)
    src = photo(200, 300)
    resize_into(src[10:150, 20:260], slot[1], "bilinear")
    assert slot[0].sum() == 0 and slot[1].float().mean() > 10
    np.testing.assert_array_equal(slot[1].numpy(), resize(src[10:150, 20:260], (64, 64)).numpy())


def test_a_read_only_source_is_fine():
    src = photo(50, 60)
    src.flags.writeable = False
    assert resize(src, (20, 20)).shape == (20, 20, 3)


def test_bad_interpolation_is_one_line():
    with pytest.raises(ValueError, match="interpolation='area'"):
        resize(photo(20, 20), (10, 10), "area")


def test_pixel_box_rounds_scales_and_stays_inside():
    assert pixel_box((10, 20, 110, 220), 1.0, 1.0, 470, 370) == (10, 20, 110, 220)
    assert pixel_box((10, 21, 111, 221), 0.5, 0.5, 235, 185) == (5, 10, 56, 110)  # a 1/2-scale decode
    assert pixel_box((0, 0, 470, 370), 0.5, 0.5, 235, 185) == (0, 0, 235, 185)
    assert pixel_box((469.9, 369.9, 470, 370), 0.125, 0.125, 59, 47) == (58, 46, 59, 47)  # never empty


def test_random_resized_crop_box_ranges():
    rng = np.random.default_rng(0)
    for _ in range(500):
        left, top, w, h = random_resized_crop_box(rng, 500, 375)
        assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375
        assert 0.08 * 0.95 <= w * h / (500 * 375) <= 1.0
    # an extreme aspect ratio falls back to the centre crop clamped to the ratio range
    assert random_resized_crop_box(np.random.default_rng(1), 1000, 10, scale=(0.99, 1.0)) == (493, 0, 13, 10)


def test_eval_is_the_centre_of_the_resized_image():
    data = jpeg_bytes(90, 60)
    recipe = Recipe(image_size=32)
    got = decode_crop(data, train=False, recipe=recipe, rng=np.random.default_rng(0))
    im = Image.open(io.BytesIO(data)).convert("RGB")
    short = recipe.resize_shorter  # 37
    rw, rh = round(90 * short / 60), short
    ref = np.asarray(im.resize((rw, rh), Image.BILINEAR))
    x0, y0 = (rw - 32 + 1) // 2, (rh - 32 + 1) // 2
    diff = np.abs(got.numpy().astype(int) - ref[y0 : y0 + 32, x0 : x0 + 32].astype(int))
    assert got.shape == (32, 32, 3) and diff.max() <= 1


def test_eval_resize_is_one_rule_for_every_loader():
    """The shorter side to resize_shorter (never under the output size), the centre rounded half up (DALI's)."""
    from dali_fast.transforms.resize import eval_resize

    recipe = Recipe(image_size=224)  # resize_shorter = round(224 / 0.875) = 256
    assert eval_resize(500, 375, recipe) == (341, 256, 59, 16)
    assert eval_resize(256, 256, recipe) == (256, 256, 16, 16)
    assert eval_resize(257, 1000, Recipe(image_size=224, eval_resize_size=225)) == (225, 875, 1, 326)
    assert eval_resize(3, 1000, Recipe(image_size=16, eval_resize_size=16)) == (16, 5333, 0, 2659)
