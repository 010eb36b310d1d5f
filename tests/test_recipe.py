"""Recipes: the per-image transform on both backends, and batch-level mixup/cutmix and label smoothing."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
import torch
from default_output import GOLDEN, ListReader, fingerprint, images, versions
from PIL import Image

from dali_fast.autoaugment import OPS
from dali_fast.pipeline import IMAGENET_MEAN, IMAGENET_STD
from dali_fast.recipe import MixupCutmix, Recipe, soft_target_cross_entropy


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


# ----------------------------------------------------------------------------- the per-image recipe

BACKENDS = ["torch", "dali"]


def loader(backend, reader, batch_size=8, **kw):
    """A loader of ``backend`` on the CPU, in-process (no worker pool), seed 1 unless given."""
    from dali_fast import DALIIterator, TorchIterator

    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        return DALIIterator(reader, batch_size, device="cpu", num_threads=1, **{"seed": 1, **kw})
    return TorchIterator(reader, batch_size, device="cpu", num_workers=0, **{"seed": 1, **kw})


def epoch(it) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*it, strict=True)
    if hasattr(it, "close"):
        it.close()
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture(scope="module")
def photos():
    """16 noisy gradient JPEGs of several sizes (the fingerprint set)."""
    return ListReader(images(16))


def square(side: int, left=(250, 20, 20), right=(20, 20, 250)) -> bytes:
    """A square PNG, left half one colour and right half another: a flip swaps them."""
    px = np.zeros((side, side, 3), np.uint8)
    px[:, : side // 2], px[:, side // 2 :] = left, right
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_recipe_output_is_bit_identical_to_before(backend):
    """The default recipe's bytes must not change unnoticed. DALI's fingerprints were taken before recipes
    existed; TorchIterator's when its decode and resize moved to libjpeg-turbo and torch's antialiased
    kernels (held to Pillow by test_fallback.py::test_train_output_is_pillows_within_stated_levels).
    tests/default_output.py takes them, on the versions they name."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    golden = json.loads(GOLDEN.read_text())
    if golden["versions"] != versions():
        pytest.skip(f"fingerprints are of {golden['versions']}, this is {versions()}")
    for split in ("train", "eval"):
        got = fingerprint(backend, split == "train")
        assert got == golden["fingerprints"][f"{backend}-{split}"], split
        assert fingerprint(backend, split == "train", recipe=Recipe(image_size=32)) == got  # the explicit default


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_automatic_augmentation_changes_pixels_deterministically(backend, policy, photos):
    # Full-image crops and no flip: what changes the pixels is the augmentation alone.
    plain = Recipe(image_size=24, scale=(1.0, 1.0), ratio=(0.5, 2.0), hflip=0.0)
    x0, y0 = epoch(loader(backend, photos, recipe=plain))
    aug = plain.with_(auto_augment=policy)
    x1, y1 = epoch(loader(backend, photos, recipe=aug))
    x2, _ = epoch(loader(backend, photos, recipe=aug))
    assert torch.equal(y0, y1)
    assert torch.equal(x1, x2)  # the same seed: the same augmented pixels
    changed = [not torch.equal(a, b) for a, b in zip(x0, x1, strict=True)]
    assert sum(changed) >= len(changed) // 2, f"{policy} changed {sum(changed)} of {len(changed)} images"


@pytest.mark.parametrize("backend", BACKENDS)
def test_flip_frequency_is_the_recipe_s_probability(backend):
    reader = ListReader([(square(16), 0)] * 2000)
    for p in (0.5, 0.0):
        recipe = Recipe(image_size=8, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=p)
        x, _ = epoch(loader(backend, reader, batch_size=250, recipe=recipe))
        red_left, blue_left = (x[:, 0, :, 0] > x[:, 2, :, 0]).all(1), (x[:, 2, :, 0] > x[:, 0, :, 0]).all(1)
        red_right, blue_right = (x[:, 0, :, -1] > x[:, 2, :, -1]).all(1), (x[:, 2, :, -1] > x[:, 0, :, -1]).all(1)
        flipped, kept = blue_left & red_right, red_left & blue_right
        assert bool((flipped ^ kept).all())  # the whole image (scale 1, ratio 1), mirrored or not
        assert abs(flipped.float().mean().item() - p) <= 0.05


def zero_box(img: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(top, left, h, w) of the all-channel zero region of a CHW image, asserting it is one rectangle."""
    zero = (img == 0).all(0)
    if not zero.any():
        return None
    rows, cols = zero.any(1).nonzero().flatten(), zero.any(0).nonzero().flatten()
    top, left, h, w = int(rows[0]), int(cols[0]), len(rows), len(cols)
    assert int(rows[-1]) - top + 1 == h and int(cols[-1]) - left + 1 == w  # contiguous
    assert bool(zero[top : top + h, left : left + w].all()) and int(zero.sum()) == h * w  # a filled rectangle
    return top, left, h, w


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_erasing_fills_a_box_within_the_documented_bounds(backend, photos):
    S = 32
    recipe = Recipe(image_size=S, random_erasing=1.0, erasing_scale=(0.05, 0.25), erasing_ratio=(0.5, 2.0))
    x, _ = epoch(loader(backend, photos, recipe=recipe))
    boxes = [zero_box(img) for img in x]
    for box in boxes:
        assert box is not None  # p=1: every image (a box always fits at these bounds)
        _, _, h, w = box
        # area within scale x S x S and aspect within ratio, up to rounding h and w to whole pixels
        assert 0.05 * S * S - (h + w) / 2 - 1 <= h * w <= 0.25 * S * S + (h + w) / 2 + 1
        assert 0.5 * (h - 0.5) / (w + 0.5) <= h / w * 0.5 + 1e-9 and (h - 0.5) / (w + 0.5) <= 2.0
    # the box is drawn from (seed, epoch, index) by one rule: the other backend erases the same boxes
    other = "dali" if backend == "torch" else "torch"
    if other == "dali" and importlib.util.find_spec("nvidia.dali") is None:
        return
    y, _ = epoch(loader(other, photos, recipe=recipe))
    assert [zero_box(img) for img in y] == boxes
    x0, _ = epoch(loader(backend, photos, recipe=recipe.with_(random_erasing=0.0)))
    assert all(zero_box(img) is None for img in x0)
    # a box must fit strictly inside (torchvision's rule): near-whole-image boxes are redrawn, never the whole
    big = recipe.with_(erasing_scale=(0.9, 1.0), erasing_ratio=(1.0, 1.0))
    x1, _ = epoch(loader(backend, photos, recipe=big))
    sides = [zero_box(img)[2:] for img in x1 if zero_box(img) is not None]
    assert len(sides) >= 12 and all(h < S and w < S and h * w >= 0.9 * S * S - S - 1 for h, w in sides), sides


@pytest.mark.parametrize("backend", BACKENDS)
def test_uint8_output_without_mean_and_std(backend, photos):
    recipe = Recipe(image_size=16, mean=None, std=None)
    x, _ = epoch(loader(backend, photos, recipe=recipe, train=False))
    normalized, _ = epoch(loader(backend, photos, recipe=Recipe(image_size=16), train=False))
    assert x.dtype == torch.uint8 and x.shape == (16, 3, 16, 16)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert torch.allclose((x.float() - mean) / std, normalized, atol=1e-4)


def framed(side: int) -> bytes:
    """A square PNG: a red centre square (the middle half of each side) on blue."""
    px = np.zeros((side, side, 3), np.uint8)
    px[:] = (20, 20, 250)
    px[side // 4 : 3 * side // 4, side // 4 : 3 * side // 4] = (250, 20, 20)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_resize_and_crop_follow_the_recipe(backend):
    """Eval: the shorter side resized to ``eval_resize_size`` (else size / ``eval_crop_fraction``), then a
    centre crop of ``image_size``: how much of the red centre square fills the crop tells which."""
    reader = ListReader([(framed(40), 0)])

    def red_share(recipe: Recipe) -> float:
        x, _ = epoch(loader(backend, reader, train=False, recipe=recipe))
        return float((x[0, 0] > x[0, 2]).float().mean())

    assert red_share(Recipe(image_size=20, eval_crop_fraction=1.0)) == pytest.approx(0.25, abs=0.06)  # all of it
    assert red_share(Recipe(image_size=20)) == pytest.approx(0.25 / 0.875**2, abs=0.06)  # the middle 87.5 %
    assert red_share(Recipe(image_size=20, eval_crop_fraction=0.5)) == 1.0  # the middle half: the red square
    assert red_share(Recipe(image_size=20, eval_resize_size=80)) == 1.0  # 80 px, middle 20: inside the square
    assert red_share(Recipe(image_size=20, eval_resize_size=24)) == pytest.approx(0.25 * (24 / 20) ** 2, abs=0.06)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"scale": (-0.1, 1.0)}, "scale=(-0.1, 1.0): need 0 < min <= max <= 1"),
        ({"scale": (0.9, 0.2)}, "scale=(0.9, 0.2): need 0 < min <= max <= 1"),
        ({"ratio": (1,)}, "ratio=(1,): give two numbers (min, max)"),
        ({"auto_augment": "foo"}, "auto_augment='foo': use None, 'randaugment', 'trivialaugment', 'autoaugment'"),
        ({"mean": (0.5, 0.5, 0.5), "std": (0.2, 0.2)}, "mean has 3 values and std 2: give one per RGB channel (3 each)"),
        ({"mean": None}, "mean and std: give both (0-1 scale, one per channel) or neither (uint8 output)"),
        ({"std": (0.2, 0.0, 0.2)}, "mean=(0.485, 0.456, 0.406), std=(0.2, 0.0, 0.2): need finite means and std > 0"),
        ({"hflip": 1.5}, "hflip=1.5: must be a probability in [0, 1]"),
        ({"random_erasing": -0.1}, "random_erasing=-0.1: must be a probability in [0, 1]"),
        ({"magnitude": 31}, "magnitude=31: must be an integer in [0, num_magnitude_bins - 1]"),
        ({"interpolation": "cubic"}, "interpolation='cubic': use one of bilinear, bicubic, nearest, lanczos"),
        ({"eval_crop_fraction": 0}, "eval_crop_fraction=0: must be in (0, 1]"),
        ({"eval_resize_size": 100}, "eval_resize_size=100 is smaller than image_size=224: the centre crop would not fit"),
        ({"dtype": torch.uint8}, "dtype=torch.uint8 holds unnormalized pixels: pass mean=None, std=None with it"),
        ({"image_size": 0}, "image_size=0: must be a positive integer"),
    ],
)
def test_bad_recipe_is_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        Recipe(**kw)
    assert str(e.value) == message


def test_a_loader_argument_that_disagrees_with_the_recipe_is_refused(photos):
    with pytest.raises(ValueError) as e:
        loader("torch", photos, recipe=Recipe(image_size=64), image_size=32)
    assert str(e.value) == "image_size=32 disagrees with the recipe's image_size=64; set it in the recipe only"
    assert loader("torch", photos, recipe=Recipe(image_size=64), image_size=64).image_size == 64
    assert loader("torch", photos, image_size=48).recipe == Recipe(image_size=48)


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


@pytest.mark.parametrize("source", ["torch", "dali", "dataloader"])
def test_mixup_cutmix_on_batches_from_any_loader(source, photos):
    """Our loaders' batches and a plain DataLoader's: mixed on their own device, soft targets summing to 1."""
    if source == "dataloader":
        from torch.utils.data import DataLoader

        from dali_fast.baseline import BaselineDataset

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


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment"])
def test_gpu_recipes_run_on_the_device_and_erase_the_cpu_boxes(policy, photos):
    """On a GPU: the policy runs after `mixed` decoding, the output stays on the device, it is repeatable
    for a seed, and random erasing fills the same boxes as TorchIterator's (drawn by one rule)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator, TorchIterator

    recipe = Recipe(image_size=32, auto_augment=policy, random_erasing=1.0, erasing_scale=(0.05, 0.25))
    runs = [epoch(DALIIterator(photos, 8, device="cuda", seed=1, recipe=recipe)) for _ in range(2)]
    assert runs[0][0].is_cuda and runs[0][0].shape == (16, 3, 32, 32)
    assert torch.equal(runs[0][0], runs[1][0])
    cpu, _ = epoch(TorchIterator(photos, 8, device="cpu", num_workers=0, seed=1, recipe=recipe))
    assert [zero_box(img) for img in runs[0][0].cpu()] == [zero_box(img) for img in cpu]


ERASING_RECIPES = [
    Recipe(random_erasing=0.25),
    Recipe(image_size=32, random_erasing=1.0, erasing_scale=(0.9, 1.0), erasing_ratio=(1.0, 1.0)),
    Recipe(image_size=17, random_erasing=0.5, erasing_scale=(0.02, 0.9), erasing_ratio=(0.1, 10.0)),
]


@pytest.mark.parametrize("recipe", ERASING_RECIPES, ids=["default", "near_whole", "wide"])
def test_erasing_boxes_are_a_pure_function_of_seed_epoch_and_index(recipe):
    """A sample's box is the same drawn alone (TorchIterator's workers), in any batch, in any order (DALI's
    source): batches of every size, permuted, and the one-sample path all agree exactly."""
    from dali_fast.recipe import erasing_boxes, sample_erasing_box

    index = np.random.default_rng(1).permutation(3000)
    whole = erasing_boxes(recipe, 7, 2, index)
    assert whole.dtype == np.int64 and whole.shape == (3000, 4)
    for size in (1, 2, 3, 4, 5, 64, 256):
        parts = np.concatenate([erasing_boxes(recipe, 7, 2, index[k : k + size]) for k in range(0, 600, size)])
        assert np.array_equal(parts, whole[: len(parts)]), size
    in_order = erasing_boxes(recipe, 7, 2, np.arange(3000))  # index is a permutation of 0..2999
    assert np.array_equal(in_order[index], whole)  # another order, the same box for each sample
    singles = [sample_erasing_box(recipe, 7, 2, int(i)) for i in index[:400]]
    assert singles == [tuple(row) for row in whole[:400].tolist()]
    assert all(type(v) is int for v in singles[0])
    assert not np.array_equal(erasing_boxes(recipe, 7, 3, index), whole)  # another epoch: other boxes
    assert not np.array_equal(erasing_boxes(recipe, 8, 2, index), whole)  # another seed: other boxes


def test_erasing_boxes_follow_torchvisions_rule():
    """Over many samples: a box with the recipe's probability, strictly inside, of the recipe's area and
    aspect (up to rounding to whole pixels), at a uniform position; none when erasing is off."""
    from dali_fast.recipe import erasing_boxes

    S, n = 64, 40_000
    recipe = Recipe(image_size=S, random_erasing=0.3, erasing_scale=(0.05, 0.3), erasing_ratio=(0.5, 2.0))
    boxes = erasing_boxes(recipe, 0, 0, np.arange(n))
    on = boxes[:, 2] > 0
    assert abs(on.mean() - 0.3) < 0.015  # binomial sd 0.0023: the draw is fixed, this only guards the rule
    assert (boxes[~on] == 0).all()
    top, left, h, w = boxes[on].T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= S).all() and (left + w <= S).all()
    assert (h < S).all() and (w < S).all() and (h > 0).all() and (w > 0).all()
    area = h * w / (S * S)
    assert area.min() >= 0.05 - 2 / S and area.max() <= 0.3 + 2 / S
    aspect = h / w
    assert aspect.min() >= 0.5 * (1 - 2 / 8) and aspect.max() <= 2.0 * (1 + 2 / 8)
    assert abs(np.log(aspect).mean()) < 0.02  # log-uniform on a symmetric range: centred on aspect 1
    slack = (S - h + 1).astype(np.float64)
    assert abs((top / slack).mean() - 0.5) < 0.02 and abs((left / slack).mean() - 0.5) < 0.02
    assert (erasing_boxes(recipe.with_(random_erasing=0.0), 0, 0, np.arange(100)) == 0).all()
    assert (erasing_boxes(recipe, 0, 0, np.zeros(0, np.int64))).shape == (0, 4)
