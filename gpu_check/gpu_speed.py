"""gpu_check's speed steps: the loader's ceiling (DALIIterator without a model, beside the plain-DALI
pipelines a DALI user would write and TorchIterator) and the models fed by DALIIterator against their
resident-batch ceilings. Every row is timed by `gpu_rows`: a warm-up epoch, then a window of at least
``--min-seconds`` (and ``--epochs``), batch times p50/p99/max from ``next()``, the JPEG engine's use.

The plain-DALI crop-window rows run in a process of their own (``gpu_steps.py plain-rows``), after the
engine verdict and ``ceiling.json`` are written: nvImageCodec 0.9.0 crashes in that decoder on some GPUs
(NVIDIA/nvImageCodec#55), and a crash there must not take the step's answers with it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_figures import FAILED, FIGURES, device_name, figure, gib, gpu_wanted, open_nvml, save
from gpu_rows import BatchTimes, EngineSampler, engine_eligible_share, loader_epoch, sync, timed_window

ADAPTIVE_LOAD = (
    "n/a (DALI 2.4.0 has no adaptive setting: it passes hw_decoder_load to nvImageCodec with the FIXED "
    "load-hint policy; nvImageCodec's ADAPTIVE_MINIMIZE_IDLE_TIME is not reachable from DALI)"
)


@contextlib.contextmanager
def hw_load_env(load: float | None) -> Iterator[None]:
    """DALIIterator's ``hw_decoder_load`` for the rows built inside (None: the loader's own default)."""
    from dali_fast.transforms.mixed_decoder import HW_DECODER_LOAD_ENV

    old = os.environ.get(HW_DECODER_LOAD_ENV)
    if load is None:
        os.environ.pop(HW_DECODER_LOAD_ENV, None)
    else:
        os.environ[HW_DECODER_LOAD_ENV] = str(load)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(HW_DECODER_LOAD_ENV, None)
        else:
            os.environ[HW_DECODER_LOAD_ENV] = old


def report_row(key: str, seconds: float, times: BatchTimes, epochs: int, sampler: EngineSampler | None) -> float:
    """A row's figures: img/s, its timed window, batch times, and the engine's use; returns the img/s."""
    rate = times.images / seconds
    figure(f"{key}.img_per_s", rate)
    figure(f"{key}.timed_seconds", seconds)
    figure(f"{key}.timed_epochs", epochs)
    for name, value in times.stats().items():
        figure(f"{key}.{name}", value)
    if sampler is not None:
        for name, value in sampler.figures().items():
            figure(f"{key}.{name}", value)
    return rate


def _timed_source() -> dict[str, float]:
    """Time every call of the external source (the callback DALI runs on the training thread)."""
    from dali_fast.loaders.dali_pipeline import BatchSource

    stats = {"seconds": 0.0, "calls": 0}
    real = BatchSource.__call__
    if getattr(real, "_timed", False):
        return real._stats  # type: ignore[attr-defined]

    @functools.wraps(real)
    def timed(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            stats["seconds"] += time.perf_counter() - t0
            stats["calls"] += 1

    timed._timed, timed._stats = True, stats  # type: ignore[attr-defined]
    BatchSource.__call__ = timed  # type: ignore[method-assign]
    return stats


def _load_key(load: float | None) -> str:
    return "" if load is None else f"_load_{load}"


def plain_row(args: argparse.Namespace, kind: str, threads: int, load: float, nvml: Any, handle: Any) -> EngineSampler:
    """One plain-DALI row (`gpu_plain_dali`) over the data's ImageFolder; returns its engine sampler."""
    from gpu_plain_dali import plain_epochs

    gpu = gpu_wanted(args)
    folder = args.images_dir or Path(args.data).parent / "images"
    key = f"ceiling.plain_dali_{kind}_{threads}_threads_load_{load}"
    epoch, close = plain_epochs(
        folder,
        kind,
        batch_size=args.batch_size,
        threads=threads,
        size=args.image_size,
        gpu=gpu,
        device_id=torch.cuda.current_device() if gpu else None,
        hw_load=load,
    )
    try:
        epoch(0, BatchTimes())  # warm-up
        with EngineSampler(nvml, handle) as sampler:
            seconds, times, epochs = timed_window(epoch, gpu=gpu, min_epochs=args.epochs, min_seconds=args.min_seconds)
    finally:
        close()
    report_row(key, seconds, times, epochs, sampler)
    return sampler


def step_plain_rows(args: argparse.Namespace) -> None:
    """The plain-DALI rows of ``--kind`` at the top thread count, one per load in ``--loads`` (the ceiling
    step runs the crop-window ones here, in a process of their own)."""
    gpu = gpu_wanted(args)
    nvml, handle = open_nvml(gpu)
    threads = int(args.threads.split(",")[-1])
    for load in (float(x) for x in args.loads.split(",")):
        plain_row(args, args.kind, threads, load, nvml, handle)


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def crop_window_command(args: argparse.Namespace, threads: int) -> list[str]:
    """The child that runs the plain-DALI crop-window rows (`step_plain_rows`) with this step's sizes."""
    here = Path(__file__).resolve().parent
    cmd = [sys.executable, str(here / "gpu_steps.py"), "plain-rows", "--kind", "roi", "--data", str(args.data)]
    cmd += ["--out", str(args.out), "--device", args.device, "--threads", str(threads), "--loads", args.loads]
    cmd += ["--batch-size", str(args.batch_size), "--image-size", str(args.image_size), "--epochs", str(args.epochs)]
    cmd += ["--min-seconds", str(args.min_seconds)]
    if args.images_dir is not None:
        cmd += ["--images-dir", str(args.images_dir)]
    return cmd


def crop_window_rows(threads: int, loads: list[float], command: list[str]) -> None:
    """Run the plain-DALI crop-window rows in a child (``command``), relaying its figures as they come; a
    row the child did not finish reads "n/a (crashed, rc N)" (a signal) or "n/a (failed, rc N)"."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in child.stdout or ():
        if line.startswith("FIGURE ceiling."):
            _, key, text = (line.rstrip("\n").split(" ", 2) + [""])[:3]
            figure(key, _value(text))
        else:
            print(f"crop-window child: {line}", end="", flush=True)
    rc = child.wait()
    how = "crashed" if rc < 0 or rc >= 128 else "failed"
    for load in loads:
        key = f"ceiling.plain_dali_roi_{threads}_threads_load_{load}.img_per_s"
        if rc != 0 and key not in FIGURES:
            figure(key, f"n/a ({how}, rc {rc})")
    figure("ceiling.plain_dali_roi.child_rc", rc)


def step_ceiling(args: argparse.Namespace) -> None:
    """DALIIterator img/s (no model) at each thread count and, at the top count, at each ``--loads`` value;
    the plain-DALI rows on the same images (`gpu_plain_dali`: "whole" at each thread count and load, then
    "roi", the crop-window decoder, in a child); TorchIterator with ``--workers``. Per row: batch times, the
    JPEG engine's and the GPU's utilization; for DALIIterator the external-source callback's share. The step
    fails when the GPU has a JPEG engine and it stayed idle under a whole-image row."""
    from dali_fast import DALIIterator, TorchIterator, open_dataset
    from dali_fast.transforms.decode_choice import jpeg_engine
    from dali_fast.transforms.mixed_decoder import HW_DECODER_LOAD

    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    nvml, handle = open_nvml(gpu)
    engine = jpeg_engine(torch.cuda.current_device()) if gpu else None
    figure("ceiling.jpeg_engine", {True: "yes", False: "no", None: "unknown"}[engine] if gpu else "n/a (no GPU)")
    if gpu:
        try:
            datas = [bytes(reader[i][0]) for i in range(len(reader))]
            share, refused = engine_eligible_share(datas, torch.cuda.current_device())
            figure("ceiling.engine_eligible_share", f"{share:.3f} ({refused} of {len(datas)} refused by the engine)")
        except Exception as e:  # noqa: BLE001 - nvImageCodec's Python API missing or failing: no figure
            figure("ceiling.engine_eligible_share", f"n/a ({type(e).__name__}: {str(e)[:120]})")
    else:
        figure("ceiling.engine_eligible_share", "n/a (no GPU)")
    window = {"gpu": gpu, "min_epochs": args.epochs, "min_seconds": args.min_seconds}
    loads = [float(x) for x in args.loads.split(",")]
    # TorchIterator first: its worker processes fork before any DALI pipeline has run in this process.
    loader = TorchIterator(
        reader, args.batch_size, num_workers=args.workers, device=device_name(gpu), image_size=args.image_size
    )
    try:
        loader_epoch(loader)(0, BatchTimes())  # warm-up: the workers start
        seconds, times, epochs = timed_window(loader_epoch(loader), **window)
    finally:
        loader.close()
    torch_rate = report_row(f"ceiling.torch_{args.workers}_workers", seconds, times, epochs, None)
    stats = _timed_source()
    idle: list[str] = []
    threads_list = [int(t) for t in args.threads.split(",")]
    top = threads_list[-1]
    rows: list[tuple[int, float | None]] = [(t, None) for t in threads_list]
    rows += [(top, load) for load in loads if load != HW_DECODER_LOAD]
    for threads, load in rows:
        key = f"ceiling.dali_{threads}_threads{_load_key(load)}"
        with hw_load_env(load):
            loader = DALIIterator(
                reader, args.batch_size, device=device_name(gpu), num_threads=threads, image_size=args.image_size
            )
            figure(f"{key}.train_decode", loader.train_decode)
            figure(f"{key}.hw_decoder_load", HW_DECODER_LOAD if load is None else load)
            try:
                loader_epoch(loader)(0, BatchTimes())  # warm-up: the pipeline's build and first fills
                stats["seconds"], stats["calls"] = 0.0, 0
                with EngineSampler(nvml, handle) as sampler:
                    seconds, times, epochs = timed_window(loader_epoch(loader), **window)
            finally:
                loader.close()
        rate = report_row(key, seconds, times, epochs, sampler)
        if stats["calls"]:
            figure(f"{key}.source_share", stats["seconds"] / seconds)
            figure(f"{key}.source_ms_per_batch", 1000 * stats["seconds"] / stats["calls"])
        else:
            figure(f"{key}.source_share", "n/a (the source is not called in this process)")
        if engine and sampler.idle():
            idle.append(f"DALIIterator with {threads} threads")
        figure(f"{key}.vs_torch", rate / torch_rate)
    for threads, load in rows:
        plain_load = HW_DECODER_LOAD if load is None else load
        sampler = plain_row(args, "whole", threads, plain_load, nvml, handle)
        if engine and sampler.idle():
            idle.append(f"plain DALI (whole) with {threads} threads at load {plain_load}")
        mine = f"ceiling.dali_{threads}_threads{_load_key(load)}"
        plain = FIGURES[f"ceiling.plain_dali_whole_{threads}_threads_load_{plain_load}.img_per_s"]
        figure(f"{mine}.vs_plain_dali_whole", FIGURES[f"{mine}.img_per_s"] / plain)
    verdict, failure = engine_verdict(gpu, engine, nvml is not None, idle)
    figure("ceiling.jpeg_engine_busy", verdict)
    if failure is not None:
        FAILED.append(failure)
    figure("ceiling.adaptive_load", ADAPTIVE_LOAD)
    save(args.out, "ceiling")  # the verdict is kept whatever the crop-window rows do
    crop_window_rows(top, loads, crop_window_command(args, top))


def engine_verdict(gpu: bool, engine: bool | None, sampled: bool, idle: list[str]) -> tuple[str, str | None]:
    """(the figure, why the step fails or None): it fails when the GPU has a JPEG engine, NVML was read,
    and the engine stayed idle (0 % at every sample) under one of the rows named in ``idle``."""
    if not gpu:
        return "n/a (no GPU)", None
    if engine is not True:
        return ("n/a (no JPEG engine)" if engine is False else "n/a (NVML cannot tell)"), None
    if not sampled:
        return "n/a (no NVML reading)", None
    if idle:
        return f"NO: idle under {', '.join(idle)}", f"the JPEG engine stayed idle under {', '.join(idle)}"
    return "yes", None


def training_epoch(loader: Any, trainer: Any) -> Any:
    """One epoch of training ``trainer`` from ``loader``, each ``next()`` (the wait for data) timed."""

    def run(number: int, times: BatchTimes) -> None:
        loader.set_epoch(number)
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                images, labels = next(it)
            except StopIteration:
                return
            times.times.append(time.perf_counter() - t0)
            times.images += len(labels)
            trainer.step(images, labels)

    return run


def step_models(args: argparse.Namespace) -> None:
    """Each model trained (bf16 autocast on a GPU, channels_last) from DALIIterator over a timed window,
    against the same model fed one batch already on the device (its ceiling: ``dali_vs_ceiling``, the goal
    0.9 or more); the loader's batch times (the ``next()`` the training step waited for), GPU and JPEG-engine
    utilization, memory as NVML sees this process against what torch's allocator reserved."""
    from dali_fast import DALIIterator, open_dataset
    from dali_fast.train.monitor import UtilizationMonitor
    from dali_fast.train.trainer import Trainer

    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    nvml, handle = open_nvml(gpu)
    classes = len(reader.classes)
    S, bs = args.image_size, args.batch_size
    for name in args.models.split(","):
        key = f"models.{name}"
        trainer = Trainer(name, classes)
        figure(f"{key}.precision", str(trainer.amp_dtype).replace("torch.", "") if trainer.amp else "float32")
        x = torch.randn(bs, 3, S, S, device=trainer.device)
        if gpu:  # as the model takes it (DALI's channels_last output is a view, no copy): the ceiling has no copy
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, classes, (bs,), device=trainer.device)
        for _ in range(args.warmup_steps):  # cudnn picks its kernels for this shape
            trainer.step(x, y)
        sync(gpu)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.step(x, y)
        sync(gpu)
        ceiling = args.steps * bs / (time.perf_counter() - t0)
        figure(f"{key}.ceiling_img_per_s", ceiling)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        fmt = torch.channels_last if gpu else torch.contiguous_format
        loader = DALIIterator(reader, bs, device=device_name(gpu), image_size=S, memory_format=fmt, drop_last=True)
        figure(f"{key}.train_decode", loader.train_decode)

        train = training_epoch(loader, trainer)
        engine = EngineSampler(nvml, handle)
        with engine, UtilizationMonitor(interval=0.1, device_index=torch.cuda.current_device() if gpu else 0) as mon:
            try:
                with mon.phase("warmup"):
                    train(0, BatchTimes())
                    sync(gpu)
                with mon.phase("timed"):
                    seconds, times, epochs = timed_window(
                        train, gpu=gpu, min_epochs=args.epochs, min_seconds=args.min_seconds
                    )
            finally:
                loader.close()
        rate = report_row(f"{key}.dali", seconds, times, epochs, None)
        util = mon.summary("timed")
        figure(f"{key}.dali_img_per_s", rate)
        figure(f"{key}.dali_vs_ceiling", rate / ceiling)
        figure(f"{key}.{util['kind']}_util_mean", util["mean"])
        figure(f"{key}.jpeg_util_mean", float(np.mean(engine.jpeg)) if engine.jpeg else "n/a (no NVML reading)")
        if gpu:
            figure(f"{key}.nvml_used_gib", gib(util["peak_mem"]))
            figure(f"{key}.torch_reserved_gib", gib(torch.cuda.max_memory_reserved()))
        del trainer, x, y
        if gpu:
            torch.cuda.empty_cache()
