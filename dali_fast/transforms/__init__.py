"""Per-image transforms: the recipe every loader applies, and its pieces for Pillow, torch and DALI."""
