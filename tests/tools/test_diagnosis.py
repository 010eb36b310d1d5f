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
        ({"jpeg_engine": True, "peak_util": 0, "used": False}, "present but stayed idle"),
        ({"jpeg_engine": None, "peak_util": None, "used": None, "error": "NVML busy"}, "unknown (NVML busy)"),
    ],
)
def test_hardware_decoder_lines_do_not_fail_the_check(hw, line):
    d = diagnose(gpu_host(hw_decoder=hw, gpus=[{"index": 0, "name": "NVIDIA A10", "memory_gib": 22.0}]))
    assert d.ok and any(line in x for x in d.lines)


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
