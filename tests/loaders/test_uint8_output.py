"""``dtype=torch.uint8``: both loaders hand over the uint8 pixels their float batches are made of, and
`normalize_images` on the consumer's side gives the float batch back."""

from __future__ import annotations

import pytest
import torch

from dali_fast import Recipe, normalize_images
from dali_fast.loaders.torch_iterator import TorchIterator


def _epoch(loader, epoch=1):
    loader.set_epoch(epoch)
    images, labels = zip(*loader, strict=True)
    return torch.cat(images), torch.cat(labels)


def _dali():
    pytest.importorskip("nvidia.dali")
    from dali_fast.loaders.dali_iterator import DALIIterator

    return DALIIterator


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_uint8_batches_normalized_on_the_consumers_side_equal_the_float_batches(index_reader, backend):
    cls = TorchIterator if backend == "torch" else _dali()
    kw = {"num_workers": 2} if backend == "torch" else {"num_threads": 2}
    common = {"image_size": 24, "device": "cpu", "seed": 3, **kw}
    floats, labels_f = _epoch(cls(index_reader, 8, **common))
    loader = cls(index_reader, 8, dtype=torch.uint8, **common)
    pixels, labels_u = _epoch(loader)
    assert pixels.dtype == torch.uint8 and pixels.shape == floats.shape == (37, 3, 24, 24)
    assert torch.equal(labels_u, labels_f)  # the same samples in the same order
    assert loader.recipe.mean == Recipe().mean and not loader.recipe.normalize
    again = normalize_images(pixels, loader.recipe)
    assert again.dtype == torch.float32
    # The same pixels, normalized on one side or the other: float rounding apart, equal.
    assert (again - floats).abs().max().item() < 1e-5


def test_uint8_output_with_erasing_holds_the_recipes_mean_pixel(index_reader):
    recipe = Recipe(image_size=24, dtype=torch.uint8, random_erasing=1.0, mean=(0.2, 0.4, 0.6), std=(0.5, 0.5, 0.5))
    assert recipe.erasing_fill == (51.0, 102.0, 153.0)  # round(0.2*255, 0.4*255, 0.6*255)
    assert Recipe(dtype=torch.uint8).erasing_fill == (124.0, 116.0, 104.0)  # ImageNet's mean pixel
    x, _ = _epoch(TorchIterator(index_reader, 8, recipe=recipe, num_workers=0, device="cpu"))
    filled = (x == torch.tensor([51, 102, 153], dtype=torch.uint8).view(1, 3, 1, 1)).all(1)
    assert filled.flatten(1).any(1).float().mean() > 0.5  # erased boxes (p=1; an erase may miss a small image)
    # normalized by the recipe, an erased box is 0 (its mean pixel, rounded)
    normed = normalize_images(x, recipe)
    assert normed.permute(0, 2, 3, 1)[filled].abs().max().item() < 0.01
