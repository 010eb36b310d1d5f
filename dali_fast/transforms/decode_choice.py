"""How DALI decodes training images on this machine: the whole image (on a GPU's hardware JPEG engine) or
only the crop window, chosen by whether the GPU has the engine (read through NVML, as `dali-fast doctor`
reads it) and by what the user asks for. Imports neither torch nor DALI, so `doctor --quick` stays light.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

from ..machine import nvml_handle

log = logging.getLogger(__name__)

# The share of JPEG work the `mixed` decoder sends to the hardware JPEG engine when it decodes whole images
# (DALI's default, 0.65, leaves a third to the CUDA decoder, whose Huffman stage runs on the CPU threads).
HW_DECODER_LOAD = 0.99

# How training decodes: "whole" decodes the whole image (on a GPU with fancy chroma upsampling and the
# JPEG engine), then crops on the device; "roi" decodes only the crop window; "auto" picks (see below).
TRAIN_DECODES = ("auto", "whole", "roi")
TRAIN_DECODE_ENV = "DALI_FAST_TRAIN_DECODE"


def requested_train_decode(value: str | None = None) -> str:
    """The training decode asked for: ``value``, else the ``DALI_FAST_TRAIN_DECODE`` environment variable,
    else "auto"; anything but "auto", "whole" or "roi" is a one-line ValueError naming where it came from."""
    where = "train_decode"
    if value is None:
        value, where = os.environ.get(TRAIN_DECODE_ENV) or "auto", TRAIN_DECODE_ENV
    if value not in TRAIN_DECODES:
        raise ValueError(
            f"{where}={value!r}: use 'auto', 'whole' (decode whole images) or 'roi' (the crop window only)"
        )
    return value


def choose_train_decode(gpu: bool, jpeg_engine: bool | None, requested: str = "auto") -> str:
    """How training decodes, "whole" or "roi": ``requested`` unless it is "auto", which picks the faster.

    - CPU-only mode: "roi" (libjpeg-turbo decodes only the crop window's rows and columns: less work).
    - A GPU with a hardware JPEG engine (``jpeg_engine`` True): "whole". nvImageCodec does not give the
      engine a crop window with fancy chroma upsampling; it decodes one where the Huffman stage runs on the
      CPU threads, which left an H200's engine idle at a quarter of the whole-image speed.
    - A GPU without one (``jpeg_engine`` False): "roi", with the CUDA decoder's own chroma upsampling (with
      fancy upsampling a window is not decoded on the GPU at all).
    - Unknown (``jpeg_engine`` None: NVML unreadable): "whole", the choice whose pixels are Pillow's.
    """
    if requested not in TRAIN_DECODES:
        raise ValueError(f"train_decode={requested!r}: use one of {', '.join(map(repr, TRAIN_DECODES))}")
    if requested != "auto":
        return requested
    if not gpu:
        return "roi"
    return "roi" if jpeg_engine is False else "whole"


def has_jpeg_engine(nvml: Any, handle: Any) -> bool:
    """Whether the GPU has a hardware JPEG decoder: NVML answers "Not Supported" when it has none.
    Any other NVML error is raised (the answer is then unknown)."""
    try:
        nvml.nvmlDeviceGetJpgUtilization(handle)
    except Exception as e:
        if "not supported" in str(e).lower():
            return False
        raise
    return True


@functools.cache
def jpeg_engine(device_id: int) -> bool | None:
    """Whether CUDA device ``device_id`` has a hardware JPEG engine, as `dali-fast doctor` reads it (NVML);
    None when NVML cannot tell. Read once per device and process."""
    try:
        import pynvml as nvml  # the nvidia-ml-py package

        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no NVML: unknown
        log.debug("NVML unreadable (%s): the JPEG engine is unknown", e)
        return None
    try:
        return has_jpeg_engine(nvml, nvml_handle(nvml, device_id))
    except Exception as e:  # noqa: BLE001 - unknown, not absent
        log.debug("NVML could not read the JPEG engine of device %d (%s)", device_id, e)
        return None
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
