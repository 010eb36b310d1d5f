"""OpenCV's CPU kernels for the three steps of `TorchIterator` where torch's and numpy's are slowest on a
core: the plain bilinear resize (a shrink under 2x), the uint8 HWC → CHW channel split (with the mirror),
and the uint8 → float32 normalizing conversion of a batch.

Each kernel is SIMD code that works in one pass over strided memory: OpenCV resizes a crop without copying
it out of the decoded image first, splits channels with vector shuffles (numpy's and torch's transposing
copies move one byte at a time), and normalizes with one multiply-add per pixel where torch makes three
passes (docs/bench.md has what that saves, measured).

OpenCV is the optional extra ``opencv`` (``opencv-python-headless``; any wheel that provides ``cv2``
serves). Where it does not import, or ``DALI_FAST_OPENCV=0`` is set, each function returns False and the
caller does the step with torch and numpy. The split and the mirror are exact either way; the conversion differs by float rounding
(under 1e-6 here); the plain bilinear resize by at most 1 level (OpenCV's 11-bit weights against torch's:
both within 1 level of the interpolation's definition). Pillow's filters (upscales, 2x+ shrinks) stay torch's.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

import numpy as np

log = logging.getLogger(__name__)

ENV = "DALI_FAST_OPENCV"  # "0": never use OpenCV's kernels (torch's and numpy's do every step)


@functools.lru_cache(maxsize=1)
def opencv() -> ModuleType | None:
    """The ``cv2`` module, imported on first use; None where it does not import or `ENV` is "0"."""
    if os.environ.get(ENV, "").strip() == "0":
        return None
    try:
        import cv2
    except ImportError as e:
        log.info(
            "OpenCV does not import (%s): TorchIterator resizes, splits channels and normalizes with torch's "
            "kernels, at more CPU per image (docs/bench.md); pip install 'dali-fast[opencv]'",
            e,
        )
        return None
    return cv2


def single_threaded_worker() -> None:
    """In a decode worker (one core's worth of work already), keep OpenCV's own thread pool out of the
    resize of large outputs (at 224 px it runs inline anyway).

    Only where the worker's parent never imported ``cv2``: a forked child that resizes OpenCV's pool while
    the parent had one running hangs (measured with OpenCV 4.14 and 5.1: ``cv2.setNumThreads(1)`` after
    the fork hung 4 of 5 children; children that leave it alone run)."""
    if "cv2" in sys.modules:  # imported before the fork: the parent may have started the pool
        return
    cv2 = opencv()
    if cv2 is not None:
        cv2.setNumThreads(1)


def _pixels_in_rows(a: np.ndarray) -> bool:
    """Whether OpenCV reads ``a`` (H, W, C) uint8 in place: pixels packed in rows, rows at a positive step."""
    return a.ndim == 3 and a.strides[2] == 1 and a.strides[1] == a.shape[2] and a.strides[0] > 0


def resize_plain_bilinear(src: np.ndarray, out: np.ndarray) -> bool:
    """Plain bilinear interpolation (half-pixel centres, edges clamped) of uint8 HWC ``src`` into ``out``
    (H, W, C, contiguous), in place. False, with ``out`` untouched, where OpenCV is missing or cannot read
    ``src`` where it lies (a flipped or transposed view): the caller resizes."""
    cv2 = opencv()
    if cv2 is None or not _pixels_in_rows(src) or not out.flags.c_contiguous:
        return False
    cv2.resize(src, (out.shape[1], out.shape[0]), dst=out, interpolation=cv2.INTER_LINEAR)
    return True


def split_channels(src: np.ndarray, out: np.ndarray, mirror: bool, scratch: np.ndarray) -> bool:
    """uint8 HWC ``src`` → ``out`` (C, H, W, each plane contiguous), mirrored left to right if ``mirror``
    (through ``scratch``, an array of ``src``'s shape). False, with ``out`` untouched, where OpenCV is missing
    or cannot read ``src`` where it lies."""
    cv2 = opencv()
    if cv2 is None or not _pixels_in_rows(src) or out.dtype != np.uint8 or not all(p.flags.c_contiguous for p in out):
        return False
    if mirror:
        src = cv2.flip(src, 1, dst=scratch)
    cv2.split(src, list(out))
    return True


def normalize_into(images: np.ndarray, out: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> bool:
    """``out`` = (``images`` − ``mean``) / ``std`` per channel: uint8 (N, C, H, W) to float32 (N, C, H, W),
    both contiguous, one multiply-add per pixel. False, with ``out`` untouched, where OpenCV is missing or
    the arrays are not those (other dtypes or shapes, not contiguous)."""
    cv2 = opencv()
    if cv2 is None or images.shape != out.shape or images.dtype != np.uint8 or out.dtype != np.float32:
        return False
    if not (images.flags.c_contiguous and out.flags.c_contiguous):
        return False
    mean_std = [(1.0 / std[c], -mean[c] / std[c]) for c in range(images.shape[1])]
    for image, into in zip(images, out, strict=True):
        for plane, dst, (scale, shift) in zip(image, into, mean_std, strict=True):
            # plane by plane: calls on more pixels start OpenCV's thread pool in the caller's process
            cv2.addWeighted(plane, scale, plane, 0.0, shift, dst=dst, dtype=cv2.CV_32F)
    return True
