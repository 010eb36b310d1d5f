"""OpenCV's kernels in TorchIterator's steps (`dali_fast.transforms.opencv`): the plain bilinear resize
within a level of the definition and of torch's kernel, the channel split and mirror exact, the float
conversion equal to torch's within float rounding, all written in place; torch and numpy where OpenCV is
missing; and no hang when the main process ran OpenCV's thread pool before the workers were forked."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from bilinear import plain_reference
from builders import photo
from default_output import ListReader, images

from dali_fast.transforms import opencv as ocv
from dali_fast.transforms.batch import finish_batch
from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD, Recipe
from dali_fast.transforms.resize import plain_bilinear, resize, resize_into

MEAN_255, STD_255 = IMAGENET_MEAN, IMAGENET_STD  # on the 0-255 scale


@pytest.fixture(autouse=True)
def fresh_opencv_lookup():
    ocv.opencv.cache_clear()
    yield
    ocv.opencv.cache_clear()


def switch_off(monkeypatch) -> None:
    """OpenCV's kernels switched off the way a user does it (``DALI_FAST_OPENCV=0``)."""
    monkeypatch.setenv(ocv.ENV, "0")
    ocv.opencv.cache_clear()
    assert ocv.opencv() is None


@pytest.fixture
def no_opencv(monkeypatch):
    switch_off(monkeypatch)


# (left, top, right, bottom) crops shrunk 1.1x to 1.96x to 112 px, square and not
UNDER_2X = [(0, 0, 123, 123), (100, 50, 268, 218), (30, 10, 250, 230), (5, 5, 200, 150)]


def test_opencv_is_there_and_used_by_default():
    assert ocv.opencv() is not None and ocv.opencv().__name__ == "cv2"


def test_plain_bilinear_within_a_level_of_the_definition_and_of_torchs_kernel(monkeypatch):
    src = photo()
    for x0, y0, x1, y1 in UNDER_2X:
        crop = src[y0:y1, x0:x1]  # a view, rows apart in memory: read where it lies
        assert plain_bilinear(crop.shape[:2], (112, 112))
        out = np.zeros((112, 112, 3), np.uint8)
        assert ocv.resize_plain_bilinear(crop, out)
        d = np.abs(out.astype(int) - plain_reference(crop, 112).astype(int))
        assert d.max() <= 1 and d.mean() < 0.2, (x0, y0, x1, y1, d.max(), d.mean())
        np.testing.assert_array_equal(out, resize(crop, (112, 112)).numpy())  # resize_into's bilinear is it
        switch_off(monkeypatch)
        by_torch = resize(crop, (112, 112)).numpy().astype(int)
        monkeypatch.delenv(ocv.ENV)
        ocv.opencv.cache_clear()
        assert np.abs(out.astype(int) - by_torch).max() <= 1


def test_the_resize_writes_into_the_slot_and_leaves_other_filters_to_torch():
    src = photo(200, 300)
    slot = torch.zeros((2, 64, 64, 3), dtype=torch.uint8)
    resize_into(src[10:100, 20:110], slot[1], "bilinear")  # 1.4x: OpenCV's
    assert slot[0].sum() == 0
    np.testing.assert_array_equal(slot[1].numpy(), resize(src[10:100, 20:110], (64, 64)).numpy())
    out = np.zeros((64, 64, 3), np.uint8)
    assert ocv.resize_plain_bilinear(src[10:100, 20:110], out)
    np.testing.assert_array_equal(out, slot[1].numpy())
    # a 2x+ shrink or an upscale is Pillow's filter (torch's kernel); OpenCV never sees it
    board = np.repeat((np.indices((448, 448)).sum(0) % 2 * 255).astype(np.uint8)[..., None], 3, axis=2)
    assert resize(board[:224, :224], (112, 112)).numpy().astype(int).std() < 1


def test_a_view_opencv_cannot_read_in_place_is_left_to_the_caller(monkeypatch):
    src = photo(100, 120)
    out = np.zeros((64, 64, 3), np.uint8)
    assert not ocv.resize_plain_bilinear(src[:, ::-1], out)  # mirrored: a negative step
    assert not ocv.resize_plain_bilinear(src.transpose(1, 0, 2), out)  # pixels not packed in rows
    assert not out.any()
    got = resize(src[:90, ::-1], (64, 64)).numpy()  # resize_into falls back to torch's kernel for it
    switch_off(monkeypatch)
    np.testing.assert_array_equal(got, resize(src[:90, ::-1], (64, 64)).numpy())


@pytest.mark.parametrize("mirror", [False, True])
def test_the_split_into_planes_is_exact(mirror):
    src = photo(120, 150)
    before = src.copy()
    for view in (src[:64, :64], src[10:74, 30:94]):  # contiguous rows, and a crop whose rows lie apart
        out = np.zeros((2, 3, 64, 64), np.uint8)
        scratch = np.empty((64, 64, 3), np.uint8)
        assert ocv.split_channels(view, out[1], mirror, scratch)
        expected = (view[:, ::-1] if mirror else view).transpose(2, 0, 1)
        np.testing.assert_array_equal(out[1], expected)
        assert not out[0].any()
    np.testing.assert_array_equal(src, before)  # the source is not touched


def test_the_conversion_is_torchs_within_float_rounding(monkeypatch):
    x = torch.randint(0, 256, (5, 3, 17, 23), dtype=torch.uint8)
    boxes = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [0, 0, 17, 23], [16, 22, 1, 1], [5, 5, 2, 2]])
    out = torch.full((5, 3, 17, 23), 7.0)
    got = finish_batch(x, torch.float32, mean=MEAN_255, std=STD_255, boxes=boxes, out=out)
    assert got is out
    switch_off(monkeypatch)
    expected = finish_batch(x, torch.float32, mean=MEAN_255, std=STD_255, boxes=boxes)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert int((got == 0).all(1).sum()) == 12 + 17 * 23 + 1 + 4  # each erased box, at the mean pixel (0)


def test_the_conversion_leaves_what_it_cannot_do_to_torch():
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    out = np.zeros((2, 3, 8, 8), np.float32)
    assert not ocv.normalize_into(x.numpy().transpose(0, 1, 3, 2), out, MEAN_255, STD_255)  # not contiguous
    assert not ocv.normalize_into(x.numpy(), out.astype(np.float16), MEAN_255, STD_255)
    assert not ocv.normalize_into(x.numpy().astype(np.float32), out, MEAN_255, STD_255)  # not uint8 pixels
    assert not ocv.normalize_into(x.numpy(), out[:1], MEAN_255, STD_255)
    assert not out.any()
    assert ocv.normalize_into(x.numpy()[:0], out[:0], MEAN_255, STD_255)  # an empty batch: nothing to write
    last = finish_batch(x, torch.float32, torch.channels_last, MEAN_255, STD_255)  # channels_last: torch's
    assert last.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(last, finish_batch(x, torch.float32, mean=MEAN_255, std=STD_255), rtol=0, atol=2e-6)


def test_without_opencv_every_step_is_torchs_and_numpys(no_opencv):
    src = photo(200, 300)
    out = np.zeros((64, 64, 3), np.uint8)
    planes = np.zeros((3, 64, 64), np.uint8)
    assert not ocv.resize_plain_bilinear(src[:90, :90], out)
    assert not ocv.split_channels(src[:64, :64], planes, False, np.empty((64, 64, 3), np.uint8))
    assert not ocv.normalize_into(planes[None], np.zeros((1, 3, 64, 64), np.float32), MEAN_255, STD_255)
    assert not out.any() and not planes.any()
    d = resize(src[:90, :90], (64, 64)).numpy().astype(int) - plain_reference(src[:90, :90], 64).astype(int)
    assert np.abs(d).max() <= 1


def test_a_missing_opencv_is_said_once_with_the_fix(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ImportError
    with caplog.at_level(logging.INFO, logger=ocv.__name__):
        assert ocv.opencv() is None and ocv.opencv() is None
    said = [r.getMessage() for r in caplog.records if r.name == ocv.__name__]
    assert len(said) == 1 and "pip install 'dali-fast[opencv]'" in said[0]


def test_torch_iterator_with_and_without_opencv_within_a_level(monkeypatch):
    """The whole train path (decode, crop, resize, mirror, split, normalize) either way: the same pixels
    within 1 level (the plain bilinear resize's rounding), most of them equal."""
    from dali_fast import TorchIterator

    recipe = Recipe(image_size=48)
    reader = ListReader(images(12))

    def batches() -> torch.Tensor:
        loader = TorchIterator(reader, 6, recipe=recipe, seed=5, num_workers=0, device="cpu")
        xs = []
        for e in (0, 1):
            loader.set_epoch(e)
            xs += [x for x, _ in loader]
        loader.close()
        return torch.cat(xs)

    with_cv = batches()
    switch_off(monkeypatch)
    without = batches()
    levels = ((with_cv - without).abs() * torch.tensor(STD_255).view(1, 3, 1, 1)).round()
    assert levels.max() <= 1 and (levels == 0).float().mean() > 0.5


@pytest.mark.slow
def test_workers_forked_after_the_main_process_ran_opencvs_pool_do_not_hang(tmp_path):
    """A forked child that resizes OpenCV's thread pool, started in its parent, hangs; so a worker whose
    parent imported ``cv2`` leaves the pool alone. Here the main process runs the pool first, then an
    epoch of TorchIterator with 2 workers must finish (a hang would be killed by the timeout)."""
    script = textwrap.dedent(
        """
        import sys
        import numpy as np, cv2
        sys.path.insert(0, sys.argv[1])
        from default_output import ListReader, images
        from dali_fast import TorchIterator
        big = np.random.default_rng(0).integers(0, 255, (1500, 1500, 3), dtype=np.uint8)
        for _ in range(3):
            cv2.resize(big, (1100, 1100), interpolation=cv2.INTER_LINEAR)  # OpenCV's pool runs
        loader = TorchIterator(ListReader(images(24)), 6, image_size=48, seed=1, num_workers=2, device="cpu")
        for epoch in range(2):
            loader.set_epoch(epoch)
            n = sum(len(y) for _, y in loader)
        loader.close()
        print("done", n)
        """
    )
    helpers = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "helpers")
    run = subprocess.run(
        [sys.executable, "-c", script, helpers], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert run.returncode == 0 and run.stdout.split() == ["done", "24"], run.stderr[-2000:]
