"""Bilinear interpolation by its definition: the reference the resize tests measure against."""

from __future__ import annotations

import numpy as np


def plain_reference(src: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """Bilinear interpolation by its definition (pixel centres, the 2x2 source neighbours), in float64, to
    ``size`` (a square's side, or (width, height))."""
    h, w = src.shape[:2]
    width, height = (size, size) if isinstance(size, int) else size

    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(pos).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), pos - lo

    y0, y1, fy = taps(h, height)
    x0, x1, fx = taps(w, width)
    a = src.astype(np.float64)
    rows = a[y0] * (1 - fy)[:, None, None] + a[y1] * fy[:, None, None]
    out = rows[:, x0] * (1 - fx)[None, :, None] + rows[:, x1] * fx[None, :, None]
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
