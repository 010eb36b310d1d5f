"""How DALI decodes training images on this machine: the whole image (on a GPU's hardware JPEG engine) or
only the crop window, chosen by whether the GPU has the engine (read through NVML, as `dali-fast doctor`
reads it, then asked of nvJPEG in a child process), whether a crop-window decode survives on this GPU
(`decode_probe`), and by what the user asks for; and the share of the work the engine takes. Imports
neither torch nor DALI, so `doctor --quick` stays light.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

from ..machine import nvml_handle

log = logging.getLogger(__name__)

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
    - A GPU with a hardware JPEG engine (``jpeg_engine`` True): "whole". With nvJPEG older than 13.2,
      nvImageCodec refuses a crop window with fancy chroma upsampling on both its GPU decoders (nvJPEG may
      get the window's one-pixel edge wrong) and leaves it to its CPU decoder, which left an H200's engine
      idle at a quarter of the whole-image speed.
    - A GPU without one (``jpeg_engine`` False): "roi", with the CUDA decoder's own chroma upsampling (with
      fancy upsampling the window would go to the CPU decoder, as above); `decide_train_decode` probes
      such a GPU first.
    - Unknown (``jpeg_engine`` None: NVML unreadable): "whole", the choice whose pixels are Pillow's.
    """
    if requested not in TRAIN_DECODES:
        raise ValueError(f"train_decode={requested!r}: use one of {', '.join(map(repr, TRAIN_DECODES))}")
    if requested != "auto":
        return requested
    if not gpu:
        return "roi"
    return "roi" if jpeg_engine is False else "whole"


def decide_train_decode(gpu: bool, device_id: int | None, requested: str = "auto") -> str:
    """How a loader on this device trains: `choose_train_decode` with NVML's answer, made safe, and logged.

    Where the choice would be the crop window on a GPU (no engine seen by NVML, or "roi" asked for), the
    GPU is first probed in a child process (`decode_probe.probe_once`): if nvJPEG builds its hardware
    backend there (what nvImageCodec checks), "auto" decodes whole images on it; if the crop-window decode
    crashed or failed in the child, "auto" decodes whole images and says why in one warning line, and an
    explicit "roi" is kept with that warning (the process may crash as the child did).
    """
    if not gpu:
        choice = choose_train_decode(False, None, requested)
        log.info("training decodes %s on the CPU (%s)", _WORDS[choice], _asked(requested))
        return choice
    engine = jpeg_engine(device_id or 0) if requested == "auto" else None
    choice = choose_train_decode(True, engine, requested)
    why = {True: "NVML sees a JPEG engine", False: "NVML sees no JPEG engine", None: "NVML cannot tell"}[engine]
    if requested != "auto":
        why = "NVML not asked"
    if choice == "roi":
        from .decode_probe import probe_once

        found = probe_once(device_id or 0)
        if requested == "auto" and found.hw_backend:
            choice, why = "whole", "nvJPEG builds its hardware backend, though NVML sees no JPEG engine"
        elif not found.crop_ok:
            line = (
                f"the crop-window decode {found.crop_window} in a probe on CUDA device {device_id or 0} "
                "(NVIDIA/nvImageCodec#55 in nvImageCodec 0.9.0)"
            )
            if requested == "auto":
                log.warning("%s: training decodes whole images instead", line)
                return "whole"
            log.warning("%s; %s, so training decodes crop windows anyway", line, _asked(requested))
    log.info("training decodes %s on CUDA device %s (%s; %s)", _WORDS[choice], device_id, why, _asked(requested))
    return choice


_WORDS = {"whole": "whole images", "roi": "the crop window only"}


def _asked(requested: str) -> str:
    return "chosen automatically" if requested == "auto" else f"train_decode={requested!r} asked for"


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
