"""Every backend's images: shape, dtype and normalization, flips, odd formats decoded to RGB,
channels-last output, the GPU."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from builders import IndexReader, first_batch, jpeg_bytes, png_bytes
from contract import each_once
from loader_cases import epoch_labels
from PIL import Image

from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD


def normalized(rgb):
    return [(c - m) / s for c, m, s in zip(rgb, IMAGENET_MEAN, IMAGENET_STD, strict=True)]


def flat_png(rgb, w=48, h=40):
    out = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), rgb, np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shape_dtype_and_normalization(make, train, dtype):
    rgb = (200, 30, 60)
    reader = IndexReader([flat_png(rgb)] * 3)
    loader = make(reader, 3, train=train, dtype=dtype, image_size=24)
    images, labels = first_batch(loader)
    assert images.shape == (3, 3, 24, 24) and images.dtype == dtype
    assert labels.dtype == torch.int64 and labels.shape == (3,)
    got = images.float().mean(dim=(0, 2, 3)).tolist()
    std = images.float().std(dim=(0, 2, 3)).tolist()
    assert np.allclose(got, normalized(rgb), atol=1e-2)
    assert max(std) < 1e-2


def gradient_jpeg():
    arr = np.tile(np.linspace(0, 255, 64, dtype=np.float32)[None, :, None], (48, 1, 3)).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "JPEG", quality=95)
    return out.getvalue()


def flipped_fraction(loader, epochs):
    flips = total = 0
    for e in range(epochs):
        loader.set_epoch(e)
        for images, _ in loader:
            left = images[:, :, :, :4].float().mean(dim=(1, 2, 3))
            right = images[:, :, :, -4:].float().mean(dim=(1, 2, 3))
            flips += int((left > right).sum())
            total += len(images)
    return flips / total


def test_train_flips_about_half_eval_never(make):
    reader = IndexReader([gradient_jpeg()] * 50)
    assert 0.3 < flipped_fraction(make(reader, 10, train=True), epochs=4) < 0.7
    assert flipped_fraction(make(reader, 10, train=False), epochs=1) == 0.0


def test_eval_is_deterministic(make, index_reader):
    loader = make(index_reader, 8, train=False)
    first = [x.clone() for x, _ in loader]
    second = [x.clone() for x, _ in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    labels, _ = epoch_labels(loader, 7)
    assert labels == list(range(37))  # eval keeps the data set's order


def special_images():
    gray = io.BytesIO()
    Image.fromarray(np.full((30, 40), 128, np.uint8), mode="L").save(gray, "JPEG", quality=95)
    cmyk = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(cmyk, "JPEG", quality=95)  # red in CMYK
    progressive = jpeg_bytes(48, 40, (10, 200, 10), progressive=True)
    return [gray.getvalue(), cmyk.getvalue(), png_bytes(40, 30, "RGBA"), progressive]


def test_grayscale_cmyk_png_alpha_progressive_decode_to_rgb(make):
    reader = IndexReader(special_images())
    loader = make(reader, 4, train=False, image_size=16)
    images, labels = first_batch(loader)
    assert images.shape == (4, 3, 16, 16)
    means = images.float().mean(dim=(2, 3)).numpy()
    rgb = means * np.array(IMAGENET_STD)[None] / 1 + np.array(IMAGENET_MEAN)[None]
    by_label = dict(zip(labels.tolist(), rgb, strict=True))
    assert np.allclose(by_label[0], 128, atol=3)  # gray: three equal channels
    assert by_label[1][0] > 200 and by_label[1][1] < 60  # CMYK red came out red
    assert np.allclose(by_label[2], 120, atol=3)  # PNG with alpha: RGB of the pixels
    assert by_label[3][1] > 150 and by_label[3][0] < 60  # progressive green


def test_channels_last_output_same_values_no_copy_needed(make, index_reader):
    plain = make(index_reader, 8, train=False)
    last = make(index_reader, 8, train=False, memory_format=torch.channels_last)
    for (a, ya), (b, yb) in zip(plain, last, strict=True):
        assert torch.equal(ya, yb) and a.shape == b.shape
        assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError) as e:
        make(index_reader, 8, memory_format=torch.preserve_format)
    assert str(e.value) == "memory_format=torch.preserve_format: use torch.contiguous_format or torch.channels_last"


@pytest.mark.gpu
def test_gpu_mode_outputs_on_cuda_exactly_once(make, index_reader):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    loader = make(index_reader, 8, device="cuda")
    for epoch in range(2):
        loader.set_epoch(epoch)
        labels = []
        for images, lab in loader:
            assert images.is_cuda and images.shape[1:] == (3, 16, 16)
            labels += lab.tolist()
        each_once(labels, range(37))
    rgb = (200, 30, 60)
    flat = make(IndexReader([flat_png(rgb)] * 4), 4, device="cuda", train=False)
    images, _ = first_batch(flat)
    assert np.allclose(images.float().mean(dim=(0, 2, 3)).cpu().numpy(), normalized(rgb), atol=1e-2)
