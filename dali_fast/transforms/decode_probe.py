"""The GPU's JPEG decoders probed in a child process: nvJPEG's hardware backend (what nvImageCodec checks
before it builds its hardware decoder) and one crop-window batch on `mixed`, whose crash ends the child only.

nvImageCodec 0.9.0, which DALI 2.4.0 pins, crashes decoding crop windows on the GPU on some GPUs (a
segfault on H100 and B200, error 8 on A100: NVIDIA/nvImageCodec#55). A crash takes the whole process
down, so the training process never tries it first: `probe_decoders` runs ``python -m
dali_fast.transforms.decode_probe DEVICE``, which prints one JSON line per finding as it goes (the ones
before a crash reach the parent), and reads the child's exit status. Nothing here imports DALI or torch
in the calling process.

nvImageCodec registers its hardware JPEG decoder when ``nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE)`` succeeds
on the device, and asks ``nvjpegGetHardwareDecoderInfo`` how many engines and cores it has (its nvjpeg
extension's ``isPlatformSupported``); the child asks the same library the same questions.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROBE_SECONDS = 60.0  # the child imports DALI and starts CUDA (a few seconds), then decodes 3 small batches
PROBE_BATCH = 8
NVJPEG_BACKEND_HARDWARE = 3  # nvjpegBackend_t
CUDA_ERROR = "no CUDA context"


@dataclass
class DecoderProbe:
    """What the child found on CUDA device ``device``.

    ``crop_window`` is "ok", or what went wrong: "crashed (signal 11)", "failed (exit 3): <why>",
    "timed out after 60 s". ``hw_backend`` is nvJPEG's answer to a hardware-backend handle (None: not
    asked, as on the CPU); ``hw_engines`` and ``hw_cores`` its count of JPEG engines and their cores.
    """

    device: str
    crop_window: str = "not tried"
    nvjpeg: str | None = None
    hw_backend: bool | None = None
    hw_status: int | None = None
    hw_engines: int | None = None
    hw_cores: int | None = None
    rc: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def crop_ok(self) -> bool:
        return self.crop_window == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "crop_ok": self.crop_ok}


def nvjpeg_library() -> str | None:
    """The libnvjpeg nvImageCodec loads: its nvjpeg extension's run path looks in the pip package
    ``nvidia/nvjpeg/lib`` beside it first, then ``/usr/local/cuda/lib64``; None when neither has one."""
    folders = []
    spec = importlib.util.find_spec("nvidia.nvimgcodec")
    if spec is not None and spec.submodule_search_locations:
        folders.append(Path(list(spec.submodule_search_locations)[0]).parent / "nvjpeg" / "lib")
    folders.append(Path("/usr/local/cuda/lib64"))
    for folder in folders:
        found = sorted(folder.glob("libnvjpeg.so.*")) if folder.is_dir() else []
        if found:
            return str(found[-1])
    return None


def nvjpeg_version(path: str | None = None) -> str | None:
    """nvJPEG's version ("12.4.0") as the library reports it (no GPU needed); None without the library."""
    path = path or nvjpeg_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        parts = []
        for kind in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.nvjpegGetProperty(kind, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    except (OSError, AttributeError):
        return None


def _say(**found: Any) -> None:
    print(json.dumps(found), flush=True)


def _cuda_context(device: int) -> str | None:
    """Make CUDA device ``device``'s primary context current on this thread (the driver API, as the CUDA
    runtime inside nvJPEG then finds it); None when done, else why not."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"{CUDA_ERROR} (libcuda: {e})"
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for call, args in (
        ("cuInit", (0,)),
        ("cuDeviceGet", (ctypes.byref(dev), device)),
        ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
        ("cuCtxSetCurrent", (ctx,)),
    ):
        rc = getattr(cuda, call)(*args)
        if rc != 0:
            return f"{CUDA_ERROR} ({call} returned {rc})"
    return None


def _hardware_backend(device: int) -> None:
    """Ask nvJPEG for a hardware-backend handle on ``device`` and its engines, as nvImageCodec does."""
    path = nvjpeg_library()
    if path is None:
        _say(note="no libnvjpeg found beside nvImageCodec or in /usr/local/cuda/lib64")
        return
    why = _cuda_context(device)
    if why is not None:
        _say(note=why)
        return
    lib = ctypes.CDLL(path)
    handle = ctypes.c_void_p()
    status = lib.nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(handle))
    found: dict[str, Any] = {"hw_backend": status == 0, "hw_status": status}
    if status == 0:
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        if hasattr(lib, "nvjpegGetHardwareDecoderInfo"):
            if lib.nvjpegGetHardwareDecoderInfo(handle, ctypes.byref(engines), ctypes.byref(cores)) == 0:
                found.update(hw_engines=engines.value, hw_cores=cores.value)
        lib.nvjpegDestroy(handle)
    _say(**found)


def _test_jpegs() -> list[Any]:
    """Photo-like baseline JPEGs of a few shapes and chroma layouts (4:2:0, 4:4:4, gray), made with Pillow."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for k, (w, h, sub, mode) in enumerate(
        [(640, 480, 2, "RGB"), (500, 375, 0, "RGB"), (375, 500, 2, "RGB"), (320, 240, 2, "L")] * 2
    ):
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        px = np.stack([x * 255 / w, y * 255 / h, (x + y + 40 * k) % 255], -1) + rng.normal(0, 12, (h, w, 3))
        im = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8)).convert(mode)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90, **({"subsampling": sub} if mode == "RGB" else {}))
        out.append(np.frombuffer(buf.getvalue(), np.uint8))
    return out


def _crop_window(device: int | None) -> None:
    """Decode three batches of crop windows with `decoders.image_random_crop` as training would (`mixed`
    with the GPU decoder's arguments of `transforms.dali`, or "cpu" for ``device`` None), and check them."""
    from nvidia.dali import fn, pipeline_def, types

    from .mixed_decoder import MixedDecoder
    from .recipe import Recipe

    datas = _test_jpegs()
    recipe = Recipe()
    extra = MixedDecoder(threads=2).arguments(roi=True) if device is not None else {}

    @pipeline_def(batch_size=len(datas), num_threads=2, device_id=device, seed=1, prefetch_queue_depth=1)
    def pipe():  # type: ignore[no-untyped-def]
        jpegs = fn.external_source(source=lambda: datas, batch=True)
        return fn.decoders.image_random_crop(
            jpegs,
            device="cpu" if device is None else "mixed",
            output_type=types.RGB,
            random_area=list(recipe.scale),
            random_aspect_ratio=list(recipe.ratio),
            num_attempts=10,
            **extra,
        )

    p = pipe()
    p.build()
    for _ in range(3):
        (out,) = p.run()
        if device is not None:
            out = out.as_cpu()
        shapes = [tuple(out.at(i).shape) for i in range(len(datas))]
        bad = [s for s in shapes if len(s) != 3 or s[2] != 3 or min(s[:2]) < 1]
        if bad:
            raise RuntimeError(f"crop windows of shape {bad[0]} (expected height x width x 3)")
    _say(crop_window="ok", images=3 * len(datas))


def main(argv: list[str] | None = None) -> int:
    """The child: ``DEVICE`` is a CUDA device index, or "cpu" (the same steps on DALI's CPU decoder, for
    tests without a GPU). Exit 0 when the crop windows decoded, 3 when they failed with an error."""
    args = sys.argv[1:] if argv is None else argv
    device = None if args[0] == "cpu" else int(args[0])
    _say(nvjpeg=nvjpeg_version())
    if device is not None:
        _hardware_backend(device)
    try:
        _crop_window(device)
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        text = " ".join(str(e).split()) or type(e).__name__
        _say(crop_window_error=text[:300])
        return 3
    return 0


def _describe_exit(rc: int, error: str | None) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"crashed ({signal.Signals(-rc).name}, rc {rc})"
        return f"crashed (rc {rc})"
    return f"failed (rc {rc}){f': {error}' if error else ''}"


def probe_decoders(
    device: int | str, *, timeout: float = PROBE_SECONDS, command: list[str] | None = None
) -> DecoderProbe:
    """Probe CUDA device ``device`` ("cpu": DALI's CPU decoder) in a child process; ``command`` replaces the
    child's command line (tests give one that dies). Never raises for what happens in the child."""
    cmd = command or [sys.executable, "-m", "dali_fast.transforms.decode_probe", str(device)]
    result = DecoderProbe(device=str(device))
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        stdout, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        stdout, rc = out.decode() if isinstance(out, bytes) else out, None
    except OSError as e:
        result.crop_window = f"failed (the child did not start: {e})"
        return result
    result.seconds = round(time.monotonic() - t0, 2)
    error = None
    for line in stdout.splitlines():
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if not isinstance(found, dict):
            continue
        for key in ("nvjpeg", "hw_backend", "hw_status", "hw_engines", "hw_cores"):
            if key in found:
                setattr(result, key, found[key])
        if "note" in found:
            result.notes.append(str(found["note"]))
        if found.get("crop_window") == "ok":
            result.crop_window = "ok"
        error = found.get("crop_window_error", error)
    result.rc = rc
    if rc is None:
        result.crop_window = f"timed out after {timeout:.0f} s"
    elif rc != 0 or result.crop_window != "ok":
        result.crop_window = _describe_exit(rc, error) if rc != 0 else "failed (no crop window reported)"
    return result


@functools.cache
def probe_once(device: int) -> DecoderProbe:
    """`probe_decoders` of CUDA device ``device``, run once per process (the loader asks it at most once)."""
    found = probe_decoders(device)
    log.info(
        "decoder probe of CUDA device %d: crop-window decode %s; nvJPEG %s, hardware backend %s (%.1f s)",
        device,
        found.crop_window,
        found.nvjpeg,
        found.hw_backend,
        found.seconds,
    )
    return found


if __name__ == "__main__":
    sys.exit(main())
