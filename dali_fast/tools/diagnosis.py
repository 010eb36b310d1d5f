"""`diagnose`: the readings of `doctor.probe` turned into report lines and at most one problem, the first that
stops the GPU path or would slow or crash training on it, with what to do. It reads nothing itself, so every
branch is checked with given readings."""

from __future__ import annotations

from dataclasses import dataclass

from ..transforms.decode_choice import TRAIN_DECODE_ENV, TRAIN_DECODES, choose_train_decode
from .doctor import TORCH_CUDA12_INDEX, Readings

# How training decodes on a GPU, in words (`choose_train_decode`'s answers).
TRAIN_DECODE_WORDS = {
    "whole": "whole images, cropped on the GPU",
    "roi": "the crop window only",
}


@dataclass
class Diagnosis:
    lines: list[str]
    problem: str | None  # one line; None when the GPU path works

    @property
    def ok(self) -> bool:
        return self.problem is None


def _report(r: Readings) -> list[str]:
    lines = [f"python      {r.python}"]
    if r.quick:
        lines.append("quick       NVML only: no CUDA context, no DALI pipeline")
    elif r.torch is None:
        lines.append(f"torch       not importable ({r.cuda_error})")
    else:
        build = f"CUDA {r.torch_cuda} build" if r.torch_cuda else "CPU-only build"
        usable = "CUDA usable" if r.cuda_available else f"CUDA not usable{f': {r.cuda_error}' if r.cuda_error else ''}"
        lines.append(f"torch       {r.torch} ({build}); {usable}")
    if r.nvml_error is not None:
        lines.append(f"driver      not found through NVML ({r.nvml_error})")
    else:
        cuda = f" (supports CUDA {r.driver_cuda})" if r.driver_cuda else ""
        lines.append(f"driver      {r.driver}{cuda}, {len(r.gpus)} GPU(s)")
        for g in r.gpus:
            engine = {True: "yes", False: "no", None: "unknown"}[g.get("jpeg_engine")]
            how = ""
            if r.train_decode in TRAIN_DECODES:
                asked = "" if r.train_decode == "auto" else f" ({TRAIN_DECODE_ENV}={r.train_decode})"
                choice = choose_train_decode(True, g.get("jpeg_engine"), r.train_decode)
                how = f"; training decodes {TRAIN_DECODE_WORDS[choice]}{asked}"
            lines.append(f"gpu {g['index']:<7} {g['name']}, {g['memory_gib']} GiB, hardware JPEG engine: {engine}{how}")
    if r.quick:
        return lines
    if r.dali is None:
        lines.append(f"DALI        not installed ({r.dali_error})")
    else:
        libs = ", ".join(f"{k} {v}" for k, v in r.dali_libs.items())
        lines.append(f"DALI        {r.dali}{f' ({libs})' if libs else ''}")
    for name, d in (("cpu", r.cpu_decode), ("gpu", r.gpu_decode)):
        if d is None:
            if name == "gpu":
                lines.append("decode gpu  not tried (no usable GPU or no DALI)")
            continue
        how = 'device="mixed"' if name == "gpu" else 'device="cpu"'
        if d["ok"]:
            lines.append(f"decode {name}  ok ({how}; mean difference {d['mean_diff']} levels from Pillow)")
        else:
            lines.append(f"decode {name}  FAILED ({how}): {d['error']}")
    h = r.hw_decoder
    if h is not None:
        if h.get("jpeg_engine") is False:
            lines.append("hw decoder  this GPU has no hardware JPEG engine: nvJPEG decodes on the CUDA cores")
        elif h.get("used"):
            rate = f", {h['images_per_s']:.0f} images/s of {h['megapixels']} MP" if h.get("images_per_s") else ""
            lines.append(
                f"hw decoder  used: JPEG engine utilization reached {h['peak_util']} % while DALI decoded{rate}"
            )
        elif h.get("jpeg_engine"):
            lines.append("hw decoder  present but stayed idle while DALI decoded (hw_decoder_load=1)")
        else:
            lines.append(f"hw decoder  unknown ({h.get('error', 'NVML could not read the JPEG engine')})")
    lines += _probe_lines(r)
    for d in r.known_defects:
        fixed = f"fixed in {'.'.join(map(str, d['fixed']))}" if d["fixed"] else "no fixed release known"
        lines.append(
            f"defect      {d['library']} {d['version']} ({d['ref']}; {fixed}): {d['what']}, seen on {d['gpus']}; "
            f"what dali_fast does: {d['dali_fast']}"
        )
    return lines


def _probe_lines(r: Readings) -> list[str]:
    p = r.decoder_probe
    if p is None:
        return []
    where = f"GPU {p['device']}" + (f" ({p['name']})" if p.get("name") else "")
    if p.get("hw_backend") is None:
        backend = "not asked" + (f" ({'; '.join(p['notes'])})" if p.get("notes") else "")
    elif p["hw_backend"]:
        backend = f"yes, {p.get('hw_engines')} engine(s) of {p.get('hw_cores')} cores"
    else:
        backend = f"no (status {p.get('hw_status')})"
    lines = [f"nvJPEG      {p.get('nvjpeg')} on {where}: hardware backend {backend} (what nvImageCodec checks)"]
    if p["crop_ok"]:
        lines.append('crop window ok: decoders.image_random_crop on device="mixed" decoded in a child process')
    else:
        lines.append(f'crop window {p["crop_window"].upper()} on device="mixed" in a child process')
    choice, _ = _training_decode(r)
    if choice is not None:
        lines.append(f"training    decodes {TRAIN_DECODE_WORDS[choice]} on {where}")
    return lines


def _training_decode(r: Readings) -> tuple[str | None, bool]:
    """(how training decodes on the probed GPU, whether it would decode crop windows there before the
    probe's verdict) as `decode_choice.decide_train_decode` decides, from the readings."""
    p = r.decoder_probe
    if p is None or r.train_decode not in TRAIN_DECODES:
        return None, False
    engine = (r.hw_decoder or {}).get("jpeg_engine") if r.train_decode == "auto" else None
    choice = choose_train_decode(True, engine, r.train_decode)
    if choice != "roi":
        return choice, False
    if r.train_decode == "auto" and (p.get("hw_backend") or not p["crop_ok"]):
        return "whole", True
    return "roi", True


def _problem(r: Readings) -> str | None:
    gpu_seen = r.nvml_error is None and bool(r.gpus)
    if r.train_decode not in TRAIN_DECODES:
        return f"{TRAIN_DECODE_ENV}={r.train_decode!r}: use 'auto', 'whole' or 'roi' (or unset it)"
    if r.quick:
        return _visibility_problem(r) if not gpu_seen else None
    if r.torch is None:
        return f"torch does not import ({r.cuda_error}); install the project: pip install ."
    if not gpu_seen and not r.cuda_available:
        return _visibility_problem(r)
    if not r.torch_cuda:
        return (
            f"torch {r.torch} is a CPU-only build but a GPU is present: "
            f"pip install torch --index-url {TORCH_CUDA12_INDEX}"
        )
    if not r.cuda_available:
        if r.driver_cuda and _older(r.driver_cuda, r.torch_cuda):
            return (
                f"the driver {r.driver} supports CUDA up to {r.driver_cuda} but torch was built for CUDA "
                f"{r.torch_cuda}: update the driver or install a torch build for CUDA {r.driver_cuda} or older"
            )
        return f"torch {r.torch} cannot use the GPU: {r.cuda_error or 'torch.cuda.is_available() is False'}"
    if r.dali is None:
        return f"NVIDIA DALI is not installed ({r.dali_error}): pip install nvidia-dali-cuda120"
    if r.gpu_decode is not None and not r.gpu_decode["ok"]:
        return f'DALI cannot decode a JPEG with device="mixed": {r.gpu_decode["error"]}'
    h = r.hw_decoder or {}
    if h.get("jpeg_engine") and h.get("used") is False:
        return (
            f"the hardware JPEG engine of GPU {h.get('device')} ({h.get('name')}) stayed idle while DALI decoded "
            "whole images with hw_decoder_load=1: training would decode on the CPU threads, at about a quarter of "
            "its speed; check that nvJPEG builds its hardware backend (doctor --json: decoder_probe) and that no "
            "MIG slice or container setting hides the engine"
        )
    return _crop_window_problem(r)


def _crop_window_problem(r: Readings) -> str | None:
    """The crop-window probe failed on a GPU where training would decode crop windows."""
    p = r.decoder_probe
    _, would_use = _training_decode(r)
    if p is None or p["crop_ok"] or not would_use or (r.train_decode == "auto" and p.get("hw_backend")):
        return None
    what = f"DALI's crop-window decode {p['crop_window']} on GPU {p['device']} ({p.get('name')})"
    version = r.dali_libs.get("nvImageCodec", "?")
    if r.train_decode == "roi":
        return f"{what} and {TRAIN_DECODE_ENV}=roi asks training to decode crop windows: unset it or set it to 'whole'"
    return (
        f"{what}, where training would decode crop windows (NVML sees no JPEG engine): the loader decodes whole "
        f"images instead, more slowly; nvImageCodec {version} has this defect (NVIDIA/nvImageCodec#55): use a "
        f"DALI whose nvImageCodec fixes it, or set {TRAIN_DECODE_ENV}=whole to accept whole images"
    )


def _visibility_problem(r: Readings) -> str:
    if r.nvml_error is not None:
        return (
            f"no NVIDIA GPU visible (NVML: {r.nvml_error}): on a GPU host install the NVIDIA driver; "
            "in Docker run with --gpus all (needs the NVIDIA Container Toolkit on the host)"
        )
    return "the NVIDIA driver reports no GPU: check CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES"


def _older(a: str, b: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    try:
        return parts(a) < parts(b)
    except ValueError:
        return False


def diagnose(r: Readings) -> Diagnosis:
    """Report lines for ``r`` and the first problem that stops the GPU path (None when it runs)."""
    return Diagnosis(_report(r), _problem(r))
