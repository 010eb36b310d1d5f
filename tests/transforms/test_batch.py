"""Batch operations on the device: uint8 to the recipe's dtype, normalized, mirrored and erased, with no host sync."""

from __future__ import annotations

import pytest
import torch

from dali_fast.transforms.batch import _normalization, finish_batch, normalize_flip
from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD


def test_normalize_flip_one_batched_op():
    img = torch.arange(2 * 2 * 3 * 3, dtype=torch.uint8).view(2, 2, 3, 3)  # NHWC
    out = normalize_flip(img, torch.tensor([False, True]), torch.float16)
    assert out.shape == (2, 3, 2, 3) and out.dtype == torch.float16
    plain = normalize_flip(img, torch.tensor([False, False]), torch.float32)
    assert torch.equal(out[0].float(), plain[0].half().float())
    assert torch.equal(out[1].float(), plain[1].flip(-1).half().float())


def test_normalize_flip_never_syncs_with_the_host(monkeypatch):
    """On a GPU, converting a tensor to a Python value waits for the device; here any such conversion fails."""

    img = torch.randint(0, 255, (4, 8, 8, 3), dtype=torch.uint8)
    flips = torch.tensor([True, False, True, False])
    expected = normalize_flip(img, flips, torch.float32)

    def no_sync(*_a, **_k):
        raise AssertionError("a host synchronization")

    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    got = normalize_flip(img, flips, torch.float32)
    got_last = normalize_flip(img, flips, torch.float32, torch.channels_last)
    boxes = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [0, 0, 8, 8], [7, 7, 1, 1]])
    erased = normalize_flip(img, flips, torch.float32, boxes=boxes)  # random erasing: masks, no sync either
    monkeypatch.undo()
    assert torch.equal(got, expected) and torch.equal(got_last, expected)
    assert got_last.is_contiguous(memory_format=torch.channels_last)
    assert [int((erased[i] == 0).sum()) for i in range(4)] == [3 * 12, 0, 3 * 64, 3]
    assert torch.equal(erased[1], expected[1]) and torch.equal(erased[0, :, 1:4, 2:6], torch.zeros(3, 3, 4))
    from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD

    a, b = (_normalization(torch.device("cpu"), IMAGENET_MEAN, IMAGENET_STD) for _ in range(2))
    assert a[0] is b[0] and a[1] is b[1]  # made once per device, not per batch


def test_finish_never_returns_the_slots_memory():
    """The slot is reused for the next batch right after: every output is a new tensor."""
    u8 = torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8)
    for dtype, fmt in [(torch.uint8, torch.contiguous_format), (torch.float16, torch.contiguous_format)]:
        out = finish_batch(u8, dtype, fmt)
        assert out.untyped_storage().data_ptr() != u8.untyped_storage().data_ptr()
        assert torch.equal(out.to(torch.float32), u8.to(torch.float32))
    hwc = torch.randint(0, 255, (4, 8, 8, 3), dtype=torch.uint8)
    out = finish_batch(hwc.permute(0, 3, 1, 2), torch.uint8, torch.channels_last)
    assert out.untyped_storage().data_ptr() != hwc.untyped_storage().data_ptr()
    assert out.is_contiguous(memory_format=torch.channels_last) and torch.equal(out, hwc.permute(0, 3, 1, 2))


def test_finish_normalizes_and_erases():
    u8 = torch.full((2, 3, 4, 4), 128, dtype=torch.uint8)
    mean, std = (128.0, 0.0, 255.0), (2.0, 128.0, 1.0)
    out = finish_batch(u8, torch.float32, mean=mean, std=std, boxes=torch.tensor([[0, 0, 2, 2], [0, 0, 0, 0]]))
    assert out[1, :, 0, 0].tolist() == [0.0, 1.0, -127.0]
    assert (out[0, :, :2, :2] == 0).all() and out[0, 2, 3, 3] == -127.0


@pytest.mark.parametrize("size", [224, 8])  # one image per cache-sized step, or the whole batch in one
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_finish_in_cache_sized_steps_is_bit_identical_to_whole_batch_ops(size, dtype, memory_format):

    u8 = torch.randint(0, 256, (5, size, size, 3), dtype=torch.uint8).permute(0, 3, 1, 2)  # an NHWC slot's view
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    want = u8.to(torch.float32).sub_(mean).mul_(1.0 / std).to(dtype)
    got = finish_batch(u8, dtype, memory_format, IMAGENET_MEAN, IMAGENET_STD)
    assert got.dtype == dtype and got.is_contiguous(memory_format=memory_format)
    assert torch.equal(got, want)


def test_finish_writes_into_the_given_output():
    u8 = torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8)
    for mean, std in [((1.0, 2.0, 3.0), (2.0, 2.0, 2.0)), (None, None)]:
        out = torch.empty((4, 3, 8, 8))
        got = finish_batch(u8, torch.float32, torch.contiguous_format, mean, std, out=out)
        assert got is out and torch.equal(out, finish_batch(u8, torch.float32, torch.contiguous_format, mean, std))


def test_normalize_images_is_the_recipes_normalization_in_float():
    from dali_fast import Recipe, normalize_images

    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).view(2, 3, 4, 5) * 2
    recipe = Recipe(mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    out = normalize_images(x, recipe)
    expected = (x.float() - torch.tensor([127.5, 63.75, 0.0]).view(1, 3, 1, 1)) / torch.tensor(
        [127.5, 63.75, 255.0]
    ).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and out.shape == x.shape and out.is_contiguous()
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(x, torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).view(2, 3, 4, 5) * 2)  # input untouched
    default = normalize_images(x)  # the default recipe: ImageNet's statistics
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert torch.allclose(default, (x.float() - mean) / std, atol=1e-5)
    half = normalize_images(x.contiguous(memory_format=torch.channels_last), dtype=torch.float16)
    assert half.dtype == torch.float16 and half.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(half.float(), default, atol=1e-2)


@pytest.mark.parametrize(
    ("images", "kw", "message"),
    [
        (
            torch.zeros(2, 3, 4, 4),
            {},
            "images of dtype torch.float32 and shape (2, 3, 4, 4): pass a loader's uint8 NCHW batch (N, 3, H, W)",
        ),
        (
            torch.zeros(2, 4, 4, 3, dtype=torch.uint8),
            {},
            "images of dtype torch.uint8 and shape (2, 4, 4, 3): pass a loader's uint8 NCHW batch (N, 3, H, W)",
        ),
        (
            torch.zeros(1, 3, 2, 2, dtype=torch.uint8),
            {"dtype": torch.uint8},
            "dtype=torch.uint8: use torch.float32 or torch.float16",
        ),
        (
            torch.zeros(1, 3, 2, 2, dtype=torch.uint8),
            {"recipe": "no-normalization"},
            "the recipe has mean=None: it has no normalization to apply; pass the recipe with its mean/std",
        ),
    ],
)
def test_normalize_images_refuses_in_one_line(images, kw, message):
    from dali_fast import Recipe, normalize_images

    if kw.get("recipe") == "no-normalization":
        kw = {"recipe": Recipe(mean=None, std=None)}
    with pytest.raises(ValueError) as e:
        normalize_images(images, **kw)
    assert str(e.value) == message
