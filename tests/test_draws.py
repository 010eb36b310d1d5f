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
