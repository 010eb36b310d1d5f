"""`diagnose`: given readings of a machine, the report lines and the one problem to fix first, with what to do."""

from __future__ import annotations

import pytest

from dali_fast.tools.diagnosis import diagnose
from dali_fast.tools.doctor import TORCH_CUDA12_INDEX, Readings


def gpu_host(**changes) -> Readings:
    """Readings of a healthy GPU host; tests change what they need."""
    r = Readings(
        python="3.12.3 (linux x86_64)",
        torch="2.13.0+cu128",
        torch_cuda="12.8",
        cuda_available=True,
        driver="570.86.15",
        driver_cuda="12.8",
        gpus=[{"index": 0, "name": "NVIDIA H200", "memory_gib": 139.8, "jpeg_engine": True}],
        dali="2.4.0",
        dali_libs={"nvImageCodec": "0.9.0", "CUDA": "12.8"},
        cpu_decode={"ok": True, "mean_diff": 0.0, "error": None},
        gpu_decode={"ok": True, "mean_diff": 0.4, "error": None},
        hw_decoder={"jpeg_engine": True, "peak_util": 37, "used": True},
    )
    for k, v in changes.items():
        setattr(r, k, v)
    return r


def test_healthy_gpu_host():
    d = diagnose(gpu_host())
    assert d.ok and d.problem is None
    text = "\n".join(d.lines)
    assert "torch       2.13.0+cu128 (CUDA 12.8 build); CUDA usable" in text
    assert "driver      570.86.15 (supports CUDA 12.8), 1 GPU(s)" in text
    assert "gpu 0       NVIDIA H200, 139.8 GiB, hardware JPEG engine: yes" in text
    assert 'decode gpu  ok (device="mixed"; mean difference 0.4 levels from Pillow)' in text
    assert "hw decoder  used: JPEG engine utilization reached 37 %" in text


@pytest.mark.parametrize(
    ("hw", "line"),
    [
        ({"jpeg_engine": False, "peak_util": None, "used": False}, "has no hardware JPEG engine"),
        ({"jpeg_engine": None, "peak_util": None, "used": None, "error": "NVML busy"}, "unknown (NVML busy)"),
    ],
)
def test_hardware_decoder_lines_without_an_engine_do_not_fail_the_check(hw, line):
    d = diagnose(gpu_host(hw_decoder=hw, gpus=[{"index": 0, "name": "NVIDIA A10", "memory_gib": 22.0}]))
    assert d.ok and any(line in x for x in d.lines)


def test_an_engine_idle_on_whole_images_fails_the_check():
    hw = {"jpeg_engine": True, "peak_util": 0, "used": False, "device": 1, "name": "NVIDIA H100 80GB HBM3"}
    d = diagnose(gpu_host(hw_decoder=hw))
    assert "hw decoder  present but stayed idle while DALI decoded (hw_decoder_load=1)" in d.lines
    assert d.problem.startswith(
        "the hardware JPEG engine of GPU 1 (NVIDIA H100 80GB HBM3) stayed idle while DALI decoded whole images"
    )


def _probe(crop_window="ok", hw_backend=False, **more):
    return {
        "device": "0",
        "name": "NVIDIA L4",
        "crop_window": crop_window,
        "crop_ok": crop_window == "ok",
        "nvjpeg": "12.4.0",
        "hw_backend": hw_backend,
        "hw_status": 0 if hw_backend else 6,
        "hw_engines": 1 if hw_backend else None,
        "hw_cores": 5 if hw_backend else None,
        "notes": [],
        **more,
    }


NO_ENGINE = {"jpeg_engine": False, "peak_util": None, "used": False}


def test_a_crop_window_probe_that_crashed_fails_the_check_where_training_would_use_it():
    crashed = _probe("crashed (SIGSEGV, rc -11)")
    d = diagnose(gpu_host(hw_decoder=NO_ENGINE, decoder_probe=crashed))
    assert d.problem == (
        "DALI's crop-window decode crashed (SIGSEGV, rc -11) on GPU 0 (NVIDIA L4), where training would decode crop "
        "windows (NVML sees no JPEG engine): the loader decodes whole images instead, more slowly; nvImageCodec 0.9.0 "
        "has this defect (NVIDIA/nvImageCodec#55): use a DALI whose nvImageCodec fixes it, or set "
        "DALI_FAST_TRAIN_DECODE=whole to accept whole images"
    )
    assert "training    decodes whole images, cropped on the GPU on GPU 0 (NVIDIA L4)" in d.lines
    assert (
        "nvJPEG      12.4.0 on GPU 0 (NVIDIA L4): hardware backend no (status 6) (what nvImageCodec checks)" in d.lines
    )
    roi = diagnose(gpu_host(hw_decoder=NO_ENGINE, decoder_probe=crashed, train_decode="roi"))
    assert roi.problem == (
        "DALI's crop-window decode crashed (SIGSEGV, rc -11) on GPU 0 (NVIDIA L4) and DALI_FAST_TRAIN_DECODE=roi asks "
        "training to decode crop windows: unset it or set it to 'whole'"
    )
    assert "training    decodes the crop window only on GPU 0 (NVIDIA L4)" in roi.lines
    for fine in (
        gpu_host(decoder_probe=crashed),  # an engine: training decodes whole images
        gpu_host(hw_decoder=NO_ENGINE, decoder_probe=crashed, train_decode="whole"),
        gpu_host(hw_decoder=NO_ENGINE, decoder_probe=_probe("crashed (SIGSEGV, rc -11)", hw_backend=True)),
        gpu_host(hw_decoder=NO_ENGINE, decoder_probe=_probe()),
    ):
        assert diagnose(fine).ok, diagnose(fine).problem
    ok = diagnose(gpu_host(hw_decoder=NO_ENGINE, decoder_probe=_probe()))
    assert "training    decodes the crop window only on GPU 0 (NVIDIA L4)" in ok.lines
    assert 'crop window ok: decoders.image_random_crop on device="mixed" decoded in a child process' in ok.lines
    engine = diagnose(gpu_host(hw_decoder=NO_ENGINE, decoder_probe=_probe(hw_backend=True)))
    assert "nvJPEG      12.4.0 on GPU 0 (NVIDIA L4): hardware backend yes, 1 engine(s) of 5 cores" in engine.lines[-3]
    assert engine.lines[-1] == "training    decodes whole images, cropped on the GPU on GPU 0 (NVIDIA L4)"


def test_known_defects_of_this_machine_s_releases_and_gpus_are_listed():
    from dali_fast.tools.known_defects import defects_for

    h100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    a10 = {"index": 0, "name": "NVIDIA A10", "compute_capability": "8.6"}
    rtx = {"index": 0, "name": "NVIDIA GeForce RTX 5090", "compute_capability": "12.0"}
    libs = {"nvImageCodec": "0.9.0", "nvJPEG": "12.4.0"}
    assert [d["ref"] for d in defects_for(libs, [h100])] == [
        "NVIDIA/nvImageCodec#55",
        "pytorch/vision#9606, meta-pytorch/torchcodec#1634",
    ]
    assert [d["ref"] for d in defects_for(libs, [a10])] == ["NVIDIA/nvImageCodec#55"]
    assert [d["ref"] for d in defects_for(libs, [rtx])][-1] == "MrNeRF/LichtFeld-Studio#1924, #616"
    assert [d["ref"] for d in defects_for({"nvImageCodec": "0.8.0"}, [a10])] == []  # before the regression
    assert len(defects_for(libs, [{"name": "?", "compute_capability": None}])) == 3  # generation unknown: all
    d = diagnose(gpu_host(known_defects=defects_for(libs, [h100])))
    assert d.ok  # a known defect is a line, not a failure: what it does here is what the checks report
    line = next(x for x in d.lines if x.startswith("defect      nvImageCodec 0.9.0"))
    assert line.startswith(
        "defect      nvImageCodec 0.9.0 (NVIDIA/nvImageCodec#55; no fixed release known): crop-window decoding"
    )
    assert "; what dali_fast does: probes one crop-window batch in a child process" in line
    assert defects_for(libs, []) == []  # no GPU: none applies


def test_no_container_toolkit():
    """What `docker run` without --gpus (or without the NVIDIA Container Toolkit) looks like."""
    r = gpu_host(
        cuda_available=False,
        cuda_error="Found no NVIDIA driver on your system.",
        nvml_error="NVML Shared Library Not Found",
        driver=None,
        driver_cuda=None,
        gpus=[],
        gpu_decode=None,
        hw_decoder=None,
    )
    d = diagnose(r)
    assert d.problem == (
        "no NVIDIA GPU visible (NVML: NVML Shared Library Not Found): on a GPU host install the NVIDIA driver; "
        "in Docker run with --gpus all (needs the NVIDIA Container Toolkit on the host)"
    )
    assert "driver      not found through NVML (NVML Shared Library Not Found)" in d.lines


def test_cpu_only_torch_on_a_gpu_host():
    d = diagnose(gpu_host(torch="2.13.0+cpu", torch_cuda=None, cuda_available=False, gpu_decode=None))
    assert d.problem == (
        f"torch 2.13.0+cpu is a CPU-only build but a GPU is present: pip install torch --index-url {TORCH_CUDA12_INDEX}"
    )


def test_driver_older_than_torch_cuda():
    r = gpu_host(cuda_available=False, cuda_error="driver too old", driver="470.82", driver_cuda="11.4")
    assert diagnose(r).problem == (
        "the driver 470.82 supports CUDA up to 11.4 but torch was built for CUDA 12.8: "
        "update the driver or install a torch build for CUDA 11.4 or older"
    )


def test_torch_cannot_use_cuda_for_another_reason():
    r = gpu_host(cuda_available=False, cuda_error="CUDA-capable device(s) is/are busy or unavailable")
    assert diagnose(r).problem == (
        "torch 2.13.0+cu128 cannot use the GPU: CUDA-capable device(s) is/are busy or unavailable"
    )


def test_no_visible_gpu_with_a_driver():
    r = gpu_host(cuda_available=False, gpus=[])
    assert "reports no GPU" in diagnose(r).problem


def test_dali_missing():
    r = gpu_host(dali=None, dali_error="No module named 'nvidia'", cpu_decode=None, gpu_decode=None, hw_decoder=None)
    d = diagnose(r)
    assert d.problem == "NVIDIA DALI is not installed (No module named 'nvidia'): pip install nvidia-dali-cuda120"
    assert "decode gpu  not tried (no usable GPU or no DALI)" in d.lines


def test_gpu_decode_failure_is_the_problem():
    r = gpu_host(gpu_decode={"ok": False, "error": "nvImageCodec: failed to create decoder"}, hw_decoder=None)
    d = diagnose(r)
    assert d.problem == 'DALI cannot decode a JPEG with device="mixed": nvImageCodec: failed to create decoder'
    assert 'decode gpu  FAILED (device="mixed"): nvImageCodec: failed to create decoder' in d.lines
