"""The recipe applied to one Pillow image, as a plain PyTorch script does it (the baseline's way): crop and
resize with Pillow, flip, automatic augmentation, then a float tensor normalized and erased per sample."""

from __future__ import annotations

import numpy as np
import torch

from .autoaugment import apply_policy
from .draws import erasing_box
from .recipe import Recipe
from .resize import PIL_RESAMPLE, eval_resize, random_resized_crop_box


class PillowTransform:
    """``transform(im, rng) -> (3, S, S) tensor`` of ``recipe`` (train: random-resized crop, flip, policy,
    normalize, erase, every choice from ``rng``; eval: resize and centre crop, normalize)."""

    def __init__(self, recipe: Recipe, train: bool) -> None:
        self.recipe, self.train = recipe, train
        self._mean = torch.tensor(recipe.mean_255).view(3, 1, 1) / 255
        self._std = torch.tensor(recipe.std_255).view(3, 1, 1) / 255

    def __call__(self, im, rng: np.random.Generator) -> torch.Tensor:
        from PIL import Image

        recipe, S = self.recipe, self.recipe.image_size
        resample = getattr(Image, PIL_RESAMPLE[recipe.interpolation])
        if self.train:
            left, top, w, h = random_resized_crop_box(rng, *im.size, recipe.scale, recipe.ratio)
            im = im.resize((S, S), resample, box=(left, top, left + w, top + h))
            if rng.random() < recipe.hflip:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            rw, rh, x0, y0 = eval_resize(im.width, im.height, recipe)
            im = im.resize((rw, rh), resample).crop((x0, y0, x0 + S, y0 + S))
        pixels = np.asarray(im, dtype=np.uint8)
        if self.train:
            pixels = apply_policy(pixels, recipe, rng)
        x = torch.from_numpy(pixels.copy()).permute(2, 0, 1)
        if recipe.normalize:
            x = ((x.float().div_(255) - self._mean) / self._std).to(recipe.out_dtype)
        else:
            x = x.to(recipe.out_dtype)
        if self.train and recipe.random_erasing > 0:
            top, left, h, w = erasing_box(rng, S, S, recipe)
            fill = torch.tensor(recipe.erasing_fill, dtype=x.dtype).view(3, 1, 1)
            x[:, top : top + h, left : left + w] = fill  # the mean pixel (Recipe.erasing_fill)
        return x
