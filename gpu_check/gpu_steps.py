"""The measuring steps of gpu_check/gpu_check.sh, one subcommand each; every figure is printed as it is
taken, as a line ``FIGURE <key> <value>``, and written to ``--out``/<step>.json at the end.

    python gpu_check/gpu_steps.py data       --out DIR [--images 4096] [--size 500x375] [--quality 95]
    python gpu_check/gpu_steps.py decode     --data PACKED --out DIR [--doctor-json FILE]
    python gpu_check/gpu_steps.py failures   --data PACKED --out DIR
    python gpu_check/gpu_steps.py ceiling    --data PACKED --out DIR [--threads 8,16] [--workers 16]
    python gpu_check/gpu_steps.py models     --data PACKED --out DIR [--models resnet50,resnet18]
    python gpu_check/gpu_steps.py controller --data PACKED --out DIR

Made for one GPU (``--device auto`` takes it); ``--device cpu`` and small sizes run every step on a CPU
(DALI's CPU-only mode) so that the script itself is tested where there is no GPU. What a step cannot
measure on this machine is printed as ``n/a (<why>)``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIGURES: dict[str, Any] = {}
FAILED: list[str] = []  # why the step fails (its figures are all printed first); empty: it passed
OOM_BATCH = 1024  # the out-of-memory check's batch: 1024 x 3 x 224 x 224 float32 is 588 MiB of output


def figure(key: str, value: Any) -> None:
    """Print one figure at once (a step stopped at its time limit keeps what it printed) and keep it."""
    if isinstance(value, float):
        value = round(value, 4 if abs(value) < 10 else 1)
    FIGURES[key] = value
    text = str(value).replace("\n", " ").replace("|", "/")
    print(f"FIGURE {key} {text}", flush=True)


def gpu_wanted(args: argparse.Namespace) -> bool:
    if args.device == "cpu":
        return False
    usable = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not usable:
        sys.exit("--device cuda but CUDA is not usable here")
    return usable


def device_name(gpu: bool) -> str:
    return "cuda" if gpu else "cpu"


def open_nvml(gpu: bool) -> tuple[Any, Any]:
    """(pynvml, handle of this process's CUDA device), or (None, None) where NVML cannot be read."""
    if not gpu:
        return None, None
    try:
        import pynvml

        from dali_fast.machine import nvml_handle

        pynvml.nvmlInit()
        return pynvml, nvml_handle(pynvml, torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001 - NVML missing: those figures read n/a
        print(f"NVML cannot be read: {e}", flush=True)
        return None, None


class EngineSampler:
    """Samples NVML's JPEG-engine and GPU utilization every ``interval`` s in a thread."""

    def __init__(self, nvml: Any, handle: Any, interval: float = 0.05) -> None:
        self.nvml, self.handle, self.interval = nvml, handle, interval
        self.jpeg: list[float] = []
        self.gpu: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EngineSampler:
        if self.nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                util = self.nvml.nvmlDeviceGetJpgUtilization(self.handle)
                self.jpeg.append(float(util[0] if isinstance(util, list | tuple) else util))
            except Exception:  # noqa: BLE001 - no JPEG engine (or not readable): no JPEG figure
                pass
            try:
                self.gpu.append(float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:  # noqa: BLE001
                pass

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self, prefix: str) -> None:
        why = "n/a (no NVML reading)"
        figure(f"{prefix}.jpeg_util_peak", max(self.jpeg) if self.jpeg else why)
        figure(f"{prefix}.jpeg_util_mean", float(np.mean(self.jpeg)) if self.jpeg else why)
        figure(f"{prefix}.gpu_util_mean", float(np.mean(self.gpu)) if self.gpu else why)


def sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


def gib(n: float | None) -> Any:
    return round(n / 2**30, 2) if isinstance(n, int | float) else "n/a"


# --------------------------------------------------------------------------- data
def _make_chunk(job: tuple[str, str, int, int, tuple[int, int], int, int]) -> str:
    """One process's share of the data set: an ImageFolder of photos or of synthetic images."""
    kind, out, images, classes, size, quality, seed = job
    if kind == "photos":
        sys.path.insert(0, str(ROOT / "scripts"))
        from photos import make_photos

        try:
            return str(make_photos(Path(out), images, classes, size, quality, seed))
        except SystemExit as e:  # photos.py's one-line refusals; a worker must raise, not exit
            raise RuntimeError(str(e)) from None
    from dali_fast.data.synthetic import make_synthetic

    return str(make_synthetic(out, images=images, classes=classes, seed=seed, progress=False))


def _make_folder(kind: str, root: Path, args: argparse.Namespace) -> None:
    """``args.images`` images of ``kind`` made by ``args.jobs`` processes, merged into one ImageFolder."""
    width, height = (int(v) for v in args.size.lower().split("x"))
    jobs = max(1, min(args.jobs, args.images // 32 or 1))
    share = [args.images // jobs + (k < args.images % jobs) for k in range(jobs)]
    chunks = [
        (kind, str(root.parent / f"{root.name}.chunk{k}"), n, args.classes, (width, height), args.quality, k)
        for k, n in enumerate(share)
    ]
    for c in chunks:
        shutil.rmtree(c[1], ignore_errors=True)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        made = pool.map(_make_chunk, chunks)
    for k, chunk in enumerate(made):  # class folders merged, file names kept apart
        for f in sorted(Path(chunk).rglob("*.jpg")):
            (root / f.parent.name).mkdir(parents=True, exist_ok=True)
            f.rename(root / f.parent.name / f"{k}_{f.name}")
        shutil.rmtree(chunk)


def step_data(args: argparse.Namespace) -> None:
    """Photographs (scripts/photos.py: scikit-image's sample photos, cut and saved as baseline JPEGs)
    where scikit-image and its sample photos are installed, else the package's synthetic images (about
    as large, but smoother: they decode faster than photos); then packed."""
    from dali_fast import open_dataset, pack

    out = Path(args.out)
    root, packed = out / "images", out / "packed"
    t0 = time.perf_counter()
    source = "photos"
    try:
        import skimage  # noqa: F401 - only to know whether photos.py can run

        shutil.rmtree(root, ignore_errors=True)
        _make_folder("photos", root, args)
    except (ImportError, RuntimeError, OSError) as e:
        source = f"synthetic (no photos: {type(e).__name__}: {str(e)[:80]})"
        shutil.rmtree(root, ignore_errors=True)
        _make_folder("synthetic", root, args)
    shutil.rmtree(packed, ignore_errors=True)
    pack(root, packed, progress=False, verify=False)
    reader = open_dataset(packed)
    sizes = [len(reader[i][0]) for i in range(len(reader))]
    figure("data.source", source)
    figure("data.images", len(reader))
    figure("data.mean_kb", float(np.mean(sizes)) / 1024)
    figure("data.seconds", time.perf_counter() - t0)
    figure("data.packed", str(packed))


# --------------------------------------------------------------------------- doctor
def doctor_figures(path: Path) -> None:
    """The figures of a `dali-fast doctor --json` report."""
    report = json.loads(path.read_text())
    r = report["readings"]
    figure("doctor.problem", report["problem"] or "none: the GPU path works")
    figure("doctor.driver", f"{r['driver']} (CUDA {r['driver_cuda']})")
    for g in r["gpus"]:
        figure(f"doctor.gpu{g['index']}", f"{g['name']}, {g['memory_gib']} GiB, JPEG engine: {g.get('jpeg_engine')}")
    figure("doctor.dali", f"{r['dali']} {r['dali_libs']}")
    for name in ("cpu_decode", "gpu_decode"):
        d = r[name] or {}
        figure(f"doctor.{name}_mean_levels_from_pillow", d.get("mean_diff", d.get("error", "not tried")))
    for k, v in (r["hw_decoder"] or {"tried": "no"}).items():
        figure(f"doctor.hw_decoder.{k}", v)
    pre = r["decoder_preallocation"] or {}
    figure("doctor.decoder_device_padding_mib", round(pre.get("device_total", 0) / 2**20))


# --------------------------------------------------------------------------- decode differences
def _pillow(data: np.ndarray) -> np.ndarray:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes())) as im:
        return np.asarray(im.convert("RGB"))


def _dali_decode(datas: list[np.ndarray], device: str, device_id: int | None, **kw: Any) -> list[np.ndarray]:
    from nvidia.dali import fn, pipeline_def, types

    from dali_fast.loaders.dali_pipeline import shutdown_pipeline

    @pipeline_def(batch_size=len(datas), num_threads=4, device_id=device_id, prefetch_queue_depth=1)
    def pipe():
        jpegs = fn.external_source(source=lambda: datas, batch=True)
        return fn.decoders.image(jpegs, device=device, output_type=types.RGB, **kw)

    p = pipe()
    p.build()
    try:
        (out,) = p.run()
        if device == "mixed":
            out = out.as_cpu()
        return [np.array(out.at(i)) for i in range(len(datas))]
    finally:
        shutdown_pipeline(p)


def _levels(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, int]:
    """(mean, max) absolute difference in pixel levels over all images."""
    diffs = [np.abs(x.astype(np.int16) - y.astype(np.int16)) for x, y in zip(a, b, strict=True)]
    return float(np.mean([d.mean() for d in diffs])), int(max(d.max() for d in diffs))


def step_decode(args: argparse.Namespace) -> None:
    """The doctor's report (``--doctor-json``), then how far the decoders are from Pillow, in pixel levels:
    DALI's CPU decoder, the `mixed` GPU decoder as training uses it (fancy chroma upsampling) and with
    DALI's default; then the whole eval transform, DALIIterator on the GPU against DALIIterator on the CPU."""
    from dali_fast import DALIIterator, open_dataset
    from dali_fast.transforms.recipe import Recipe

    if args.doctor_json is not None:
        doctor_figures(args.doctor_json)
    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    n = min(args.images, len(reader))
    datas = [np.asarray(reader[i][0]) for i in range(n)]
    ref = [_pillow(d) for d in datas]
    cpu = _dali_decode(datas, "cpu", None)
    mean, top = _levels(cpu, ref)
    figure("decode.images", n)
    figure("decode.dali_cpu_vs_pillow.mean_levels", mean)
    figure("decode.dali_cpu_vs_pillow.max_levels", top)
    if not gpu:
        figure("decode.mixed_vs_pillow", "n/a (no GPU)")
        return
    dev = torch.cuda.current_device()
    fancy = _dali_decode(datas, "mixed", dev, jpeg_fancy_upsampling=True)
    default = _dali_decode(datas, "mixed", dev)
    for name, got in (("mixed_fancy", fancy), ("mixed_default", default)):
        mean, top = _levels(got, ref)
        figure(f"decode.{name}_vs_pillow.mean_levels", mean)
        figure(f"decode.{name}_vs_pillow.max_levels", top)
    mean, top = _levels(fancy, cpu)
    figure("decode.mixed_fancy_vs_dali_cpu.mean_levels", mean)
    figure("decode.mixed_fancy_vs_dali_cpu.max_levels", top)
    recipe = Recipe(image_size=args.image_size)
    std = torch.tensor(recipe.std_255).view(1, 3, 1, 1)
    mean_t = torch.tensor(recipe.mean_255).view(1, 3, 1, 1)
    outs = {}
    for device in ("cuda", "cpu"):
        loader = DALIIterator(reader, min(n, 64), train=False, device=device, recipe=recipe)
        xs = []
        for k, (x, _) in enumerate(loader):
            xs.append(x.float().cpu() * std + mean_t)
            if (k + 1) * min(n, 64) >= n:
                break
        loader.close()
        outs[device] = torch.cat(xs)
    d = (outs["cuda"] - outs["cpu"]).abs()
    figure("decode.loader_eval_gpu_vs_cpu.mean_levels", float(d.mean()))
    figure("decode.loader_eval_gpu_vs_cpu.p99_levels", float(torch.quantile(d.flatten()[:1_000_000], 0.99)))


# --------------------------------------------------------------------------- failure paths
def step_failures(args: argparse.Namespace) -> None:
    """float16 output with random erasing on the GPU, then a real DALI out-of-memory, every time: DALI's pool
    released, the GPU filled by torch up to a margin of at most 256 MiB, then a DALIIterator of `OOM_BATCH`
    images (whose output alone is larger) must raise DALIMemoryError, from an error `is_memory_error`
    recognises, and tell its controller. The step fails when any of that does not happen."""
    from dali_fast import BatchSizeController, DALIIterator, open_dataset
    from dali_fast.loaders.dali_iterator import DALIMemoryError, is_memory_error, parse_dali_error
    from dali_fast.loaders.memory_probes import release_unused_memory
    from dali_fast.transforms.draws import sample_erasing_box
    from dali_fast.transforms.recipe import Recipe

    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    S, seed = args.image_size, 3
    recipe = Recipe(image_size=S, dtype=torch.float16, random_erasing=1.0, erasing_scale=(0.05, 0.2))
    loader = DALIIterator(reader, args.batch_size, device=device_name(gpu), seed=seed, recipe=recipe)
    loader.set_epoch(0)
    checked = matched = 0
    try:
        for k, (x, _) in enumerate(loader):
            assert x.dtype == torch.float16, x.dtype
            for img, i in zip(x.float().cpu(), loader.last_indices.tolist(), strict=True):
                top, left, h, w = sample_erasing_box(recipe, seed, 0, i)
                if h:
                    checked += 1
                    matched += bool((img[:, top : top + h, left : left + w] == 0).all())
            if k >= 1:
                break
        figure("failures.fp16_erase.ok", "yes" if checked and matched == checked else f"NO ({matched}/{checked})")
        figure("failures.fp16_erase.dtype", str(x.dtype).replace("torch.", ""))
    except Exception as e:  # noqa: BLE001 - the figure is the failure
        figure("failures.fp16_erase.ok", f"NO: {type(e).__name__}: {str(e)[:300]}")
    finally:
        loader.close()
    if not gpu:
        figure("failures.oom", "n/a (needs a GPU)")
        return

    class Recording(BatchSizeController):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.ooms: list[int] = []

        def report_oom(self, batch_size: int) -> None:
            self.ooms.append(batch_size)
            super().report_oom(batch_size)

    # DALI's pool keeps what the loader above used: back to the device first, or DALI serves the next pipeline
    # from it and the hog below leaves it enough. Then torch takes all but a small margin, and the batch's
    # output alone (OOM_BATCH x 3 x S x S float32) is several times that margin.
    release_unused_memory()
    hog = None
    for margin_mib in (64, 128, 256):
        try:
            hog = torch.empty(torch.cuda.mem_get_info()[0] - margin_mib * 2**20, dtype=torch.uint8, device="cuda")
            break
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    left = torch.cuda.mem_get_info()[0]
    need = OOM_BATCH * 3 * S * S * 4
    figure(
        "failures.oom.free_left_mib", round(left / 2**20) if hog is not None else "n/a (the GPU could not be filled)"
    )
    figure("failures.oom.batch_output_mib", round(need / 2**20))
    ctrl = Recording(64, OOM_BATCH, sync_ranks=False)
    big = DALIIterator(reader, OOM_BATCH, device="cuda", controller=ctrl, image_size=S)
    try:
        big.set_epoch(0)
        for _ in big:
            pass
        figure("failures.oom.recognised", f"NO: not provoked (the epoch ran in the {left / 2**20:.0f} MiB left)")
        FAILED.append("no DALI out-of-memory was provoked")
    except DALIMemoryError as e:
        figure("failures.oom.recognised", "yes: DALIMemoryError")
        figure("failures.oom.message", str(e)[:400])
        figure("failures.oom.dali_says", parse_dali_error(e.__cause__).describe() if e.__cause__ else "n/a")
        told = ctrl.ooms == [OOM_BATCH]
        figure("failures.oom.controller_told", "yes" if told else f"NO ({ctrl.ooms})")
        if not told:
            FAILED.append("the controller was not told of the out-of-memory")
        if not is_memory_error(e.__cause__):
            FAILED.append("DALI's error is not recognised as memory by is_memory_error")
    except Exception as e:  # noqa: BLE001 - anything else is the defect this step looks for
        figure("failures.oom.recognised", f"NO: {type(e).__name__}: {str(e)[:400]}")
        FAILED.append(f"a DALI out-of-memory raised {type(e).__name__}, not DALIMemoryError")
    finally:
        big.close()
        del hog
        release_unused_memory()


# --------------------------------------------------------------------------- the loader's ceiling
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


def run_epochs(loader: Any, first: int, epochs: int, gpu: bool) -> tuple[float, int]:
    """Epochs ``first`` .. ``first + epochs - 1`` of ``loader``, no model: (seconds, images)."""
    t0, images = time.perf_counter(), 0
    for epoch in range(first, first + epochs):
        loader.set_epoch(epoch)
        for _, y in loader:
            images += len(y)
        sync(gpu)
    return time.perf_counter() - t0, images


def step_ceiling(args: argparse.Namespace) -> None:
    """DALIIterator img/s (no model) at each thread count, the share of the wall time spent in the
    external-source callback, the JPEG engine's and the GPU's utilization, and how training decodes; beside
    each, the plain-DALI reference rows on the same images (`gpu_plain_dali`: "whole", the whole-image decode
    on the JPEG engine then `fn.random_resized_crop`; "roi", DALI's crop-window decoder), and TorchIterator
    with ``--workers``. The step fails when the GPU has a JPEG engine and it stayed idle under DALIIterator."""
    from gpu_plain_dali import plain_epochs

    from dali_fast import DALIIterator, TorchIterator, open_dataset
    from dali_fast.transforms.decode_choice import jpeg_engine

    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    folder = args.images_dir or Path(args.data).parent / "images"
    nvml, handle = open_nvml(gpu)
    engine = jpeg_engine(torch.cuda.current_device()) if gpu else None
    figure("ceiling.jpeg_engine", {True: "yes", False: "no", None: "unknown"}[engine] if gpu else "n/a (no GPU)")
    # TorchIterator first: its worker processes fork before any DALI pipeline has run in this process.
    workers = args.workers
    loader = TorchIterator(
        reader, args.batch_size, num_workers=workers, device=device_name(gpu), image_size=args.image_size
    )
    try:
        run_epochs(loader, 0, 1, gpu)  # warm-up: the workers start
        seconds, images = run_epochs(loader, 1, args.epochs, gpu)
    finally:
        if hasattr(loader, "close"):
            loader.close()
    torch_rate = images / seconds
    figure(f"ceiling.torch_{workers}_workers.img_per_s", torch_rate)
    stats = _timed_source()
    idle: list[str] = []
    threads_list = [int(t) for t in args.threads.split(",")]
    for threads in threads_list:
        key = f"ceiling.dali_{threads}_threads"
        loader = DALIIterator(
            reader, args.batch_size, device=device_name(gpu), num_threads=threads, image_size=args.image_size
        )
        figure(f"{key}.train_decode", loader.train_decode)
        try:
            run_epochs(loader, 0, 1, gpu)  # warm-up: the pipeline's build and first fills are not timed
            stats["seconds"], stats["calls"] = 0.0, 0
            with EngineSampler(nvml, handle) as sampler:
                seconds, images = run_epochs(loader, 1, args.epochs, gpu)
        finally:
            loader.close()
        rate = images / seconds
        figure(f"{key}.img_per_s", rate)
        if stats["calls"]:
            figure(f"{key}.source_share", stats["seconds"] / seconds)
            figure(f"{key}.source_ms_per_batch", 1000 * stats["seconds"] / stats["calls"])
        else:
            figure(f"{key}.source_share", "n/a (the source is not called in this process)")
        sampler.report(key)
        if engine and sampler.jpeg and max(sampler.jpeg) == 0:
            idle.append(f"DALIIterator with {threads} threads")
        figure(f"{key}.vs_torch", rate / torch_rate)
        kinds = ("whole", "roi") if threads == threads_list[-1] else ("whole",)
        for kind in kinds:
            ref = f"ceiling.plain_dali_{kind}_{threads}_threads"
            epoch, close = plain_epochs(
                folder,
                kind,
                batch_size=args.batch_size,
                threads=threads,
                size=args.image_size,
                gpu=gpu,
                device_id=torch.cuda.current_device() if gpu else None,
            )
            try:
                epoch()  # warm-up
                t0, images = time.perf_counter(), 0
                with EngineSampler(nvml, handle) as sampler:
                    for _ in range(args.epochs):
                        images += epoch()
                    sync(gpu)
                plain = images / (time.perf_counter() - t0)
            finally:
                close()
            figure(f"{ref}.img_per_s", plain)
            sampler.report(ref)
            if kind == "whole":
                figure(f"{key}.vs_plain_dali_whole", rate / plain)
                if engine and sampler.jpeg and max(sampler.jpeg) == 0:
                    idle.append(f"plain DALI ({kind}) with {threads} threads")
    verdict, failure = engine_verdict(gpu, engine, nvml is not None, idle)
    figure("ceiling.jpeg_engine_busy", verdict)
    if failure is not None:
        FAILED.append(failure)


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


# --------------------------------------------------------------------------- model throughput
def step_models(args: argparse.Namespace) -> None:
    """Each model trained (bf16 autocast on a GPU, channels_last) from DALIIterator, against the same
    model fed one batch already on the device (its ceiling: ``dali_vs_ceiling``, the goal 0.9 or more);
    GPU and JPEG-engine utilization (the engine's over warm-up and timed epochs); memory as NVML sees this
    process against what torch's allocator reserved."""
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
        seconds = images = 0
        engine = EngineSampler(nvml, handle)
        with engine, UtilizationMonitor(interval=0.1, device_index=torch.cuda.current_device() if gpu else 0) as mon:
            try:
                for epoch in range(args.epochs + 1):
                    loader.set_epoch(epoch)
                    t0 = time.perf_counter()
                    n = 0
                    with mon.phase("timed" if epoch else "warmup"):
                        for images_b, labels_b in loader:
                            trainer.step(images_b, labels_b)
                            n += len(labels_b)
                        sync(gpu)
                    if epoch:
                        seconds += time.perf_counter() - t0
                        images += n
            finally:
                loader.close()
        rate = images / seconds
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


# --------------------------------------------------------------------------- the controller
def step_controller(args: argparse.Namespace) -> None:
    """The batch-size controller over three epochs after a forced shrink (an out-of-memory reported in
    the first epoch). Per epoch: its batch size and decision, the peak it read, and the device memory in
    use right after it released the caches (the old pipeline must be gone by then)."""
    from dali_fast import BatchSizeController, DALIIterator, open_dataset
    from dali_fast.loaders.memory_probes import release_unused_memory

    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    at_start: list[int | None] = []

    class Watched(BatchSizeController):
        def begin_epoch(self) -> None:
            super().begin_epoch()
            if gpu:
                free, total = torch.cuda.mem_get_info()
                at_start.append(int(total - free))

    ctrl = Watched(args.batch_size // 4, args.batch_size * 2, sync_ranks=False)
    loader = DALIIterator(reader, args.batch_size, device=device_name(gpu), controller=ctrl, image_size=args.image_size)
    sizes = []
    try:
        for epoch in range(4):
            loader.set_epoch(epoch)
            sizes.append(loader.batch_size)
            for k, _batch in enumerate(loader):
                if epoch == 0 and k == 0:
                    ctrl.report_oom(loader.batch_size)  # the forced shrink
            sync(gpu)
            del _batch  # a batch held over would count in the next epoch's first reading
    finally:
        loader.close()
        release_unused_memory()
    decisions = [h["decision"] for h in ctrl.history]
    figure("controller.batch_sizes", ",".join(map(str, sizes)))
    figure("controller.decisions", ",".join(decisions))
    figure(
        "controller.peaks",
        ",".join(f"{h['peak_fraction']:.3f}" if h["peak_fraction"] is not None else "n/a" for h in ctrl.history),
    )
    figure("controller.pipelines_built", loader.pipelines_built)
    figure("controller.second_shrink", "yes" if "shrink" in decisions[1:] else "no")
    if gpu:  # epochs 0 and 1 start with no pipeline up: the old one must not be counted at epoch 1's start
        figure("controller.used_after_release_gib", ",".join(str(gib(u)) for u in at_start))
        figure("controller.old_pipeline_left_gib", gib(at_start[1] - at_start[0]))


# --------------------------------------------------------------------------- command line
STEPS = {
    "data": step_data,
    "decode": step_decode,
    "failures": step_failures,
    "ceiling": step_ceiling,
    "models": step_models,
    "controller": step_controller,
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--out", type=Path, required=True, help="figures go to OUT/<step>.json (data: the data set too)")
    ap.add_argument("--data", type=Path, help="a packed data set (the data step prints where it made one)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--doctor-json", type=Path, help="decode: the report `dali-fast doctor --json` wrote")
    ap.add_argument(
        "--images-dir", type=Path, help="ceiling: the ImageFolder the plain-DALI rows read (default: DATA/../images)"
    )
    ap.add_argument("--images", type=int, default=4096, help="data: images to make; decode: images to compare")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--size", default="500x375", help="data: WIDTHxHEIGHT of the photos")
    ap.add_argument("--quality", type=int, default=95)
    ap.add_argument("--jobs", type=int, default=8, help="data: processes making photos")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up epoch)")
    ap.add_argument("--threads", default="8,16", help="ceiling: DALI threads to compare")
    ap.add_argument("--workers", type=int, default=16, help="ceiling: TorchIterator's worker processes")
    ap.add_argument("--models", default="resnet50,resnet18")
    ap.add_argument("--steps", type=int, default=30, help="models: timed steps of the on-device ceiling")
    ap.add_argument("--warmup-steps", type=int, default=5)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.step != "data" and (args.data is None or not Path(args.data).exists()):
        ap.error(f"{args.step} needs --data: a packed data set (run the data step first)")
    args.out.mkdir(parents=True, exist_ok=True)
    FIGURES.clear()
    t0 = time.perf_counter()
    FAILED.clear()
    try:
        STEPS[args.step](args)
    finally:
        figure(f"{args.step}.step_seconds", time.perf_counter() - t0)
        (args.out / f"{args.step}.json").write_text(json.dumps(FIGURES, indent=1, default=str))
    if FAILED:
        print(f"{args.step} FAILED: {'; '.join(FAILED)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
