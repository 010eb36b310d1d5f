"""gpu_check's verdicts that need a GPU to happen, checked with given readings: the loader-ceiling step fails
when a GPU's JPEG engine stays idle, and a step that records a failure exits non-zero with its figures kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu_check"))


@pytest.mark.parametrize(
    "gpu, engine, sampled, idle, figure, fails",
    [
        (True, True, True, [], "yes", False),
        (True, True, True, ["DALIIterator with 16 threads"], "NO: idle under DALIIterator with 16 threads", True),
        (True, False, True, ["DALIIterator with 16 threads"], "n/a (no JPEG engine)", False),
        (True, None, True, ["DALIIterator with 8 threads"], "n/a (NVML cannot tell)", False),
        (True, True, False, [], "n/a (no NVML reading)", False),
        (False, None, False, [], "n/a (no GPU)", False),
    ],
)
def test_the_ceiling_step_fails_when_the_jpeg_engine_stays_idle(gpu, engine, sampled, idle, figure, fails):
    import gpu_steps

    verdict, failure = gpu_steps.engine_verdict(gpu, engine, sampled, idle)
    assert verdict == figure and (failure is not None) == fails
    if fails:
        assert failure == f"the JPEG engine stayed idle under {', '.join(idle)}"


def test_a_step_with_a_failure_exits_1_after_writing_its_figures(tmp_path, monkeypatch, capsys):
    import gpu_steps

    def step(args):
        gpu_steps.figure("controller.seen", 1)
        gpu_steps.FAILED.append("something the device showed")

    monkeypatch.setitem(gpu_steps.STEPS, "controller", step)
    data = tmp_path / "packed"
    data.mkdir()
    assert gpu_steps.main(["controller", "--data", str(data), "--out", str(tmp_path)]) == 1
    assert "controller FAILED: something the device showed" in capsys.readouterr().out
    assert json.loads((tmp_path / "controller.json").read_text())["controller.seen"] == 1
    monkeypatch.setitem(gpu_steps.STEPS, "controller", lambda args: gpu_steps.figure("controller.seen", 2))
    # failures do not carry over
    assert gpu_steps.main(["controller", "--data", str(data), "--out", str(tmp_path)]) == 0


def test_gpu_images_off_the_cpu_s_or_flat_are_found_with_the_worst_named():
    """The GPU-vs-CPU comparison over many images: an image corrupted in one corner (as the stream race
    writes before earlier work ends) and one left flat (as an engine that skipped it) are both found; the
    p99 is read over every pixel; the worst image is named with its own figures."""
    import torch
    from gpu_steps import compare_images

    g = torch.Generator().manual_seed(0)
    cpu = torch.rand(40, 3, 32, 32, generator=g) * 255
    gpu = cpu + torch.randn(40, 3, 32, 32, generator=g) * 0.3  # decoder and resize noise
    gpu[7, :, :16, :16] = 0  # a quarter of an image overwritten
    gpu[31] = 0  # a skipped image: black
    found = compare_images(gpu, cpu, [f"img{i}" for i in range(40)])
    assert found["corrupt"] == ["img7", "img31"] and found["flat_images"] == 1 and found["images"] == 40
    assert found["worst_image"].startswith("img31: mean ") and found["worst_image"].endswith(" levels")
    assert found["p99_levels"] >= 100  # 1/40 + 1/160 of the pixels are far off: above the 99th percentile
    clean = compare_images(cpu + 0.3, cpu, [f"img{i}" for i in range(40)])
    assert clean["corrupt"] == [] and clean["p99_levels"] == 0 and clean["mean_levels"] < 0.31


def test_a_crop_window_child_that_dies_leaves_its_rows_n_a_and_the_rows_before_it(monkeypatch, capsys):
    import gpu_speed
    from gpu_figures import FIGURES

    FIGURES.clear()
    child = [
        sys.executable,
        "-c",
        "import os, signal\n"
        "print('FIGURE ceiling.plain_dali_roi_16_threads_load_0.65.img_per_s 21271.5', flush=True)\n"
        "print('building the 0.99 row', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSEGV)",
    ]
    gpu_speed.crop_window_rows(16, [0.65, 0.99], child)
    assert FIGURES["ceiling.plain_dali_roi_16_threads_load_0.65.img_per_s"] == 21271.5
    assert FIGURES["ceiling.plain_dali_roi_16_threads_load_0.99.img_per_s"] == "n/a (crashed, rc -11)"
    assert FIGURES["ceiling.plain_dali_roi.child_rc"] == -11
    assert "crop-window child: building the 0.99 row" in capsys.readouterr().out
    FIGURES.clear()
    gpu_speed.crop_window_rows(16, [0.65], [sys.executable, "-c", "raise SystemExit(3)"])
    assert FIGURES["ceiling.plain_dali_roi_16_threads_load_0.65.img_per_s"] == "n/a (failed, rc 3)"


def test_the_engine_verdict_and_ceiling_json_are_written_before_the_crop_window_rows(tmp_path, monkeypatch):
    pytest.importorskip("nvidia.dali")
    import gpu_speed
    import gpu_steps

    from dali_fast import pack
    from dali_fast.data.synthetic import make_synthetic

    pack(make_synthetic(tmp_path / "images", images=24, classes=2, progress=False), tmp_path / "packed", progress=False)
    seen = {}

    def crop_window_rows(threads, loads, command):
        seen["json"] = json.loads((tmp_path / "ceiling.json").read_text())
        seen["command"] = command
        gpu_speed.figure("ceiling.plain_dali_roi.child_rc", -11)

    monkeypatch.setattr(gpu_speed, "crop_window_rows", crop_window_rows)
    small = ["--device", "cpu", "--image-size", "32", "--batch-size", "8", "--min-seconds", "0.05"]
    argv = ["ceiling", "--data", str(tmp_path / "packed"), "--out", str(tmp_path), "--threads", "1", "--workers", "0"]
    assert gpu_steps.main([*argv, "--images-dir", str(tmp_path / "images"), *small]) == 0
    assert seen["json"]["ceiling.jpeg_engine_busy"] == "n/a (no GPU)"
    assert seen["json"]["ceiling.dali_1_threads.img_per_s"] > 0
    assert "ceiling.plain_dali_roi.child_rc" not in seen["json"]
    cmd = seen["command"]
    assert cmd[2:5] == ["plain-rows", "--kind", "roi"] and cmd[cmd.index("--loads") + 1] == "0.65,0.99"
    assert json.loads((tmp_path / "ceiling.json").read_text())["ceiling.plain_dali_roi.child_rc"] == -11


def test_the_answers_read_the_steps_figures():
    from gpu_answers import answers

    f = {
        "ceiling.dali_16_threads.img_per_s": 30000.0,
        "ceiling.dali_16_threads.batch_ms_p99": 12.5,
        "ceiling.dali_16_threads.jpeg_util_mean": 71.0,
        "ceiling.dali_16_threads_load_0.65.img_per_s": 28000.0,
        "ceiling.dali_16_threads_load_0.65.batch_ms_p99": 9.5,
        "ceiling.dali_16_threads_load_0.65.jpeg_util_mean": 55.0,
        "ceiling.dali_8_threads.img_per_s": 20000.0,
        "ceiling.plain_dali_whole_16_threads_load_0.99.img_per_s": 32000.0,
        "ceiling.plain_dali_roi_16_threads_load_0.65.img_per_s": 21000.0,
        "ceiling.plain_dali_roi_16_threads_load_0.99.img_per_s": "n/a (crashed, rc -11)",
        "ceiling.jpeg_engine_busy": "yes",
        "ceiling.engine_eligible_share": "0.980 (82 of 4096 refused by the engine)",
        "models.resnet18.dali_vs_ceiling": 0.91,
        "models.resnet18.dali_img_per_s": 11900.0,
        "models.resnet18.ceiling_img_per_s": 13095.0,
        "decode.corrupt_images": 2,
        "decode.loader_eval_gpu_vs_cpu.images": 1024,
        "decode.loader_eval_gpu_vs_cpu.worst_image": "17 (class_001/x.jpg): mean 30.10, max 255 levels",
        "doctor.decoder_probe.crop_window": "crashed (SIGSEGV, rc -11)",
    }
    a = answers(f)
    assert a["dali_vs_best_plain_dali"] == (
        "0.94 (DALIIterator 30,000 img/s, DALIIterator at 16 threads, hw_decoder_load 0.99 (the loader's default); "
        "best plain DALI 32,000 img/s, whole-image at 16 threads, hw_decoder_load 0.99; goal 0.9 or more)"
    )
    assert a["resnet18_vs_resident_ceiling"].startswith("0.91 (11900.0 img/s fed by DALIIterator")
    assert a["resnet50_vs_resident_ceiling"] == "n/a (the models step left no resnet50 figures)"
    assert a["load_winning_on_p99"].startswith("0.65 (DALIIterator batch p99 by hw_decoder_load: ")
    assert a["corruption"] == (
        "FOUND: 2 of 1024 images off the CPU's; worst: 17 (class_001/x.jpg): mean 30.10, max 255 levels"
    )
    assert a["engine_use"].startswith("busy: yes; JPEG engine mean % per DALIIterator row: dali_16_threads: 71.0")
    assert a["engine_use"].endswith("share of the data the engine takes: 0.980 (82 of 4096 refused by the engine)")
    assert a["crop_window_probe"] == (
        "crashed (SIGSEGV, rc -11) (doctor's child); plain-DALI crop-window rows: plain_dali_roi_16_threads_load_0.65: "
        "21000.0 img/s, plain_dali_roi_16_threads_load_0.99: n/a (crashed, rc -11)"
    )
    assert answers({})["dali_vs_best_plain_dali"].startswith("n/a (")


def test_the_preflight_stops_in_one_line_when_nvimgcodec_does_not_import(monkeypatch, capsys):
    import builtins

    import gpu_preflight

    real = builtins.__import__

    def no_nvimgcodec(name, *args, **kwargs):
        if name == "nvidia.nvimgcodec":
            raise ImportError("libnvimgcodec.so.0: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nvimgcodec)
    assert gpu_preflight.main(["--no-gpu-needed"]) == 1
    assert capsys.readouterr().out == (
        "nvidia.nvimgcodec does not import (ImportError: libnvimgcodec.so.0: cannot open shared object file)\n"
    )
