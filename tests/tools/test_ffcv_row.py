"""bench's FFCV row: the recipe translated into FFCV's pipelines, the one line where FFCV is missing, and
(where FFCV is installed) the row itself over a .beton written once into the cache."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dali_fast.data.synthetic import make_synthetic
from dali_fast.tools.bench import run_bench
from dali_fast.tools.ffcv_row import FFCV_HINT, beton_key, ffcv_missing, ffcv_spec
from dali_fast.transforms.recipe import Recipe, resolve_recipe

HAS_FFCV = importlib.util.find_spec("ffcv") is not None


def test_the_default_recipe_is_ffcvs_imagenet_pipeline_with_the_same_settings():
    spec = ffcv_spec(Recipe(image_size=160))
    assert spec == {
        "image": [
            (
                "RandomResizedCropRGBImageDecoder",
                {"output_size": (160, 160), "scale": (0.08, 1.0), "ratio": (0.75, 4 / 3)},
            ),
            ("RandomHorizontalFlip", {"flip_prob": 0.5}),
            (
                "NormalizeImage",
                {"mean": Recipe().mean_255, "std": Recipe().std_255, "type": "float32"},
            ),
            ("ToTensor", {}),
            ("ToTorchImage", {"channels_last": False, "convert_back_int16": False}),
        ],
        "label": [("IntDecoder", {}), ("ToTensor", {}), ("Squeeze", {})],
    }
    # normalize before ToTorchImage: FFCV hangs the other way round
    names = [name for name, _ in spec["image"]]
    assert names.index("NormalizeImage") < names.index("ToTorchImage")


def test_the_recipes_crop_flip_dtype_and_layout_follow_into_ffcv():
    recipe = Recipe(
        image_size=96, scale=(0.35, 1.0), ratio=(0.5, 2.0), hflip=0.25, dtype=torch.float16,
        memory_format=torch.channels_last, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25),
    )  # fmt: skip
    image = dict(ffcv_spec(recipe)["image"])
    assert image["RandomResizedCropRGBImageDecoder"] == {
        "output_size": (96, 96),
        "scale": (0.35, 1.0),
        "ratio": (0.5, 2.0),
    }
    assert image["RandomHorizontalFlip"] == {"flip_prob": 0.25}
    assert image["NormalizeImage"] == {"mean": (127.5,) * 3, "std": (63.75,) * 3, "type": "float16"}
    assert image["ToTorchImage"]["channels_last"] is True
    uint8 = dict(ffcv_spec(Recipe(dtype=torch.uint8))["image"])
    assert "NormalizeImage" not in uint8  # uint8 output: the consumer normalizes, as in the other rows


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"auto_augment": "randaugment"}, "auto_augment"),
        ({"random_erasing": 0.25}, "random_erasing"),
        ({"interpolation": "bicubic"}, "interpolation='bicubic'"),
    ],
)
def test_what_ffcv_cannot_do_is_one_line(changes, named):
    with pytest.raises(ValueError) as e:
        ffcv_spec(Recipe(**changes))
    assert str(e.value) == (
        f"the ffcv row runs crop, flip and normalize only, not {named}; leave ffcv out of --loaders or drop those settings"
    )


def test_the_beton_key_follows_the_data(tmp_path):
    from dali_fast import open_dataset

    make_synthetic(tmp_path / "a", images=6, classes=2, progress=False)
    make_synthetic(tmp_path / "b", images=6, classes=2, progress=False)
    a, b = open_dataset(tmp_path / "a"), open_dataset(tmp_path / "b")
    assert beton_key(a) == beton_key(open_dataset(tmp_path / "a"))  # the same data: the same .beton
    assert beton_key(a) != beton_key(b)  # other files of the same count: another one


@pytest.mark.skipif(HAS_FFCV, reason="FFCV is installed here")
def test_without_ffcv_the_row_is_one_line_saying_how_to_get_it(tmp_path):
    assert ffcv_missing() == FFCV_HINT
    with pytest.raises(ValueError) as e:
        run_bench(None, images=8, loaders=["torch", "ffcv"], out=tmp_path / "out", progress=False)
    assert str(e.value) == FFCV_HINT
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # before any work


@pytest.mark.skipif(not HAS_FFCV, reason="needs FFCV (pip install ffcv)")
def test_the_ffcv_row_runs_the_same_data_and_reuses_its_beton(tmp_path, monkeypatch):
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    make_synthetic(tmp_path / "images", images=24, classes=3, progress=False)
    kw = {"loaders": ["torch", "ffcv"], "epochs": 1, "batch_size": 8, "image_size": 32, "limit": False}
    result = run_bench(str(tmp_path / "images"), out=tmp_path / "out", progress=False, **kw)
    rows = {r["loader"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]}
    assert "error" not in rows["ffcv"], rows["ffcv"]
    assert rows["ffcv"]["images_per_epoch"] == rows["torch"]["images_per_epoch"] == 24
    betons = list((tmp_path / "cache" / "ffcv").glob("*.beton"))
    assert len(betons) == 1 and not list((tmp_path / "cache" / "ffcv").glob(".*.tmp"))
    written = betons[0].stat().st_mtime_ns
    run_bench(str(tmp_path / "images"), out=tmp_path / "out2", progress=False, **kw)
    assert betons[0].stat().st_mtime_ns == written  # written once, then reused
    assert "| ffcv |" in result["table"]


@pytest.mark.skipif(not HAS_FFCV, reason="needs FFCV (pip install ffcv)")
def test_ffcv_batches_have_the_other_rows_shape_dtype_and_labels(tmp_path, monkeypatch):
    from dali_fast import open_dataset
    from dali_fast.tools.ffcv_row import FFCVLoader, write_beton

    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    make_synthetic(tmp_path / "images", images=20, classes=4, progress=False)
    reader = open_dataset(tmp_path / "images")
    loader = FFCVLoader(write_beton(reader, 2), 8, 2, resolve_recipe(None, image_size=32))
    batches = list(loader)
    images = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    assert images.shape == (20, 3, 32, 32) and images.dtype == torch.float32 and images.is_contiguous()
    assert labels.dtype == torch.int64
    assert sorted(labels.tolist()) == sorted(int(reader[i][1]) for i in range(20))
    assert -3 < images.mean().item() < 3  # normalized, not 0-255


def test_the_ffcv_row_refuses_targets_other_than_classes_before_any_row(tmp_path, monkeypatch):
    from dali_fast import open_dataset

    monkeypatch.setattr("dali_fast.tools.bench.ffcv_missing", lambda: None)  # as where FFCV is installed

    def no_row(*args, **kwargs):
        raise AssertionError("a row started before the settings were checked")

    monkeypatch.setattr("dali_fast.tools.bench.loader_row", no_row)
    make_synthetic(tmp_path / "tags", images=8, classes=3, multi_label=True, progress=False)
    reader = open_dataset(tmp_path / "tags", target="multihot", num_classes=3)
    with pytest.raises(ValueError) as e:
        run_bench(reader, loaders=["torch", "ffcv"], batch_size=4, out=tmp_path / "out", progress=False)
    assert str(e.value) == "the ffcv row reads class labels, not multihot targets; leave ffcv out of --loaders"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
