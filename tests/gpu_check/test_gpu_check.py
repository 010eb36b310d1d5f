"""gpu_check/gpu_check.sh, its measuring steps (gpu_steps.py) and its kill-and-resume step, checked here
without a GPU: the step list and its time limits, the preflight's one line, summary.md written step by step
and on a timeout and ending with the answers, and every measuring step run small in DALI's CPU-only mode."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STEPS = [
    ("preflight", 30),
    ("data", 30),
    ("doctor and decode", 45),
    ("odd jpegs", 20),
    ("failure paths", 30),
    ("loader ceiling", 100),
    ("models", 75),
    ("controller", 20),
    ("gpu tests", 120),
    ("answers", 10),
]
FULL_STEPS = [
    "whole suite",
    "sigkill + resume",
    "bench none",
    "bench resnet50",
    "bench stages",
    "bench recipes",
    "progressive resnet50",
]
STEP_LINE = re.compile(r"^ +(\d+)\. (.+?) +(\d+) s  (.*)$")


def _run(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def _dry_run(tmp_path, *flags):
    env = {"OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work")}
    r = _run("gpu_check/gpu_check.sh", "--dry-run", *flags, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [STEP_LINE.match(x).groups() for x in lines[1:-1]]
    total = int(re.fullmatch(r"total of limits: (\d+) s", lines[-1]).group(1))
    assert [int(n) for n, *_ in steps] == list(range(len(steps)))  # the preflight is step 0
    assert total == sum(int(limit) for _, _, limit, _ in steps)
    return [(name, int(limit), cmd) for _, name, limit, cmd in steps], total


def test_dry_run_lists_the_default_steps_in_order_within_8_minutes(tmp_path):
    steps, total = _dry_run(tmp_path)
    assert [(name, limit) for name, limit, _ in steps] == DEFAULT_STEPS
    assert total <= 480
    assert list(tmp_path.iterdir()) == []  # nothing run, nothing written
    commands = {name: cmd for name, _, cmd in steps}
    assert commands["preflight"].endswith("gpu_check/gpu_preflight.py")
    assert "--eval-images 1024" in commands["doctor and decode"]  # GPU vs CPU over 1,024 images at least
    assert "--loads 0.65,0.99" in commands["loader ceiling"] and "--min-seconds 3" in commands["loader ceiling"]
    assert "--min-seconds 3" in commands["models"] and "--odd-share 0.1" in commands["data"]
    assert f"--corpus {ROOT}/tests/fixtures/odd_jpegs" in commands["odd jpegs"]


def test_full_adds_the_long_steps_after_the_default_ones(tmp_path):
    steps, total = _dry_run(tmp_path, "--full")
    names = [name for name, _, _ in steps]
    assert names[: len(DEFAULT_STEPS) - 1] == [n for n, _ in DEFAULT_STEPS[:-1]]
    assert names[len(DEFAULT_STEPS) - 1 :] == [*FULL_STEPS, "torchrun 2 GPUs", "answers"] and total > 480


def test_every_measuring_step_s_command_line_is_one_gpu_steps_accepts(tmp_path):
    sys.path.insert(0, str(ROOT / "gpu_check"))
    import gpu_steps

    steps, _ = _dry_run(tmp_path)
    calls = 0
    for _, _, cmd in steps:
        for part in re.split(r"&&|;", cmd):
            words = shlex.split(part)
            if "gpu_check/gpu_steps.py" in words:
                args = gpu_steps.parser().parse_args(words[words.index("gpu_check/gpu_steps.py") + 1 :])
                calls += 1
                if args.step == "data":
                    assert args.out == tmp_path / "work" / "data"
                elif args.step in ("odd", "answers"):  # the corpus; the steps' figures
                    assert args.out == tmp_path / "work" and args.data is None
                else:  # where the data step packs, and the work folder, not OUT (it comes back from a GPU host)
                    assert args.data == tmp_path / "work" / "data" / "packed" and args.out == tmp_path / "work"
    assert calls == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_a_gpu_the_run_stops_in_one_line(tmp_path):
    r = _run("gpu_check/gpu_check.sh", env={"OUT": str(tmp_path)})
    assert r.returncode == 1 and r.stdout.count("\n") == 1 and r.stdout.startswith("no usable GPU: ")
    assert list(tmp_path.iterdir()) == []


def _fake_steps(tmp_path, lines):
    f = tmp_path / "steps.txt"
    f.write_text("\n".join(lines) + "\n")
    return {
        "OUT": str(tmp_path / "out"),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "GPU_CHECK_STEPS": str(f),
        "GPU_CHECK_REQUIRE_GPU": "0",
    }


def test_summary_md_grows_step_by_step_and_a_step_past_its_limit_is_stopped(tmp_path):
    """Each step's status and figures reach summary.md as it ends (a run cut short, its GPU host taken
    back, keeps them); a step past its limit is stopped and marked, and the steps after it still run."""
    env = _fake_steps(
        tmp_path,
        [
            "quick|10|echo FIGURE answer 42",
            "stuck|3|echo FIGURE started yes; sleep 60; echo FIGURE never 1",
            "broken|10|echo FIGURE partial 7; exit 3",
            "after|10|echo FIGURE later 1",
        ],
    )
    summary = tmp_path / "out" / "summary.md"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "gpu_check/gpu_check.sh"],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        mid = ""
        while proc.poll() is None and "## 1. quick: ok" not in mid:
            time.sleep(0.1)
            mid = summary.read_text() if summary.exists() else ""
        assert "| answer | 42 |" in mid and "## 2." not in mid  # written while the stuck step still runs
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - t0 < 40  # the stuck step was stopped at its limit
    text = summary.read_text()
    assert "## 2. stuck: TIMED OUT at its limit of 3 s" in text and "| started | yes |" in text
    assert "never" not in text
    assert "## 3. broken: FAILED (exit 3)" in text and "| partial | 7 |" in text
    assert "## 4. after: ok" in text and "| later | 1 |" in text
    assert re.search(r"\| 2\. stuck \| TIMED OUT at its limit of 3 s \| [345] \| 3 \|", text)
    # OUT holds the summary and the logs only (what comes back from a GPU host is a few files)
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "summary.md"]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["./1_quick.log", "./2_stuck.log", "./3_broken.log", "./4_after.log"]


def test_the_answers_end_the_summary_after_the_table_of_steps(tmp_path):
    env = _fake_steps(tmp_path, ["first|10|echo FIGURE x 1", "answers|10|echo FIGURE answers.corruption none found"])
    r = _run("gpu_check/gpu_check.sh", env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = (tmp_path / "out" / "summary.md").read_text()
    assert text.index("## 1. first: ok") < text.index("## all steps") < text.index("## 2. answers: ok")
    assert text.rstrip().endswith("| answers.corruption | none found |")
    assert "| 1. first | ok |" in text and "| 2. answers |" not in text  # the table is written before it runs
    header = text.split("\n\n")[1]  # the preflight's line: what decides the GPU path's behaviour
    assert "nvImageCodec " in header and "nvJPEG " in header and "TorchIterator decodes JPEGs with " in header


def _odd_corpus(folder: Path) -> Path:
    """A small corpus of the odd-JPEG shape: two kinds to decode (one bounded), one to refuse."""
    import io

    import numpy as np
    from PIL import Image

    folder.mkdir()
    px = np.clip(np.random.default_rng(0).normal(128, 40, (48, 64, 3)), 0, 255).astype(np.uint8)
    for name, kw in (("progressive.jpg", {"progressive": True}), ("s444.jpg", {"subsampling": 0})):
        Image.fromarray(px).save(folder / name, "JPEG", **kw)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG")
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[:300])
    manifest = [
        {"file": "progressive.jpg", "kind": "progressive", "made_by": "Pillow", "expect": "decode", "max_levels": 2},
        {"file": "s444.jpg", "kind": "444", "made_by": "Pillow", "expect": "decode", "max_levels": None},
        {"file": "truncated.jpg", "kind": "truncated", "made_by": "cut", "expect": "refuse", "max_levels": None},
    ]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_measuring_steps_run_small_on_a_cpu(tmp_path):
    """Each of gpu_steps.py's steps, in DALI's CPU-only mode at toy sizes: the figures it prints are the
    ones gpu_check.sh collects, and what needs a GPU says n/a."""
    pytest.importorskip("nvidia.dali")
    out = tmp_path / "out"
    small = ["--device", "cpu", "--image-size", "32", "--batch-size", "16", "--min-seconds", "0.2"]
    doctor = tmp_path / "doctor.json"
    readings = {"driver": "580.159.03", "driver_cuda": "13.0", "dali": "2.4.0", "dali_libs": {}, "cpu_decode": None}
    gpus = [{"index": 0, "name": "NVIDIA H200", "memory_gib": 139.8, "jpeg_engine": True}]
    hw = {"jpeg_engine": True, "peak_util": 63, "used": True, "images_per_s": 2500.0}
    probe = {"crop_window": "crashed (SIGSEGV, rc -11)", "nvjpeg": "12.4.0", "hw_backend": True, "hw_engines": 1}
    readings |= {"gpus": gpus, "gpu_decode": {"ok": True, "mean_diff": 0.4}, "hw_decoder": hw, "decoder_probe": probe}
    readings |= {"known_defects": [{"ref": "NVIDIA/nvImageCodec#55"}]}
    doctor.write_text(json.dumps({"readings": {**readings, "decoder_preallocation": None}, "problem": None}))
    data = str(out / "data" / "packed")
    corpus = _odd_corpus(tmp_path / "odd")
    runs = [
        ["data", "--out", str(out / "data"), "--images", "64", "--classes", "4", "--size", "96x72", "--jobs", "2"],
        ["decode", "--data", data, "--out", str(out), "--images", "8", "--doctor-json", str(doctor), *small],
        ["odd", "--corpus", str(corpus), "--out", str(out), *small],
        ["failures", "--data", data, "--out", str(out), *small],
        ["ceiling", "--data", data, "--out", str(out), "--threads", "1,2", "--workers", "0", *small],
        ["models", "--data", data, "--out", str(out), "--models", "resnet_tiny", "--steps", "1", "--warmup-steps", "1", *small],
        ["controller", "--data", data, "--out", str(out), *small],
        ["answers", "--out", str(out)],
    ]  # fmt: skip
    script = "import sys, gpu_steps\nfor argv in eval(sys.argv[1]):\n    assert gpu_steps.main(argv) == 0, argv\n"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'gpu_check'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", script, repr(runs)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    printed = dict(line.split(" ", 2)[1:] for line in r.stdout.splitlines() if line.startswith("FIGURE "))
    steps = ("data", "decode", "odd", "failures", "ceiling", "models", "controller", "answers")
    figures = {k: v for step in steps
               for k, v in json.loads((out / ("data" if step == "data" else "") / f"{step}.json").read_text()).items()}  # fmt: skip
    assert set(printed) - {"plain-rows.step_seconds"} == set(figures)
    assert figures["data.images"] == 64 and figures["decode.dali_cpu_vs_pillow.mean_levels"] <= 1.0
    assert figures["data.odd"] == "progressive 2, 444 2, gray 1, large 1, exif_rotated 1"  # every 10th of 64
    assert figures["doctor.problem"] == "none: the GPU path works" and figures["doctor.hw_decoder.peak_util"] == 63
    assert figures["doctor.gpu0"] == "NVIDIA H200, 139.8 GiB, JPEG engine: True"
    assert figures["doctor.gpu_decode_mean_levels_from_pillow"] == 0.4
    assert figures["doctor.decoder_probe.crop_window"] == "crashed (SIGSEGV, rc -11)"
    assert figures["doctor.known_defects"] == "NVIDIA/nvImageCodec#55"
    assert figures["decode.mixed_vs_pillow"] == "n/a (no GPU)" and figures["failures.oom"] == "n/a (needs a GPU)"
    assert figures["odd.progressive.ok"] == figures["odd.444.ok"] == figures["odd.truncated.ok"] == "yes"
    assert figures["odd.progressive.bound"] == "2" and figures["odd.444.bound"] == "none"
    assert figures["failures.fp16_erase.ok"] == "yes" and figures["failures.fp16_erase.dtype"] == "float16"
    for row in ("dali_1_threads", "dali_2_threads", "dali_2_threads_load_0.65"):
        assert figures[f"ceiling.{row}.img_per_s"] > 0 and figures[f"ceiling.{row}.timed_seconds"] >= 0.2
        assert 0 < figures[f"ceiling.{row}.source_share"] < 1 and figures[f"ceiling.{row}.vs_torch"] > 0
        assert figures[f"ceiling.{row}.train_decode"] == "roi"  # the CPU-only mode's choice
        assert 0 < figures[f"ceiling.{row}.batch_ms_p50"] <= figures[f"ceiling.{row}.batch_ms_p99"]
        assert figures[f"ceiling.{row}.batch_ms_p99"] <= figures[f"ceiling.{row}.batch_ms_max"]
        assert figures[f"ceiling.{row}.vs_plain_dali_whole"] > 0
    assert figures["ceiling.dali_2_threads_load_0.65.hw_decoder_load"] == 0.65
    assert figures["ceiling.dali_2_threads.hw_decoder_load"] == 0.99
    for row in ("whole_1_threads_load_0.99", "whole_2_threads_load_0.99", "whole_2_threads_load_0.65"):
        assert figures[f"ceiling.plain_dali_{row}.img_per_s"] > 0
    for load in (0.65, 0.99):  # in their own process, at the top thread count only
        assert figures[f"ceiling.plain_dali_roi_2_threads_load_{load}.img_per_s"] > 0
        assert figures[f"ceiling.plain_dali_roi_2_threads_load_{load}.timed_epochs"] >= 1
    assert (
        figures["ceiling.plain_dali_roi.child_rc"] == 0
        and "ceiling.plain_dali_roi_1_threads_load_0.99.img_per_s" not in figures
    )
    assert figures["ceiling.jpeg_engine"] == figures["ceiling.jpeg_engine_busy"] == "n/a (no GPU)"
    assert figures["ceiling.torch_0_workers.img_per_s"] > 0
    assert figures["models.resnet_tiny.ceiling_img_per_s"] > 0 and figures["models.resnet_tiny.dali_img_per_s"] > 0
    assert figures["models.resnet_tiny.dali.batch_ms_p99"] > 0
    assert (
        figures["controller.batch_sizes"] == "16,8,8,8" and figures["controller.decisions"] == "shrink,hold,hold,hold"
    )
    assert figures["controller.second_shrink"] == "no" and figures["controller.pipelines_built"] == 2
    assert figures["answers.dali_vs_best_plain_dali"].split(" ")[0].replace(".", "").isdigit()
    assert figures["answers.resnet18_vs_resident_ceiling"] == "n/a (the models step left no resnet18 figures)"
    assert figures["answers.corruption"] == "n/a (no GPU)"
    assert figures["answers.crop_window_probe"].startswith("crashed (SIGSEGV, rc -11) (doctor's child)")
    assert figures["answers.load_winning_on_p99"].split(" ")[0] in ("0.65", "0.99")


@pytest.mark.slow
def test_kill_and_resume_step_proves_exactly_once(tmp_path):
    pytest.importorskip("nvidia.dali")
    tiny = "--images 150 --model resnet_tiny --image-size 32 --batch-size 8 --num-workers 0"
    env = {"KILL_RESUME_ARGS": tiny, "DALI_FAST_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = _run("gpu_check/gpu_kill_resume.sh", str(tmp_path / "ck"), env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "killed the run after its first checkpoint" in r.stdout and "resumed from" in r.stdout
    assert "each sample of each epoch exactly once across the kill" in r.stdout
