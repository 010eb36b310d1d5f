"""Per-sample random draws: the erasing boxes, a pure function of (seed, epoch, index), by torchvision's rule."""

from __future__ import annotations

import numpy as np
import pytest

from dali_fast.transforms.recipe import Recipe

ERASING_RECIPES = [
    Recipe(random_erasing=0.25),
    Recipe(image_size=32, random_erasing=1.0, erasing_scale=(0.9, 1.0), erasing_ratio=(1.0, 1.0)),
    Recipe(image_size=17, random_erasing=0.5, erasing_scale=(0.02, 0.9), erasing_ratio=(0.1, 10.0)),
]


@pytest.mark.parametrize("recipe", ERASING_RECIPES, ids=["default", "near_whole", "wide"])
def test_erasing_boxes_are_a_pure_function_of_seed_epoch_and_index(recipe):
    """A sample's box is the same drawn alone (TorchIterator's workers), in any batch, in any order (DALI's
    source): batches of every size, permuted, and the one-sample path all agree exactly."""
    from dali_fast.transforms.draws import erasing_boxes, sample_erasing_box

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
    from dali_fast.transforms.draws import erasing_boxes

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


def test_crop_draws_are_per_sample_whatever_the_batch_and_differ_by_epoch_and_seed():
    from dali_fast.transforms.draws import CROP_DRAWS, crop_draws

    batch = crop_draws(7, 3, [5, 9, 2])
    assert len(batch) == 3 and all(len(row) == CROP_DRAWS for row in batch)
    assert batch == [crop_draws(7, 3, [i])[0] for i in (5, 9, 2)]  # the same alone or in any batch
    assert crop_draws(7, 4, [5]) != crop_draws(7, 3, [5]) and crop_draws(8, 3, [5]) != crop_draws(7, 3, [5])
    assert all(0.0 <= u < 1.0 for row in batch for u in row)


def test_sample_draws_take_each_uniform_once_in_the_generator_calls_the_crop_makes():
    from dali_fast.transforms.draws import SampleDraws

    d = SampleDraws([0.25, 0.5, 0.0, 1 - 2**-53, 0.75])
    assert d.random() == 0.25
    assert d.uniform(2.0, 4.0) == 3.0
    assert d.integers(3, 8) == 3  # the lowest for 0.0
    assert d.integers(0, 5) == 4  # never the upper bound, even for the largest uniform
    assert d.integers(6, 7) == 6
    with pytest.raises(IndexError):
        d.random()  # more asked for than drawn: a bug, never a silent reuse


def test_crop_boxes_from_sample_draws_fit_and_follow_a_generator_s_distribution():
    """The crop and flip rule with the counter-based draws: boxes inside the image and of the ratio range
    asked, their areas distributed as a numpy generator's draws give them, about half the samples mirrored."""
    from dali_fast.transforms.draws import SampleDraws, crop_draws
    from dali_fast.transforms.resize import random_resized_crop_box

    def areas_and_flips(rngs):
        areas, flips = [], 0
        for rng in rngs:
            left, top, w, h = random_resized_crop_box(rng, 500, 375)
            assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375 and w > 0 and h > 0
            assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02 or (w, h) == (500, 375)
            areas.append(w * h / (500 * 375))
            flips += rng.random() < 0.5
        return np.array(areas), flips

    ours, our_flips = areas_and_flips(SampleDraws(row) for row in crop_draws(0, 1, list(range(4000))))
    numpy_rng = np.random.default_rng(0)
    theirs, _ = areas_and_flips(numpy_rng for _ in range(4000))
    assert 1850 < our_flips < 2150
    assert ours.min() < 0.09 and ours.max() > 0.95
    assert abs(ours.mean() - theirs.mean()) < 0.02
    assert all(abs(np.quantile(ours, q) - np.quantile(theirs, q)) < 0.04 for q in (0.1, 0.25, 0.5, 0.75, 0.9))
