"""`dali-fast doctor`: the real readings on this machine, and every GPU branch from given readings."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from dali_fast.cli import main
from dali_fast.tools.diagnosis import diagnose
from dali_fast.tools.doctor import (
    TEST_JPEG,
    Readings,
    decode_check,
    hw_decoder_check,
    probe,
    probe_nvml,
)


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """NVML at its boundary: two GPUs, the second without a JPEG engine."""

    def __init__(self):
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlSystemGetDriverVersion(self):
        return b"570.86.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12080

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return ["NVIDIA H200", "NVIDIA A10"][h]

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": [150_000_000_000, 24_000_000_000][h]})()

    def nvmlDeviceGetJpgUtilization(self, h):
        if h == 1:
            raise FakeNVMLError("Not Supported")
        return (0, 166666)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return [(9, 0), (8, 6)][h]


def test_probe_nvml_reads_driver_and_gpus():
    r, fake = Readings(), FakeNvml()
    probe_nvml(r, nvml=fake)
    assert r.nvml_error is None and fake.shut
    assert (r.driver, r.driver_cuda) == ("570.86.15", "12.8")
    assert r.gpus == [
        {"index": 0, "name": "NVIDIA H200", "memory_gib": 139.7, "jpeg_engine": True, "compute_capability": "9.0"},
        {"index": 1, "name": "NVIDIA A10", "memory_gib": 22.4, "jpeg_engine": False, "compute_capability": "8.6"},
    ]


def test_probe_nvml_without_a_driver():
    class NoDriver:
        def nvmlInit(self):
            raise FakeNVMLError("NVML Shared Library Not Found")

    r = Readings()
    probe_nvml(r, nvml=NoDriver())
    assert r.nvml_error == "NVML Shared Library Not Found" and r.gpus == []


def test_hw_check_on_a_gpu_without_jpeg_engine(monkeypatch):
    # The fake NVML knows indices only: look devices up as where torch reports no UUID (on a CUDA host
    # torch would report the real GPU's, which the fake does not know).
    monkeypatch.setattr("dali_fast.machine.cuda_device_uuid", lambda i: None)

    class NoEngine(FakeNvml):
        def nvmlDeviceGetJpgUtilization(self, h):
            raise FakeNVMLError("Not Supported")

    assert hw_decoder_check(0, nvml=NoEngine()) == {"jpeg_engine": False, "peak_util": None, "used": False}


def test_hw_check_decodes_megapixel_images_for_longer_than_nvml_s_window(monkeypatch):
    """NVML averages the JPEG engine's utilization over ~0.17-1 s: a few 64x48 thumbnails decode in a
    sliver of that and can read 0 %. The check decodes batches of >= 1 MP baseline 4:2:0 JPEGs (what the
    engine takes) for more than twice the longest window."""
    import dali_fast.tools.doctor as doctor

    built, runs = [], []

    class Pipe:
        def run(self):
            runs.append(1)
            time.sleep(0.01)

        def _shutdown(self):
            built.append("shut")

    def pipeline(data, device, device_id, batch, hw_load):
        built.append((data, device, device_id, batch, hw_load))
        return Pipe()

    class Busy(FakeNvml):
        def nvmlDeviceGetJpgUtilization(self, h):
            return (41, 166666)

    monkeypatch.setattr(doctor, "_decode_pipeline", pipeline)
    monkeypatch.setattr(doctor, "nvml_handle", lambda nvml, i: i)
    out = hw_decoder_check(0, seconds=0.2, nvml=Busy())
    data, device, device_id, batch, hw_load = built[0]
    with Image.open(io.BytesIO(data)) as im:
        assert im.width * im.height >= 1_000_000 and im.format == "JPEG"
        assert im.layer == [(1, 2, 2, 0), (2, 1, 1, 1), (3, 1, 1, 1)]  # 4:2:0
        assert "progressive" not in im.info  # baseline: the hardware decoder's format
    assert (device, device_id, hw_load) == ("mixed", 0, 1.0) and batch >= 16 and built[-1] == "shut"
    assert doctor.HW_CHECK_SECONDS >= 2.0  # > 2 x NVML's longest sampling window
    assert out["peak_util"] == 41 and out["used"] is True and out["nvml_window_us"] == 166666
    assert out["megapixels"] >= 1.0 and out["seconds"] >= 0.2 and out["images_per_s"] > 0


def test_real_cpu_decode_of_the_embedded_jpeg():
    pytest.importorskip("nvidia.dali")
    assert TEST_JPEG[:2] == b"\xff\xd8"
    good = decode_check("cpu")
    assert good["ok"] and good["mean_diff"] <= 2.0
    bad = decode_check("cpu", data=TEST_JPEG[:200])
    assert not bad["ok"] and bad["error"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU answer")
def test_doctor_without_a_gpu_exits_non_zero_with_one_line(capsys):
    r = probe(quick=False)
    assert not r.cuda_available and r.gpu_decode is None
    assert r.decoder_preallocation["device_total"] > 0  # what one GPU pipeline would preallocate
    assert main(["doctor"]) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("dali-fast doctor: the GPU path cannot run: ")
    assert "python      " in out and "torch       " in out
    if r.dali:
        assert f"DALI        {r.dali}" in out and 'decode cpu  ok (device="cpu"' in out
    assert main(["doctor", "--quick"]) == 1  # no GPU visible to NVML either
    assert capsys.readouterr().err.startswith("dali-fast doctor: the GPU path cannot run: no NVIDIA GPU visible")


def test_quick_reads_nvml_only_no_cuda_no_dali(monkeypatch, capsys):
    """The container health check runs during training: it must not start a CUDA context or a DALI pipeline."""
    import builtins

    import torch

    import dali_fast.tools.doctor as doctor

    def touched(*_a, **_k):
        raise AssertionError("--quick touched CUDA or DALI")

    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch.cuda, "init", touched)
    monkeypatch.setattr(doctor, "_decode_pipeline", touched)
    real_import = builtins.__import__

    def no_dali(name, *args, **kwargs):
        if name.startswith("nvidia.dali"):
            touched()
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    r = probe(quick=True, nvml=FakeNvml())
    result = diagnose(r)
    assert result.problem is None and r.quick and r.dali is None and r.gpu_decode is None
    assert result.lines[1] == "quick       NVML only: no CUDA context, no DALI pipeline"
    assert any("NVIDIA H200" in line for line in result.lines)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_doctor_on_a_gpu_host(capsys):
    pytest.importorskip("nvidia.dali")
    assert main(["doctor"]) == 0
    out, _ = capsys.readouterr()
    assert 'decode gpu  ok (device="mixed"' in out and "the GPU path works" in out


@pytest.mark.gpu
def test_gpu_hw_decoder_check_sees_the_jpeg_engine_work():
    """On a GPU with a JPEG engine (A100, H100, H200, ...) the check reads it busy: megapixel images over
    more than NVML's sampling window, not thumbnails that finish inside a sliver of it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("nvidia.dali")
    r = hw_decoder_check(torch.cuda.current_device())
    if r["jpeg_engine"] is False:
        pytest.skip("this GPU has no hardware JPEG engine")
    assert r["jpeg_engine"] is True and r["used"] is True and r["peak_util"] > 0, r


def test_mixed_decode_check_upsamples_chroma_like_the_cpu_decoder(monkeypatch):
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn as fn

    import dali_fast.tools.doctor as doctor

    seen = []

    def image(jpegs, **kwargs):
        seen.append(kwargs)
        return jpegs  # stand-in: lets the pipeline build without a GPU

    monkeypatch.setattr(fn.decoders, "image", image)
    p = doctor._decode_pipeline(TEST_JPEG, "mixed", None, 1, 0.65)  # noqa: SLF001
    from dali_fast.loaders.dali_pipeline import shutdown_pipeline

    shutdown_pipeline(p)
    assert seen[0]["device"] == "mixed" and seen[0]["jpeg_fancy_upsampling"] is True


def _gpu_host_doctor(monkeypatch, nvml, crop_window="ok", hw_backend=True):
    """`dali-fast doctor` on a GPU host seen through fakes at its boundaries: NVML (``nvml``, as the module
    `pynvml`), torch's CUDA, the decode pipelines and the crop-window child; the checks' own logic is real."""
    import sys

    import dali_fast.tools.doctor as doctor
    from dali_fast.transforms.decode_probe import DecoderProbe

    def torch_with_cuda(r):
        r.torch, r.torch_cuda, r.cuda_available = "2.13.0+cu128", "12.8", True

    class Pipe:
        def run(self):
            time.sleep(0.01)

        def _shutdown(self):
            pass

    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(doctor, "probe_torch", torch_with_cuda)
    monkeypatch.setattr(doctor, "probe_dali", lambda r: setattr(r, "dali", "2.4.0"))
    monkeypatch.setattr(doctor, "decode_check", lambda device, device_id=None: {"ok": True, "mean_diff": 0.4})
    monkeypatch.setattr(doctor, "_decode_pipeline", lambda *a: Pipe())
    monkeypatch.setattr(doctor, "nvml_handle", lambda nvml, i: i)
    monkeypatch.setattr(doctor, "HW_CHECK_SECONDS", 0.2)
    monkeypatch.setattr(doctor, "_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr("dali_fast.machine.local_device_index", lambda: 0)
    found = DecoderProbe("0", crop_window=crop_window, nvjpeg="12.4.0", hw_backend=hw_backend, rc=0)
    monkeypatch.setattr(doctor, "probe_decoders", lambda device, timeout: found)


def test_doctor_exits_1_when_the_engine_stays_idle_on_whole_images(monkeypatch, capsys):
    """NVML sees a JPEG engine on GPU 0 but reads 0 % while DALI decodes whole megapixel JPEGs: training
    would decode on the CPU threads at a quarter of its speed, so doctor fails, naming the GPU."""
    _gpu_host_doctor(monkeypatch, FakeNvml())  # its engine reads (0, window): idle
    assert main(["doctor"]) == 1
    out, err = capsys.readouterr()
    assert "hw decoder  present but stayed idle while DALI decoded (hw_decoder_load=1)" in out
    assert err == (
        "dali-fast doctor: the GPU path cannot run: the hardware JPEG engine of GPU 0 (NVIDIA H100 80GB HBM3) "
        "stayed idle while DALI decoded whole images with hw_decoder_load=1: training would decode on the CPU "
        "threads, at about a quarter of its speed; check that nvJPEG builds its hardware backend (doctor --json: "
        "decoder_probe) and that no MIG slice or container setting hides the engine\n"
    )

    class Busy(FakeNvml):
        def nvmlDeviceGetJpgUtilization(self, h):
            return (41, 166666)

    _gpu_host_doctor(monkeypatch, Busy())
    assert main(["doctor"]) == 0
    assert "hw decoder  used: JPEG engine utilization reached 41 %" in capsys.readouterr().out


def test_doctor_exits_1_when_the_crop_window_child_dies_on_a_gpu_that_would_use_it(monkeypatch, capsys):
    class NoEngine(FakeNvml):
        def nvmlDeviceGetJpgUtilization(self, h):
            raise FakeNVMLError("Not Supported")

    _gpu_host_doctor(monkeypatch, NoEngine(), crop_window="crashed (SIGSEGV, rc -11)", hw_backend=False)
    monkeypatch.delenv("DALI_FAST_TRAIN_DECODE", raising=False)
    assert main(["doctor", "--json"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(
        "dali-fast doctor: the GPU path cannot run: DALI's crop-window decode crashed (SIGSEGV, rc -11) on GPU 0 "
        "(NVIDIA H100 80GB HBM3), where training would decode crop windows"
    )
    import json

    readings = json.loads(out)["readings"]
    assert readings["decoder_probe"]["crop_window"] == "crashed (SIGSEGV, rc -11)"
    assert readings["decoder_probe"]["crop_ok"] is False and readings["hw_decoder"]["jpeg_engine"] is False
    _gpu_host_doctor(monkeypatch, FakeNvml(), crop_window="crashed (SIGSEGV, rc -11)")  # the engine: whole images
    monkeypatch.setattr(FakeNvml, "nvmlDeviceGetJpgUtilization", lambda self, h: (30, 166666))
    assert main(["doctor"]) == 0  # training would not decode crop windows here
    out = capsys.readouterr().out
    assert 'crop window CRASHED (SIGSEGV, RC -11) on device="mixed" in a child process' in out
    assert "training    decodes whole images, cropped on the GPU on GPU 0 (NVIDIA H100 80GB HBM3)" in out
