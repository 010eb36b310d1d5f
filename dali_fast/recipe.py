"""Deprecated: the recipe lives in `dali_fast.transforms` now (`recipe.Recipe`, `mix.MixupCutmix`)."""

from ._moved import moved

__getattr__ = moved(
    __name__,
    {
        "MixupCutmix": "dali_fast.transforms.mix",
        "Recipe": "dali_fast.transforms.recipe",
        "soft_target_cross_entropy": "dali_fast.transforms.mix",
    },
)
