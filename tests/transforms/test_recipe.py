"""Recipes: the per-image transform on both backends, and what the recipe changes in each loader's output."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
import torch
from builders import one_line
from default_output import GOLDEN, ListReader, fingerprint, images, versions
from loader_cases import loader
from PIL import Image

from dali_fast.transforms.autoaugment import OPS
from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD, Recipe

BACKENDS = ["torch", "dali"]


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


def solid_png(width: int, height: int, colour=(200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("normalized", [False, True], ids=["uint8", "float"])
@pytest.mark.parametrize("backend", [*BACKENDS, "baseline"])
def test_erased_boxes_hold_the_mean_pixel_in_every_loader(backend, normalized):
    """One rule for random erasing: the box holds the mean pixel. Normalized float: 0 (the mean normalizes
    to 0). uint8: ImageNet's mean pixel (124, 116, 104), not 0 (black), so that the model's own
    normalization maps it to about 0 too. The same in DALIIterator, TorchIterator and the baseline."""
    from dali_fast.loaders.baseline import BaselineDataset
    from dali_fast.transforms.draws import erasing_boxes
    from dali_fast.transforms.recipe import ERASING_FILL_255

    assert ERASING_FILL_255 == (124.0, 116.0, 104.0)
    norm = {} if normalized else {"mean": None, "std": None}
    recipe = Recipe(image_size=32, random_erasing=1.0, hflip=0.0, **norm)
    reader = ListReader([(solid_png(40 + 3 * i, 36 + 2 * i), i % 3) for i in range(12)])
    if backend == "baseline":
        ds = BaselineDataset(reader, train=True, recipe=recipe)
        x, boxes = torch.stack([ds[i][0] for i in range(len(reader))]), None
    else:
        it = loader(backend, reader, batch_size=12, recipe=recipe, seed=4)
        x, _ = epoch(it)
        boxes = erasing_boxes(recipe, 4, 0, it.last_indices)
    fill = torch.tensor(recipe.erasing_fill, dtype=x.dtype).view(3, 1, 1)
    assert recipe.erasing_fill == ((0.0, 0.0, 0.0) if normalized else ERASING_FILL_255)
    erased = 0
    for k, img in enumerate(x):
        mask = (img == fill).all(0)
        if boxes is not None:  # the drawn box exactly
            top, left, h, w = boxes[k].tolist()
            expected = torch.zeros_like(mask)
            expected[top : top + h, left : left + w] = True
            assert torch.equal(mask, expected), f"sample {k}: the erased pixels are not the drawn box"
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        if len(rows):  # a whole rectangle of the fill, and nothing else
            erased += 1
            assert int(mask.sum()) == (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)
        if not normalized:
            assert not (img == 0).all(0).any(), f"sample {k}: a black (0) pixel: uint8 erasing filled 0"
    assert erased >= 8  # random_erasing=1.0: nearly every sample has a box that fits


@pytest.mark.parametrize("backend", [*BACKENDS, "torch-no-opencv"])
def test_default_recipe_output_is_bit_identical_to_before(backend):
    """The default recipe's bytes must not change unnoticed. DALI's fingerprints were taken before recipes
    existed; TorchIterator's when its crop and flip came from counter-based draws (`crop_draws`), after its
    shrinks under 2x became plain bilinear, the rest of its resize torch's antialiased kernels, after
    libjpeg-turbo (held to Pillow and to bilinear interpolation's definition by
    test_torch_iterator.py::test_train_output_is_pillows_within_stated_levels), and again after OpenCV's
    kernels took its shrinks under 2x and its float conversion; without OpenCV (``torch-no-opencv``) its
    bytes are those from before that. tests/helpers/default_output.py takes them, on the versions they name."""
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
        (
            {"mean": (0.5, 0.5, 0.5), "std": (0.2, 0.2)},
            "mean has 3 values and std 2: give one per RGB channel (3 each)",
        ),
        ({"mean": None}, "mean and std: give both (0-1 scale, one per channel) or neither (uint8 output)"),
        ({"std": (0.2, 0.0, 0.2)}, "mean=(0.485, 0.456, 0.406), std=(0.2, 0.0, 0.2): need finite means and std > 0"),
        ({"hflip": 1.5}, "hflip=1.5: must be a probability in [0, 1]"),
        ({"random_erasing": -0.1}, "random_erasing=-0.1: must be a probability in [0, 1]"),
        ({"magnitude": 31}, "magnitude=31: must be an integer in [0, num_magnitude_bins - 1]"),
        ({"interpolation": "cubic"}, "interpolation='cubic': use one of bilinear, bicubic, nearest, lanczos"),
        ({"eval_crop_fraction": 0}, "eval_crop_fraction=0: must be in (0, 1]"),
        (
            {"eval_resize_size": 100},
            "eval_resize_size=100 is smaller than image_size=224: the centre crop would not fit",
        ),
        ({"image_size": 0}, "image_size=0: must be a positive integer"),
    ],
)
def test_bad_recipe_is_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        Recipe(**kw)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "mean, std",
    [
        ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)),  # DALI's (and OpenCV's) 0-255 convention
        ((0.485, 0.456, 0.406), (58.395, 57.12, 57.375)),  # one of the two on the wrong scale
        ((123.675, 116.28, 103.53), (0.229, 0.224, 0.225)),
        ((-0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # no pixel has a negative mean
    ],
)
def test_mean_std_off_the_0_1_scale_are_refused_in_one_line(mean, std):
    """mean/std on the 0-255 scale would give a nearly constant output: refused, naming the scale Recipe takes."""
    with pytest.raises(ValueError) as e:
        Recipe(mean=mean, std=std)
    assert str(e.value) == (
        f"mean={mean!r}, std={std!r}: Recipe takes them on the 0-1 scale (0 <= mean <= 1, 0 < std <= 1; "
        "ImageNet's: mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)); divide values on the 0-255 scale by 255"
    )
    assert Recipe(mean=(0.0, 0.5, 1.0), std=(1.0, 0.5, 0.25)).std_255 == (255.0, 127.5, 63.75)  # the edges are fine


def test_a_loader_argument_that_disagrees_with_the_recipe_is_refused(photos):
    with pytest.raises(ValueError) as e:
        loader("torch", photos, recipe=Recipe(image_size=64), image_size=32)
    assert str(e.value) == "image_size=32 disagrees with the recipe's image_size=64; set it in the recipe only"
    assert loader("torch", photos, recipe=Recipe(image_size=64), image_size=64).image_size == 64
    assert loader("torch", photos, image_size=48).recipe == Recipe(image_size=48)


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


# ----------------------------------------------------------------------------- progressive resizing
def test_progressive_is_ffcvs_ramp():
    """FFCV's ImageNet rule (`get_resolution`): the start size up to the ramp's first epoch, the end size
    from its last, and in between the straight line rounded to the nearest multiple of 32."""
    from dali_fast import Progressive

    ffcv = Progressive(160, 192, start_epoch=65, end_epoch=76)
    assert [ffcv(e) for e in (0, 65, 70, 71, 75, 76, 88)] == [160, 160, 160, 192, 192, 192, 192]
    ramp = Progressive(160, 224, 0, 4)
    assert [ramp(e) for e in range(6)] == [160, 192, 192, 192, 224, 224]  # 176 → 192, 208 → 192 (half to even)
    down = Progressive(224, 128, 0, 3)
    assert [down(e) for e in range(5)] == [224, 192, 160, 128, 128]
    odd = Progressive(176, 208, 0, 2)  # not multiples of 32: kept within [start, end]
    assert [odd(e) for e in range(3)] == [176, 192, 208]
    assert Progressive(16, 32, 1, 3, step=8)(2) == 24


def test_progressive_parse_and_errors():
    from dali_fast import Progressive

    assert Progressive.parse("160:192:65:76") == Progressive(160, 192, 65, 76)
    assert Progressive.parse("128:224:0:10:16") == Progressive(128, 224, 0, 10, step=16)
    assert str(Progressive(160, 192, 65, 76)) == "160:192:65:76"
    assert str(Progressive(128, 224, 0, 10, 16)) == "128:224:0:10:16"
    for text in ("160:192:65", "160:192:a:76", "", "1:2:3:4:5:6"):
        with pytest.raises(ValueError) as e:
            Progressive.parse(text)
        assert one_line(e) == (
            f"--progressive {text!r}: give START:END:FROM_EPOCH:TO_EPOCH[:STEP] in px and epochs, e.g. 160:192:65:76"
        )
    with pytest.raises(ValueError, match=r"^end_epoch=3 is before start_epoch=5: the ramp ends after it starts$"):
        Progressive(160, 192, 5, 3)
    with pytest.raises(ValueError, match=r"^start=0: must be a positive integer$"):
        Progressive(0, 192, 0, 3)
    with pytest.raises(ValueError, match=r"^start_epoch=-1: must be an integer >= 0$"):
        Progressive(160, 192, -1, 3)
    with pytest.raises(ValueError, match=r"^resolution=160: pass a Progressive"):
        Recipe(resolution=160)


def test_recipe_at_epoch_and_describe():
    from dali_fast import Progressive

    ffcv = Recipe(image_size=256, resolution=Progressive(160, 192, 65, 76))
    assert ffcv.at_epoch(0).image_size == 160 and ffcv.at_epoch(80).image_size == 192
    assert ffcv.at_epoch(80) == Recipe(image_size=192)  # a fixed-size recipe: nothing of the schedule
    assert ffcv.at_epoch(0, train=False) == Recipe(image_size=256)  # evaluation keeps image_size
    assert ffcv.resize_shorter == round(256 / 0.875)
    assert Recipe().at_epoch(7) == Recipe()
    assert ffcv.describe()["resolution"] == {"progressive": "160:192:65:76"}
    assert "resolution" not in Recipe().describe()  # as before schedules existed (old checkpoints resume)

    def steps(epoch):
        return 128 if epoch < 3 else 224

    described = Recipe(resolution=steps).describe()["resolution"]
    assert described == {"function": f"{__name__}.test_recipe_at_epoch_and_describe.<locals>.steps"}
    # an eval resize fixed below a training size does not stop the larger training size
    assert Recipe(image_size=160, eval_resize_size=180, resolution=lambda e: 224).at_epoch(0).image_size == 224


@pytest.mark.parametrize("name", sorted(set(OPS) - {"Identity"}))
def test_every_pillow_operation_changes_an_image(name):
    """The Pillow twins of DALI's automatic augmentations: each does something (at a middle magnitude) and
    keeps the size."""
    y, x = np.mgrid[0:32, 0:32]
    noise = np.random.default_rng(0).integers(0, 40, (32, 32, 3))
    im = Image.fromarray((np.stack([x * 5, y * 5, (x + y) * 2], -1) + noise).astype(np.uint8))
    magnitude = {"Posterize": 2, "Solarize": 128, "Rotate": 30, "TranslateX": 8, "TranslateY": 8}.get(name, 0.5)
    out = OPS[name](im, magnitude, 128)
    assert out.size == im.size and out.mode == "RGB"
    assert not np.array_equal(np.asarray(out), np.asarray(im))
