"""Crop boxes, the resize to the output square (Pillow's filters, antialiased where a shrink needs it,
plain bilinear under a 2x shrink, written in place), and a record decoded, cropped and resized as the
recipe says."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from bilinear import plain_reference
from builders import jpeg_bytes, photo
from PIL import Image

from dali_fast.transforms.recipe import Recipe
from dali_fast.transforms.resize import (
    PIL_RESAMPLE,
    decode_crop,
    pixel_box,
    plain_bilinear,
    random_resized_crop_box,
    resize,
    resize_into,
)


def pillow(src: np.ndarray, box: tuple[int, int, int, int], size: int, interpolation: str) -> np.ndarray:
    """Pillow's crop, then its resize (torchvision's `resized_crop` on a PIL image)."""
    resample = getattr(Image, PIL_RESAMPLE[interpolation])
    return np.asarray(Image.fromarray(src).crop(box).resize((size, size), resample))


def level_diff(a, b) -> tuple[float, int]:
    d = np.abs(np.asarray(a, dtype=np.int32) - np.asarray(b, dtype=np.int32))
    return float(d.mean()), int(d.max())


# (left, top, right, bottom) boxes from a 3x upscale to a 3.3x shrink of a 470x370 photo at 112 px
BOXES = [(10, 20, 47, 57), (0, 0, 112, 112), (100, 50, 268, 218), (30, 10, 330, 310), (0, 0, 370, 370)]
PILLOW_BOXES = [b for b in BOXES if not plain_bilinear((b[3] - b[1], b[2] - b[0]), (112, 112))]  # all but 1.5x


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_bilinear_and_bicubic_are_pillows_filters(interpolation):
    """Measured over shrinks and upscales: within a few hundredths of a level on average, 1 level at most.
    (bilinear: upscales and shrinks by 2x or more; a shrink under 2x is plain bilinear, below.)"""
    src = photo()
    out = torch.empty((112, 112, 3), dtype=torch.uint8)
    for x0, y0, x1, y1 in BOXES if interpolation == "bicubic" else PILLOW_BOXES:
        resize_into(src[y0:y1, x0:x1], out, interpolation)
        mean, top = level_diff(out.numpy(), pillow(src, (x0, y0, x1, y1), 112, interpolation))
        assert mean < 0.05 and top <= 1, (interpolation, (x0, y0, x1, y1), mean, top)
    assert len(PILLOW_BOXES) == 4


# shrinks of 1.1x to 1.96x, square and not, at 112 px
UNDER_2X = [(0, 0, 123, 123), (100, 50, 268, 218), (30, 10, 250, 230), (5, 5, 200, 150)]


def test_a_shrink_under_2x_is_plain_bilinear():
    """Under 2x each output pixel's 2x2 source neighbours skip no source pixel, so plain bilinear does not
    alias there: torch's non-antialiased kernel is used, within a level of the definition everywhere."""
    src = photo()
    for x0, y0, x1, y1 in UNDER_2X:
        assert plain_bilinear((y1 - y0, x1 - x0), (112, 112))
        got = resize(src[y0:y1, x0:x1], (112, 112)).numpy()
        mean, top = level_diff(got, plain_reference(src[y0:y1, x0:x1], 112))
        assert mean < 0.5 and top <= 1, ((x0, y0, x1, y1), mean, top)


def test_plain_bilinear_under_2x_against_pillow():
    """What the filter change costs against Pillow's bilinear (which widens its triangle on every shrink),
    stated here and in docs/loaders.md: on a smooth image (a photo's content) under a level on average;
    on pixel-sized noise, the worst case of any filter difference, levels more. benchmarks/resize_filters.py
    measures it on real photos: 0.5-0.7 levels on average at 224 px."""
    y, x = np.mgrid[0:370, 0:470]
    smooth = np.stack([x * 255 // 469, y * 255 // 369, 128 + 100 * np.sin(x / 15.0) * np.cos(y / 11.0)], -1)
    smooth = smooth.astype(np.uint8)
    noisy = photo()  # gradients plus uniform noise of +-50 levels per pixel
    for x0, y0, x1, y1 in UNDER_2X:
        box = (x0, y0, x1, y1)
        mean, _ = level_diff(resize(smooth[y0:y1, x0:x1], (112, 112)).numpy(), pillow(smooth, box, 112, "bilinear"))
        assert mean < 0.3, (box, mean)
        mean, _ = level_diff(resize(noisy[y0:y1, x0:x1], (112, 112)).numpy(), pillow(noisy, box, 112, "bilinear"))
        assert mean < 20, (box, mean)


def test_the_filter_switches_to_antialiasing_at_a_2x_shrink():
    """A 1-pixel checkerboard: shrunk 2x (antialiased) it is flat grey; shrunk 1.9x (plain bilinear) it
    is not, which is why the switch is at 2x and not later."""
    board = (np.indices((448, 448)).sum(0) % 2 * 255).astype(np.uint8)
    src = np.repeat(board[..., None], 3, axis=2)
    assert not plain_bilinear((224, 224), (112, 112)) and plain_bilinear((212, 212), (112, 112))
    assert resize(src[:224, :224], (112, 112)).numpy().astype(int).std() < 1
    assert resize(src[:212, :212], (112, 112)).numpy().astype(int).std() > 10
    assert not plain_bilinear((100, 100), (112, 112)) and not plain_bilinear((112, 112), (112, 112))  # upscale, copy
    assert plain_bilinear((113, 60), (112, 112)) and not plain_bilinear((224, 150), (112, 112))


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
    a crop then a resize (torchvision's, DALI's, this one) does not. Inside, the two agree (on the shrinks
    where both are Pillow's filter)."""
    src = photo()
    resample = Image.BILINEAR
    for x0, y0, x1, y1 in PILLOW_BOXES[2:]:  # 2x+ shrinks: the filter reaches about one output pixel outside
        got = resize(src[y0:y1, x0:x1], (112, 112)).numpy()
        ref = np.asarray(Image.fromarray(src).resize((112, 112), resample, box=(x0, y0, x1, y1)))
        assert level_diff(got[2:-2, 2:-2], ref[2:-2, 2:-2])[1] <= 1
        assert level_diff(got, ref)[0] < 0.2


@pytest.mark.parametrize("box", [(10, 20, 150, 260), (10, 20, 100, 110)])  # a 2.2-3.8x shrink; a 1.4x one
def test_writes_in_place_into_a_strided_view(box):
    """The worker resizes straight into a slot: the output's memory is used, not replaced."""
    y0, x0, y1, x1 = box
    slot = torch.zeros((2, 64, 64, 3), dtype=torch.uint8)
    src = photo(200, 300)
    resize_into(src[y0:y1, x0:x1], slot[1], "bilinear")
    assert slot[0].sum() == 0 and slot[1].float().mean() > 10
    np.testing.assert_array_equal(slot[1].numpy(), resize(src[y0:y1, x0:x1], (64, 64)).numpy())


@pytest.mark.parametrize("size", [20, 40])  # antialiased, plain
def test_a_read_only_source_is_fine(size):
    src = photo(50, 60)
    src.flags.writeable = False
    assert resize(src, (size, size)).shape == (size, size, 3)


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
    """The shorter side resized (here a 1.6x shrink: plain bilinear), then the centre."""
    from dali_fast.transforms.decode import decode_rgb

    data = jpeg_bytes(90, 60)
    recipe = Recipe(image_size=32)
    got = decode_crop(data, train=False, recipe=recipe, rng=np.random.default_rng(0)).numpy().astype(int)
    im = Image.open(io.BytesIO(data)).convert("RGB")
    short = recipe.resize_shorter  # 37
    rw, rh = round(90 * short / 60), short
    x0, y0 = (rw - 32 + 1) // 2, (rh - 32 + 1) // 2
    ref = plain_reference(decode_rgb(data), (rw, rh))[y0 : y0 + 32, x0 : x0 + 32].astype(int)
    assert got.shape == (32, 32, 3) and np.abs(got - ref).max() <= 1
    pillow = np.asarray(im.resize((rw, rh), Image.BILINEAR))[y0 : y0 + 32, x0 : x0 + 32].astype(int)
    assert np.abs(got - pillow).mean() < 2  # 1.5 levels on this noise (sigma 8 levels per pixel)


def test_eval_resize_is_one_rule_for_every_loader():
    """The shorter side to resize_shorter (never under the output size), the centre rounded half up (DALI's)."""
    from dali_fast.transforms.resize import eval_resize

    recipe = Recipe(image_size=224)  # resize_shorter = round(224 / 0.875) = 256
    assert eval_resize(500, 375, recipe) == (341, 256, 59, 16)
    assert eval_resize(256, 256, recipe) == (256, 256, 16, 16)
    assert eval_resize(257, 1000, Recipe(image_size=224, eval_resize_size=225)) == (225, 875, 1, 326)
    assert eval_resize(3, 1000, Recipe(image_size=16, eval_resize_size=16)) == (16, 5333, 0, 2659)
