"""The crop-window probe in a child process and what the training decode does with its verdict: a child that
dies (as nvImageCodec 0.9.0's crop-window decode does on an H100) makes "auto" decode whole images, with one
warning line; the real child run on DALI's CPU decoder; nvJPEG's own answer read without a GPU."""

from __future__ import annotations

import logging
import sys

import pytest
from builders import IndexReader, jpeg_bytes

import dali_fast.transforms.decode_choice as decode_choice
import dali_fast.transforms.decode_probe as decode_probe
from dali_fast.transforms.decode_choice import TRAIN_DECODE_ENV, decide_train_decode
from dali_fast.transforms.decode_probe import DecoderProbe, nvjpeg_version, probe_decoders


def _child(code: str) -> list[str]:
    """A child command line that runs ``code`` (after ``import json, os, signal, sys, time``)."""
    return [sys.executable, "-c", "import json, os, signal, sys, time\n" + code]


SEGFAULT_AFTER_NVJPEG = _child(
    'print(json.dumps({"nvjpeg": "12.4.0"}), flush=True)\n'
    'print(json.dumps({"hw_backend": True, "hw_status": 0, "hw_engines": 1, "hw_cores": 5}), flush=True)\n'
    "os.kill(os.getpid(), signal.SIGSEGV)"
)


def test_a_child_that_segfaults_is_reported_with_what_it_said_before():
    found = probe_decoders(0, command=SEGFAULT_AFTER_NVJPEG)
    assert found.crop_window == "crashed (SIGSEGV, rc -11)" and not found.crop_ok and found.rc == -11
    assert (found.nvjpeg, found.hw_backend, found.hw_engines, found.hw_cores) == ("12.4.0", True, 1, 5)


def test_a_child_that_fails_or_hangs_is_reported_in_one_line():
    failed = probe_decoders(
        0, command=_child('print(json.dumps({"crop_window_error": "nvImageCodec failure: #8"}))\nsys.exit(3)')
    )
    assert failed.crop_window == "failed (rc 3): nvImageCodec failure: #8" and failed.rc == 3
    hung = probe_decoders(0, timeout=1, command=_child("time.sleep(30)"))
    assert hung.crop_window == "timed out after 1 s" and hung.rc is None and not hung.crop_ok
    silent = probe_decoders(0, command=_child("pass"))
    assert silent.crop_window == "failed (no crop window reported)" and silent.rc == 0
    missing = probe_decoders(0, command=["/nonexistent/python"])
    assert missing.crop_window.startswith("failed (the child did not start: ")


def test_the_real_child_decodes_crop_windows_on_dali_s_cpu_decoder():
    """The child as the loader runs it (``python -m dali_fast.transforms.decode_probe``), on DALI's CPU
    decoder: its steps run, its findings reach the parent, it exits 0."""
    pytest.importorskip("nvidia.dali")
    found = probe_decoders("cpu", timeout=120)
    assert found.crop_window == "ok" and found.rc == 0, found
    assert found.nvjpeg == nvjpeg_version() and found.hw_backend is None  # nvJPEG's hardware: not asked on a CPU


def test_nvjpeg_s_version_is_read_from_the_library_nvimgcodec_loads():
    pytest.importorskip("nvidia.nvimgcodec")
    path = decode_probe.nvjpeg_library()
    if path is None:
        pytest.skip("no libnvjpeg beside nvImageCodec")
    assert "nvjpeg/lib/libnvjpeg.so." in path
    version = nvjpeg_version(path)
    assert version is not None and [int(x) >= 0 for x in version.split(".")] == [True] * 3
    assert nvjpeg_version("/nonexistent/libnvjpeg.so.12") is None


def _probe_with(monkeypatch, command: list[str]) -> list[int]:
    """The loader's probe replaced by a real child run of ``command``; returns the devices probed."""
    asked: list[int] = []
    monkeypatch.setattr(decode_probe, "probe_once", lambda d: asked.append(d) or probe_decoders(d, command=command))
    return asked


def test_auto_decodes_whole_images_when_the_crop_window_child_dies(monkeypatch, caplog):
    """NVML sees no engine, so "auto" would decode crop windows; the probe's child segfaults before a window
    decodes (nvJPEG built no hardware backend there): training decodes whole images, and says why once."""
    dies = _child(
        'print(json.dumps({"hw_backend": False, "hw_status": 6}), flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)'
    )
    asked = _probe_with(monkeypatch, dies)
    monkeypatch.setattr(decode_choice, "jpeg_engine", lambda d: False)
    with caplog.at_level(logging.INFO, logger="dali_fast.transforms.decode_choice"):
        assert decide_train_decode(True, 3, "auto") == "whole"
    assert asked == [3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "the crop-window decode crashed (SIGSEGV, rc -11) in a probe on CUDA device 3 "
        "(NVIDIA/nvImageCodec#55 in nvImageCodec 0.9.0): training decodes whole images instead"
    ]


def test_auto_keeps_the_crop_window_only_where_the_probe_decoded_it(monkeypatch, caplog):
    monkeypatch.setattr(decode_choice, "jpeg_engine", lambda d: False)
    ok = _child('print(json.dumps({"hw_backend": False}))\nprint(json.dumps({"crop_window": "ok"}))')
    _probe_with(monkeypatch, ok)
    assert decide_train_decode(True, 0, "auto") == "roi"
    engine = _child(
        'print(json.dumps({"hw_backend": True, "hw_engines": 1}))\nprint(json.dumps({"crop_window": "ok"}))'
    )
    _probe_with(monkeypatch, engine)  # nvJPEG has the hardware backend although NVML said no: as nvImageCodec
    with caplog.at_level(logging.INFO, logger="dali_fast.transforms.decode_choice"):
        assert decide_train_decode(True, 0, "auto") == "whole"
    assert "nvJPEG builds its hardware backend, though NVML sees no JPEG engine" in caplog.text
    asked = _probe_with(monkeypatch, SEGFAULT_AFTER_NVJPEG)
    for engine_seen in (True, None):  # whole images: no crop window to probe
        monkeypatch.setattr(decode_choice, "jpeg_engine", lambda d, e=engine_seen: e)
        assert decide_train_decode(True, 0, "auto") == "whole"
    assert decide_train_decode(True, 0, "whole") == "whole" and asked == []
    assert decide_train_decode(False, None, "auto") == "roi" and asked == []  # DALI's CPU decoder: no probe


def test_an_explicit_roi_is_kept_with_a_warning_when_the_child_dies(monkeypatch, caplog):
    _probe_with(monkeypatch, SEGFAULT_AFTER_NVJPEG)
    with caplog.at_level(logging.WARNING, logger="dali_fast.transforms.decode_choice"):
        assert decide_train_decode(True, 0, "roi") == "roi"
    assert caplog.records[-1].getMessage() == (
        "the crop-window decode crashed (SIGSEGV, rc -11) in a probe on CUDA device 0 (NVIDIA/nvImageCodec#55 in "
        "nvImageCodec 0.9.0); train_decode='roi' asked for, so training decodes crop windows anyway"
    )


def test_a_gpu_loader_decodes_whole_images_when_the_child_dies_and_keeps_it_in_its_state(monkeypatch):
    pytest.importorskip("nvidia.dali")
    import dali_fast.loaders.base as base
    import dali_fast.loaders.dali_iterator as dali_iterator
    from dali_fast import DALIIterator

    monkeypatch.delenv(TRAIN_DECODE_ENV, raising=False)
    monkeypatch.setattr(base, "cuda_usable", lambda: True)  # a GPU loader, built but never run here
    monkeypatch.setattr(dali_iterator, "local_device_index", lambda: 0)
    monkeypatch.setattr(decode_choice, "jpeg_engine", lambda d: False)
    _probe_with(monkeypatch, SEGFAULT_AFTER_NVJPEG)
    loader = DALIIterator(IndexReader([jpeg_bytes(40, 30)] * 4), 2, device="cuda")
    assert loader.train_decode == "whole" and loader.state_dict()["train_decode"] == "whole"
    cpu = DALIIterator(IndexReader([jpeg_bytes(40, 30)] * 4), 2, device="cpu")
    assert cpu.state_dict()["train_decode"] == "roi"


def test_probe_once_asks_the_child_once_per_device(monkeypatch):
    runs: list[object] = []
    monkeypatch.setattr(decode_probe, "probe_decoders", lambda d: runs.append(d) or DecoderProbe(str(d)))
    decode_probe.probe_once.cache_clear()
    try:
        first = decode_probe.probe_once(1)
        assert decode_probe.probe_once(1) is first and runs == [1]
        decode_probe.probe_once(2)
        assert runs == [1, 2]
    finally:
        decode_probe.probe_once.cache_clear()


@pytest.mark.gpu
def test_gpu_probe_answers_as_nvml_does_and_never_takes_the_parent_down():
    """On a GPU: the child reports nvJPEG's hardware backend (present where NVML sees a JPEG engine), and a
    crop-window verdict, whatever it is (a crash stays in the child)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("nvidia.dali")
    device = torch.cuda.current_device()
    found = probe_decoders(device)
    assert found.nvjpeg == nvjpeg_version() and found.hw_backend is not None, found
    assert found.crop_window == "ok" or found.crop_window.startswith(("crashed", "failed")), found
    engine = decode_choice.jpeg_engine(device)
    if engine is not None:
        assert found.hw_backend == engine, (found, engine)
