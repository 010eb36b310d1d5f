"""bench's SPDL row: the same crop, flip and normalize through SPDL's pipeline and FFmpeg decoder, each epoch
every sample once (every rank the same number of batches), bad records named or counted, and one line
saying how to get SPDL where it is missing."""

from __future__ import annotations

import io
import sys
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from dali_fast.data.open import open_dataset
from dali_fast.data.synthetic import make_synthetic
from dali_fast.tools.bench import run_bench
from dali_fast.tools.spdl_row import FFMPEG_LIBS, SPDLLoader, check_recipe, spdl_filter, spdl_missing
from dali_fast.transforms.draws import SampleDraws, crop_draws
from dali_fast.transforms.recipe import Recipe
from dali_fast.transforms.resize import random_resized_crop_box


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("spdl") / "images"
    make_synthetic(root, images=20, classes=4, progress=False)
    return root


def needs_spdl():
    pytest.importorskip("spdl")
    if spdl_missing() is not None:
        pytest.skip(spdl_missing())


def test_the_filter_graph_crops_scales_and_mirrors_in_one_pass():
    assert spdl_filter((3, 4, 50, 40), 32, False) == "crop=50:40:3:4,scale=32:32:flags=bilinear,format=rgb24"
    assert spdl_filter((0, 0, 8, 8), 16, True) == "crop=8:8:0:0,scale=16:16:flags=bilinear,hflip,format=rgb24"


def test_settings_spdl_has_no_operation_for_are_one_line():
    with pytest.raises(ValueError, match="^the spdl row runs crop, flip and normalize only, not auto_augment, random"):
        check_recipe(Recipe(auto_augment="randaugment", random_erasing=0.25))
    check_recipe(Recipe())  # crop, flip, normalize: fine


def test_where_spdl_is_missing_bench_says_how_to_get_it_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "spdl", None)  # `import spdl` now fails as where it is not installed
    missing = spdl_missing()
    assert missing is not None and missing.startswith(
        "the spdl row needs SPDL and FFmpeg's libraries: pip install spdl"
    )
    assert FFMPEG_LIBS in missing and "\n" not in missing
    with pytest.raises(ValueError, match="^the spdl row needs SPDL"):
        run_bench(str(tmp_path / "nothing-here"), loaders=["torch", "spdl"], out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pixels_are_the_shared_crop_and_flip_decoded_by_ffmpeg(images):
    needs_spdl()
    reader = open_dataset(images)
    recipe = Recipe(image_size=32, mean=None, std=None)  # uint8 out: pixels to compare
    loader = SPDLLoader(reader, 20, 2, recipe, seed=5)
    loader.set_epoch(2)
    batch, labels = next(iter(loader))
    assert batch.shape == (20, 3, 32, 32) and str(batch.dtype) == "torch.uint8"
    flips = 0
    for j, i in enumerate(loader.order()):
        data, label = reader[i]
        assert int(labels[j]) == label
        im = Image.open(io.BytesIO(data.tobytes())).convert("RGB")
        rng = SampleDraws(crop_draws(5, 2, [i])[0])  # the draws every loader takes for (seed, epoch, index)
        left, top, w, h = random_resized_crop_box(rng, im.width, im.height, recipe.scale, recipe.ratio)
        flip = rng.random() < recipe.hflip
        ref = im.resize((32, 32), Image.BILINEAR, box=(left, top, left + w, top + h))
        ref = np.asarray(ref.transpose(Image.FLIP_LEFT_RIGHT) if flip else ref).astype(int)
        got = batch[j].permute(1, 2, 0).numpy().astype(int)
        mirrored = got[:, ::-1]
        flips += flip
        # FFmpeg's bilinear shrink is not Pillow's antialiasing filter: some levels apart on average (these
        # synthetic images are busier than photos: 1-4.5 levels there); the mirror image is far further.
        assert np.abs(got - ref).mean() < 12, (i, np.abs(got - ref).mean())
        assert np.abs(mirrored - ref).mean() > 2 * np.abs(got - ref).mean(), i
    assert 0 < flips < 20


def test_normalized_batches_and_every_sample_once_per_epoch_on_every_rank(images):
    needs_spdl()
    reader = open_dataset(images)
    recipe = Recipe(image_size=24)
    one = SPDLLoader(reader, 6, 2, recipe)
    seen = Counter()
    for images_, labels in one:
        assert images_.dtype.is_floating_point and images_.shape[1:] == (3, 24, 24)
        assert -3 < float(images_.min()) and float(images_.max()) < 3  # normalized by the ImageNet mean and std
        seen.update(labels.tolist())
    assert seen == Counter(label for _, label in (reader[i] for i in range(len(reader))))
    assert len(one) == 4
    ranks = [SPDLLoader(reader, 4, 1, recipe, rank=r, world_size=3) for r in range(3)]
    orders = [r.order() for r in ranks]
    assert [len(o) for o in orders] == [7, 7, 7]  # 20 samples padded to 21: the same steps on every rank
    assert sorted(set(sum(orders, []))) == list(range(20)) and len(sum(orders, [])) == 21
    assert [len(r) for r in ranks] == [2, 2, 2]
    ranks[0].set_epoch(1)
    assert ranks[0].order() != orders[0]  # a new order each epoch


def test_a_bad_record_is_named_or_skipped_and_counted(tmp_path):
    needs_spdl()
    make_synthetic(tmp_path / "images", images=12, classes=2, progress=False)
    bad = sorted((tmp_path / "images").rglob("*.jpg"))[3]
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is no JPEG" * 4)
    reader = open_dataset(tmp_path / "images")
    with pytest.raises(ValueError, match=r"record \d+ \(.*" + bad.name):
        for _ in SPDLLoader(reader, 4, 2, Recipe(image_size=16)):
            pass
    skipping = SPDLLoader(reader, 4, 2, Recipe(image_size=16), on_error="skip")
    assert sum(len(labels) for _, labels in skipping) == 11 and skipping.skipped == 1


def test_bench_runs_the_spdl_row_beside_the_others(images, tmp_path):
    needs_spdl()
    result = run_bench(
        str(images), loaders=["torch", "spdl"], epochs=1, batch_size=5, image_size=24, out=tmp_path, progress=False
    )
    spdl = result["rows"][1]
    assert spdl["loader"] == "spdl" and "error" not in spdl, spdl
    assert spdl["images_per_epoch"] == 20 and spdl["img_per_s"] > 0 and spdl["batches_timed"] == 3
    assert result["table"].splitlines()[3].startswith("| spdl | ")
