"""Batch-level mixup and cutmix with label smoothing, on batches from any loader, and the soft-target loss."""

from __future__ import annotations

import pytest
import torch
from default_output import ListReader, images
from loader_cases import loader

from dali_fast.transforms.mix import MixupCutmix, soft_target_cross_entropy


def batch(n=8, classes=5, size=16):
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, size, size).clone()
    return images, torch.arange(n) % classes


def test_mixup_targets_sum_to_one_and_match_the_coefficient():
    mix = MixupCutmix(alpha_mixup=0.8, alpha_cutmix=0.0, label_smoothing=0.0, num_classes=5, seed=1)
    images, labels = batch()
    out, targets = mix(images, labels)
    lam = mix.last["lam"]
    assert mix.last["mode"] == "mixup" and 0 <= lam <= 1
    assert torch.allclose(targets.sum(1), torch.ones(8))
    assert torch.allclose(out[:, 0, 0, 0], lam * images[:, 0, 0, 0] + (1 - lam) * images.flip(0)[:, 0, 0, 0])
    assert targets[0, labels[0]] == pytest.approx(lam + (1 - lam) * float(labels[0] == labels[-1]))


def test_cutmix_box_area_matches_lambda():
    mix = MixupCutmix(alpha_mixup=0.0, alpha_cutmix=1.0, label_smoothing=0.0, num_classes=5, seed=3)
    images, labels = batch(size=32)
    for _ in range(20):
        out, targets = mix(images, labels)
        y0, y1, x0, x1 = mix.last["box"]
        pasted = (out[0, 0] != images[0, 0]).sum().item()  # pixels of sample 0 that came from sample 7
        assert pasted == (y1 - y0) * (x1 - x0)
        assert abs((1 - mix.last["lam"]) * 32 * 32 - pasted) < 32  # within one pixel row
        assert torch.allclose(targets.sum(1), torch.ones(8))


def test_label_smoothing_and_reproducible_from_a_seed():
    images, labels = batch()
    a = MixupCutmix(label_smoothing=0.1, num_classes=5, seed=7)
    b = MixupCutmix(label_smoothing=0.1, num_classes=5, seed=7)
    for _ in range(5):
        (xa, ta), (xb, tb) = a(images, labels), b(images, labels)
        assert torch.equal(xa, xb) and torch.equal(ta, tb) and a.last == b.last
    off = MixupCutmix(prob=0.0, label_smoothing=0.1, num_classes=5)
    _, t = off(images, labels)
    assert off.last["mode"] == "none" and t[0].tolist() == pytest.approx([0.92, 0.02, 0.02, 0.02, 0.02])


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"alpha_mixup": -1}, "alpha_mixup=-1: must be >= 0 (0 turns it off)"),
        ({"prob": 1.5}, "prob=1.5: must be in [0, 1]"),
        ({"label_smoothing": -0.1}, "label_smoothing=-0.1: must be in [0, 1]"),
        ({"num_classes": 0}, "num_classes=0: must be a positive integer"),
    ],
)
def test_bad_settings_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        MixupCutmix(**kw)
    assert str(e.value) == message


def test_soft_target_cross_entropy_equals_plain_for_one_hot():
    logits = torch.randn(4, 5)
    labels = torch.tensor([0, 3, 1, 4])
    onehot = torch.nn.functional.one_hot(labels, 5).float()
    assert soft_target_cross_entropy(logits, onehot) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, labels))
    )


@pytest.fixture(scope="module")
def photos():
    """16 noisy gradient JPEGs of several sizes."""
    return ListReader(images(16))


@pytest.mark.parametrize("source", ["torch", "dali", "dataloader"])
def test_mixup_cutmix_on_batches_from_any_loader(source, photos):
    """Our loaders' batches and a plain DataLoader's: mixed on their own device, soft targets summing to 1."""
    if source == "dataloader":
        from torch.utils.data import DataLoader

        from dali_fast.loaders.baseline import BaselineDataset

        images, labels = next(iter(DataLoader(BaselineDataset(photos, image_size=16), batch_size=8)))
    else:
        images, labels = next(iter(loader(source, photos, image_size=16)))
    for kw in ({"alpha_cutmix": 0.0}, {"alpha_mixup": 0.0}):
        mix = MixupCutmix(num_classes=3, seed=5, **kw)
        out, targets = mix(images, labels)
        assert out.shape == images.shape and out.device == images.device and targets.shape == (8, 3)
        assert torch.allclose(targets.sum(1), torch.ones(8))
        assert mix.last["mode"] == ("mixup" if kw.get("alpha_cutmix") == 0.0 else "cutmix")
    uint8 = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="mixup blends images: pass float images"):
        MixupCutmix(alpha_cutmix=0.0, num_classes=3)(uint8, torch.tensor([0, 1]))


def test_mixup_cutmix_reads_nothing_back_from_the_device():
    """The label check must not read labels back from the GPU each step (two host syncs). On the `meta`
    device any read of a value fails, as a GPU read would stall: mixing works there, both ways. Labels on
    the CPU are still checked (no sync there)."""
    images, labels = batch()
    for kw in ({"alpha_cutmix": 0.0}, {"alpha_mixup": 0.0}, {"prob": 0.0}):
        mix = MixupCutmix(num_classes=5, seed=1, **kw)
        out, targets = mix(images.to("meta"), labels.to("meta"))
        assert out.device.type == "meta" and targets.shape == (8, 5)
    with pytest.raises(ValueError, match=r"labels outside 0..4: set num_classes to the data set's classes"):
        MixupCutmix(num_classes=5)(images, labels + 1)


def test_class_mixing_of_multi_hot_rows_is_one_line():
    """Multi-hot rows fed to a class mixer: named from the shape and dtype, not a failure inside torch."""
    mix = MixupCutmix(alpha_mixup=0.8, num_classes=80, seed=0)
    rows = torch.zeros(4, 80)
    with pytest.raises(ValueError) as e:
        mix(torch.zeros(4, 3, 8, 8), rows)
    assert str(e.value) == (
        "target='class' mixes class indices, int64 (N,), got torch.float32 (4, 80): for multi-hot or float rows "
        "make MixupCutmix(target='multihot' or 'float', num_classes=K)"
    )
