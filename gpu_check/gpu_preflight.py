"""gpu_check's preflight: torch, nvidia.dali and nvidia.nvimgcodec must import and torch must see a CUDA GPU,
or the run stops here in one line (exit 1). Otherwise it prints the summary's header: the GPU count on the
first line, then what decides the GPU path's behaviour (GPU, torch and its CUDA, DALI, nvImageCodec,
nvJPEG, and the JPEG decoder TorchIterator's workers use).

    python gpu_check/gpu_preflight.py [--no-gpu-needed]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _version(module: str) -> str:
    """The module's version, or why it does not import (a one-line reason, raised as SystemExit)."""
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as e:  # noqa: BLE001 - any import failure stops the run, named
        text = " ".join(str(e).split()) or type(e).__name__
        raise SystemExit(f"{module} does not import ({type(e).__name__}: {text[:200]})") from None
    return str(getattr(mod, "__version__", "?"))


def header(gpu_needed: bool = True) -> list[str]:
    """The header lines, the GPU count first; a one-line SystemExit when the run cannot go on."""
    torch_version = _version("torch")
    import torch

    dali = _version("nvidia.dali")
    nvimgcodec = _version("nvidia.nvimgcodec")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_needed and n < 1:
        raise SystemExit(f"torch {torch_version} sees no CUDA device")
    from dali_fast.transforms.decode_probe import nvjpeg_library, nvjpeg_version

    gpu = f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU"
    nvjpeg = nvjpeg_version() or "not found"
    return [
        str(n),
        f"{gpu}; torch {torch_version} (CUDA {torch.version.cuda}); DALI {dali}; nvImageCodec {nvimgcodec}; "
        f"nvJPEG {nvjpeg} ({nvjpeg_library() or 'no library'}); TorchIterator decodes JPEGs with {jpeg_decoder()}",
    ]


def jpeg_decoder() -> str:
    """What TorchIterator's workers decode plain JPEGs with: simplejpeg (libjpeg-turbo), else Pillow."""
    from dali_fast.data.verify import simplejpeg_module

    simplejpeg = simplejpeg_module()
    if simplejpeg is not None:
        return f"simplejpeg {getattr(simplejpeg, '__version__', '?')} (libjpeg-turbo)"
    import PIL

    return f"Pillow {PIL.__version__} (simplejpeg missing)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        lines = header(gpu_needed="--no-gpu-needed" not in args)
    except SystemExit as e:
        print(e.code, flush=True)
        return 1
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
