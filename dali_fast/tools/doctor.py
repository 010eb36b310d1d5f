"""`dali-fast doctor`: can this machine run the GPU path, and if not, the one thing to fix first.

`probe()` reads the machine (Python, torch and its CUDA build, the driver and GPUs through NVML,
DALI and the nvImageCodec and nvJPEG it decodes with, a real decode of an embedded JPEG on the CPU and
with ``device="mixed"``, the hardware JPEG engine's utilization while DALI decodes whole images, and
nvJPEG's hardware backend and a crop-window decode probed in a child process), and the known decode
defects of those releases (`known_defects`). `diagnosis.diagnose()` turns those readings into report
lines and at most one problem.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..machine import nvml_handle
from ..transforms.decode_choice import TRAIN_DECODE_ENV, has_jpeg_engine
from ..transforms.decode_probe import nvjpeg_version, probe_decoders
from .known_defects import defects_for

log = logging.getLogger(__name__)

TORCH_CUDA12_INDEX = "https://download.pytorch.org/whl/cu128"
DOCTOR_PROBE_SECONDS = 30.0  # the crop-window child: DALI's import, CUDA's start, three small batches

# A 64x48 baseline JPEG (gradient with white rows), so the decode check needs no file.
_TEST_JPEG_B64 = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoMDAsKCwsNDhIQDQ4RDgsLEBYQERMU"
    "FRUVDA8XGBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsNFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQU"
    "FBQUFBQUFBT/wAARCAAwAEADASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUF"
    "BAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVW"
    "V1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi"
    "4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAEC"
    "AxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVm"
    "Z2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq"
    "8vP09fb3+Pn6/9oADAMBAAIRAxEAPwD4otP2kPja2M/GDx+fr4nvv/jtbVp+0T8aGxn4t+PD9fEt7/8AHa6G0+P/AMYmxn4reOD9"
    "fEd5/wDHK2rT47/F1sZ+KXjU/XxDef8AxysIVkcuAzKLt1OftP2gfjG2M/Ffxyfr4jvP/jlbdp8efi82M/FPxsfr4ivP/jldBafG"
    "/wCLDYz8TfGZ+uv3f/xytu0+M/xTbGfiT4wP1166/wDjldsKqP0XAY6Lt7kX/Xoc9afHH4stjd8TvGZ+viC7/wDjlbdp8afio2M/"
    "Erxgfrr11/8AHK6C0+L/AMTmxn4ieLT9dcuv/jlbdp8WPiS2M/EDxUfrrVz/APF12QqLsj9EwGKi7fuYP+v8Jz1p8Yfie2M/EXxa"
    "frrl1/8AHK27T4s/EpsZ+IPis/XWrn/4uugtPih8RGxnx34nP11i4/8Ai627T4keP2xnxv4kP11a4/8Ai67ITXZf18j9FwFaLt/s"
    "1J/P/wC5ngFp8bfiu2M/Ezxkfrr93/8AHK2rT4y/FJsZ+JHi8/XXbr/45XQ2nxc+JjYz8QvFh+ut3P8A8XW1afFT4jtjPj7xSfrr"
    "Nz/8XXwUK67v+vmf5u4DN4u37yT+X/2xz9p8Xvia2M/EPxYfrrd1/wDF1t2nxW+JDYz4/wDFJ+utXP8A8XXQWnxM+ITYz458TH66"
    "vcf/ABdbdp8RPHrYz418Rn66tcf/ABddkKy7n6JgMzi7a3OetPid8Q2xnx14nP11i4/+LrbtPiN4+bG7xt4kP11a4/8Ai66C08ee"
    "OGxnxh4gP11Sf/4utu08aeM2xnxZrp+upTf/ABVdkKqP0XAY+Lt7qf8AXoc9aePvHLYz4x8Qn66pP/8AF1t2njbxo2M+LdeP11Kb"
    "/wCKroLTxb4ubGfE+tH66hN/8VW3aeJfFLYz4j1g/W+l/wDiq7IVUfouAxcXb91B/wBf4TwC0+JXxBbGfHHiU/XV7j/4utu0+IXj"
    "xsZ8aeIj9dVn/wDi66C08c+Nmxnxdr5+upz/APxVbdp4x8YtjPirXD9dRm/+Kr4KGIX87/r5n+buAzyLt/tE38v/ALc5608deN2x"
    "nxh4gP11Of8A+KrbtPGfjJsZ8V66frqU3/xVdBaeKfFjYz4m1k/W/l/+KrbtPEPidsZ8Q6sfrfS//FV2wxC/mf8AXzP0TAZxF2/e"
    "yfy/+2OetPFfi1sZ8Ta0frqE3/xVbdp4j8UNjPiLVz9b6X/4qugtNZ8RNjOu6ofreSf41t2mo662M6xqJ+t1J/jXZCuu7/r5n6Lg"
    "M0i7e9f+vU5+01vxG2N2vaofreSf/FVtWmp682M6zqJ+t1J/jXQ2lzrDYzql8frcP/jW1aNqbYzf3Z+s7f412QrLufomAzCLt7qf"
    "9eh//9k="
)
TEST_JPEG = base64.b64decode("".join(_TEST_JPEG_B64))


@dataclass
class Readings:
    """What `probe` found. ``None`` means not read (not applicable, or the reading failed)."""

    python: str = ""
    torch: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built for; None: a CPU-only build
    cuda_available: bool = False
    cuda_error: str | None = None
    nvml_error: str | None = None
    driver: str | None = None
    driver_cuda: str | None = None  # the newest CUDA version the driver supports
    gpus: list[dict[str, Any]] = field(default_factory=list)  # name, memory_gib, jpeg_engine, compute_capability
    dali: str | None = None
    dali_error: str | None = None
    dali_libs: dict[str, str] = field(default_factory=dict)
    cpu_decode: dict[str, Any] | None = None  # ok, mean_diff, error
    gpu_decode: dict[str, Any] | None = None
    hw_decoder: dict[str, Any] | None = None  # jpeg_engine, peak_util, used; device, name (the CUDA device)
    decoder_probe: dict[str, Any] | None = None  # `decode_probe.DecoderProbe` of the CUDA device, with its name
    known_defects: list[dict[str, Any]] = field(default_factory=list)  # `known_defects.defects_for`
    decoder_preallocation: dict[str, int] | None = None  # what one GPU pipeline's decoder preallocates
    quick: bool = False  # NVML only: no CUDA context, no DALI
    train_decode: str = "auto"  # how training is asked to decode (DALI_FAST_TRAIN_DECODE), see decode_choice

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cuda_version(v: int) -> str:
    """12040 → '12.4' (the encoding CUDA and NVML use)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def probe_torch(r: Readings) -> None:
    try:
        import torch
    except ImportError as e:
        r.cuda_error = f"torch does not import: {e}"
        return
    r.torch, r.torch_cuda = torch.__version__, torch.version.cuda
    try:
        r.cuda_available = bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
        if not r.cuda_available and r.torch_cuda:
            torch.cuda.init()  # raises with the driver's reason
    except Exception as e:  # noqa: BLE001 - the reason is the reading
        r.cuda_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def probe_nvml(r: Readings, nvml: Any = None) -> None:
    """Driver version, its CUDA version and each GPU (name, memory, hardware JPEG engine) via NVML."""
    try:
        if nvml is None:
            import pynvml as nvml  # provided by the nvidia-ml-py package
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver, no library, no permission: all "no NVML"
        r.nvml_error = str(e) or type(e).__name__
        return
    try:
        r.driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            r.driver_cuda = _cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
        except Exception:  # noqa: BLE001 - an old driver without this query
            r.driver_cuda = None
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            gpu: dict[str, Any] = {
                "index": i,
                "name": _text(nvml.nvmlDeviceGetName(h)),
                "memory_gib": round(int(nvml.nvmlDeviceGetMemoryInfo(h).total) / 2**30, 1),
            }
            try:
                gpu["jpeg_engine"] = has_jpeg_engine(nvml, h)
            except Exception:  # noqa: BLE001 - unknown, not absent
                gpu["jpeg_engine"] = None
            try:
                gpu["compute_capability"] = ".".join(map(str, nvml.nvmlDeviceGetCudaComputeCapability(h)))
            except Exception:  # noqa: BLE001 - an old driver or library: the generation is not known
                gpu["compute_capability"] = None
            r.gpus.append(gpu)
    except Exception as e:  # noqa: BLE001
        r.nvml_error = str(e) or type(e).__name__
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            log.debug("nvmlShutdown failed", exc_info=True)


def probe_dali(r: Readings) -> None:
    try:
        import nvidia.dali
        import nvidia.dali.backend as backend
    except ImportError as e:
        r.dali_error = str(e)
        return
    r.dali = nvidia.dali.__version__
    try:
        v = int(backend.GetNvimgcodecVersion())
        if v > 0:
            r.dali_libs["nvImageCodec"] = f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"
        cuda = int(backend.GetCudaVersion())
        if cuda > 0:
            r.dali_libs["CUDA"] = _cuda_version(cuda)
    except Exception:  # noqa: BLE001 - versions are extra information
        log.debug("DALI library versions unreadable", exc_info=True)
    nvjpeg = nvjpeg_version()  # the library nvImageCodec loads, read without a GPU
    if nvjpeg is not None:
        r.dali_libs["nvJPEG"] = nvjpeg


def _reference() -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(TEST_JPEG)).convert("RGB"))


def _decode_pipeline(data: bytes, device: str, device_id: int | None, batch: int, hw_load: float) -> Any:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=2, device_id=device_id, prefetch_queue_depth=1)
    def pipe() -> Any:
        jpegs = fn.external_source(source=lambda: [np.frombuffer(data, np.uint8)] * batch, batch=True, name="jpegs")
        # jpeg_fancy_upsampling: the mixed decoder upsamples chroma as libjpeg-turbo (and so Pillow) does;
        # its default differs by a few levels, which is not a fault.
        kw = {"hw_decoder_load": hw_load, "jpeg_fancy_upsampling": True} if device == "mixed" else {}
        return fn.decoders.image(jpegs, device=device, output_type=types.RGB, **kw)

    p = pipe()
    p.build()
    return p


def decode_check(device: str = "cpu", device_id: int | None = None, data: bytes = TEST_JPEG) -> dict[str, Any]:
    """Decode ``data`` with DALI (``device`` "cpu" or "mixed") and compare it with Pillow's decode."""
    from ..loaders.dali_pipeline import shutdown_pipeline

    p = None
    try:
        p = _decode_pipeline(data, device, device_id, 1, 0.65)
        (out,) = p.run()
        if device == "mixed":
            out = out.as_cpu()
        img = np.array(out.at(0))
        ref = _reference()
        if img.shape != ref.shape:
            return {"ok": False, "error": f"decoded shape {img.shape}, expected {ref.shape}"}
        diff = float(np.abs(img.astype(np.int16) - ref.astype(np.int16)).mean())
        return {"ok": diff <= 2.0, "mean_diff": round(diff, 2), "error": None if diff <= 2.0 else "pixels differ"}
    except Exception as e:  # noqa: BLE001 - the failure is the reading
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"ok": False, "error": first}
    finally:
        if p is not None:
            shutdown_pipeline(p)


# The JPEG engine check decodes images this large (1.9 MP each), in batches of HW_CHECK_BATCH: NVML averages
# the engine's utilization over a sampling window of about 0.17-1 s, so thumbnails decode in a sliver of it
# and it can read 0 % although the engine did the work.
HW_CHECK_SIZE = (1600, 1200)
HW_CHECK_BATCH = 32
HW_CHECK_SECONDS = 2.5  # over twice the longest sampling window


def large_test_jpeg(width: int = HW_CHECK_SIZE[0], height: int = HW_CHECK_SIZE[1]) -> bytes:
    """A baseline 4:2:0 JPEG of ``width`` x ``height`` (gradients and noise, like a photo's entropy), made
    with Pillow: what the hardware decoder takes, large enough to keep it busy."""
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    px = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=90, subsampling=2, progressive=False)
    return buf.getvalue()


def hw_decoder_check(
    device_id: int, seconds: float | None = None, nvml: Any = None, batch: int = HW_CHECK_BATCH
) -> dict[str, Any]:
    """Decode batches of large JPEGs (`large_test_jpeg`) with ``hw_decoder_load=1`` for ``seconds`` (default
    `HW_CHECK_SECONDS`) and read NVML's JPEG-engine utilization meanwhile; returns its peak, whether it was
    used, and the decode rate."""
    seconds = HW_CHECK_SECONDS if seconds is None else seconds
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        h = nvml_handle(nvml, device_id)  # the CUDA device DALI decodes on, found by UUID
        if not has_jpeg_engine(nvml, h):
            return {"jpeg_engine": False, "peak_util": None, "used": False}
        from ..loaders.dali_pipeline import shutdown_pipeline

        data = large_test_jpeg()
        p = _decode_pipeline(data, "mixed", device_id, batch, 1.0)
        peak, images, window_us = 0, 0, None
        try:
            p.run()  # the first batch sets the decoder up: not timed
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                p.run()
                images += batch
                util = nvml.nvmlDeviceGetJpgUtilization(h)
                if isinstance(util, list | tuple):
                    util, window_us = util[0], util[1]
                peak = max(peak, int(util))
            elapsed = time.monotonic() - t0
        finally:
            shutdown_pipeline(p)
        return {
            "jpeg_engine": True,
            "peak_util": peak,
            "used": peak > 0,
            "megapixels": round(HW_CHECK_SIZE[0] * HW_CHECK_SIZE[1] / 1e6, 2),
            "images_per_s": round(images / elapsed, 1),
            "seconds": round(elapsed, 2),
            "nvml_window_us": window_us,
        }
    except Exception as e:  # noqa: BLE001
        return {"jpeg_engine": None, "peak_util": None, "used": None, "error": str(e).splitlines()[0]}


def probe(quick: bool = False, nvml: Any = None) -> Readings:
    """Read this machine.

    ``quick`` reads NVML only (driver and GPUs): it starts no CUDA context and builds no DALI
    pipeline, so a health check during training takes no GPU memory and skews no memory reading.
    """
    r = Readings(python=f"{platform.python_version()} ({sys.platform} {platform.machine()})", quick=quick)
    r.train_decode = os.environ.get(TRAIN_DECODE_ENV) or "auto"
    probe_nvml(r, nvml=nvml)
    if quick:
        return r
    probe_torch(r)
    probe_dali(r)
    from ..transforms.mixed_decoder import decoder_preallocation, default_num_threads

    r.decoder_preallocation = decoder_preallocation(default_num_threads(gpu=True))
    if r.dali:
        r.cpu_decode = decode_check("cpu", None)
        if r.cuda_available:
            from ..machine import local_device_index

            device = local_device_index()
            name = _device_name(device)
            r.gpu_decode = decode_check("mixed", device)
            if not quick and r.gpu_decode["ok"] and r.nvml_error is None:
                r.hw_decoder = {**hw_decoder_check(device), "device": device, "name": name}
            r.decoder_probe = {**probe_decoders(device, timeout=DOCTOR_PROBE_SECONDS).to_dict(), "name": name}
    r.known_defects = defects_for(r.dali_libs, r.gpus)
    return r


def _device_name(device: int) -> str | None:
    try:
        import torch

        return str(torch.cuda.get_device_name(device))
    except Exception:  # noqa: BLE001 - the name only labels the lines
        return None
