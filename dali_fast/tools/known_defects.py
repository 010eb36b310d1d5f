"""GPU JPEG-decode defects known in the libraries DALI decodes with, which releases and GPUs they hit, and what
dali_fast does about each; `defects_for` picks the ones that apply to a machine's readings (`doctor`).

A release range names the first affected version and the first fixed one (None: no fixed release known).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Defect:
    """One known defect: where it was reported, in which library's releases, on which GPUs, what goes
    wrong, and what dali_fast does about it."""

    ref: str
    library: str  # "nvImageCodec" or "nvJPEG": the name `doctor` reads the version under
    first: tuple[int, ...]
    fixed: tuple[int, ...] | None
    gpus: str  # in words
    compute_capabilities: tuple[int, ...]  # the major versions it was seen on; () for any GPU
    what: str
    dali_fast: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFECTS = (
    Defect(
        ref="NVIDIA/nvImageCodec#55",
        library="nvImageCodec",
        first=(0, 9, 0),  # 0.8.0 worked; DALI 2.4.0 pins 0.9.0
        fixed=None,
        gpus="H100 and B200 (segfault), A100 (error 8)",
        compute_capabilities=(),
        what="crop-window decoding on the GPU (decoders.image_random_crop on `mixed`) crashes or fails",
        dali_fast=(
            "probes one crop-window batch in a child process before training would use crop windows on a GPU; "
            "'auto' then decodes whole images, and doctor exits 1 when the probe fails on such a GPU"
        ),
    ),
    Defect(
        ref="pytorch/vision#9606, meta-pytorch/torchcodec#1634",
        library="nvJPEG",
        first=(0,),
        fixed=None,
        gpus="H100 (134 of 200 iterations corrupted; none on A100)",
        compute_capabilities=(9,),
        what=(
            "the hardware batched decode writes its output before earlier work on the caller's stream has "
            "finished: silently corrupted pixels"
        ),
        dali_fast=(
            "nothing in the loader (nvImageCodec orders the decode after the pipeline's stream by an event, not a "
            "host barrier, so the race is not ruled out); gpu_check compares GPU and CPU pixels over 1,024+ "
            "images and names the worst"
        ),
    ),
    Defect(
        ref="MrNeRF/LichtFeld-Studio#1924, #616",
        library="nvJPEG",
        first=(0,),
        fixed=None,
        gpus="Blackwell (RTX 50 series)",
        compute_capabilities=(10, 12),
        what="the JPEG engine reports images it skipped as decoded: black training images",
        dali_fast=("nothing in the loader; gpu_check counts GPU images that come out flat where the CPU's are not"),
    ),
)


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """ "0.9.0" -> (0, 9, 0); None for a version that is not numbers."""
    try:
        return tuple(int(x) for x in str(text).split(".")) if text else None
    except ValueError:
        return None


def defects_for(libs: dict[str, str], gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The known defects whose library release (``libs``: name -> version, as `doctor` reads them) is in the
    affected range and, for those seen on some GPU generations only, whose generation one of ``gpus`` is
    (their ``compute_capability``, "9.0"; a GPU whose generation NVML did not give counts); none without a
    GPU. Each comes as its `Defect` fields plus ``version`` (the library's here) and ``gpus_here`` (the
    names of the GPUs it may hit)."""
    out: list[dict[str, Any]] = []
    if not gpus:
        return out
    for d in DEFECTS:
        version = version_tuple(libs.get(d.library))
        if version is None or version < d.first or (d.fixed is not None and version >= d.fixed):
            continue
        hit = [g for g in gpus if not d.compute_capabilities or _major(g) in (*d.compute_capabilities, None)]
        if not hit:
            continue
        out.append({**d.to_dict(), "version": libs[d.library], "gpus_here": [g.get("name") for g in hit]})
    return out


def _major(gpu: dict[str, Any]) -> int | None:
    cc = version_tuple(gpu.get("compute_capability"))
    return cc[0] if cc else None
