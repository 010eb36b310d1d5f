"""The measuring steps of gpu_check/gpu_check.sh, one subcommand each; every figure is printed as it is
taken, as a line ``FIGURE <key> <value>``, and written to ``--out``/<step>.json at the end.

    python gpu_check/gpu_steps.py data       --out DIR [--images 4096] [--size 500x375] [--odd-share 0.1]
    python gpu_check/gpu_steps.py decode     --data PACKED --out DIR [--doctor-json FILE] [--eval-images 1024]
    python gpu_check/gpu_steps.py odd        --data PACKED --out DIR [--corpus tests/fixtures/odd_jpegs]
    python gpu_check/gpu_steps.py failures   --data PACKED --out DIR
    python gpu_check/gpu_steps.py ceiling    --data PACKED --out DIR [--threads 8,16] [--loads 0.65,0.99]
    python gpu_check/gpu_steps.py models     --data PACKED --out DIR [--models resnet50,resnet18]
    python gpu_check/gpu_steps.py controller --data PACKED --out DIR
    python gpu_check/gpu_steps.py answers    --data PACKED --out DIR   (reads the steps' figures in DIR)

Made for one GPU (``--device auto`` takes it); ``--device cpu`` and small sizes run every step on a CPU
(DALI's CPU-only mode) so that the script itself is tested where there is no GPU. What a step cannot
measure on this machine is printed as ``n/a (<why>)``. The speed steps live in `gpu_speed`, their timing
in `gpu_rows`, the odd JPEGs in `gpu_corpus`, the closing answers in `gpu_answers`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_answers import answers, load_figures  # noqa: E402
from gpu_corpus import corpus_step, make_odd  # noqa: E402
from gpu_figures import FAILED, FIGURES, device_name, figure, gib, gpu_wanted, save  # noqa: E402, F401
from gpu_rows import sync  # noqa: E402
from gpu_speed import engine_verdict, step_ceiling, step_models, step_plain_rows  # noqa: E402, F401

OOM_BATCH = 1024  # the out-of-memory check's batch: 1024 x 3 x 224 x 224 float32 is 588 MiB of output
DEFAULT_CORPUS = ROOT / "tests" / "fixtures" / "odd_jpegs"
FLAT_LEVELS = 1.0  # a GPU image whose pixels vary less than this (std, levels) where the CPU's vary: skipped
CORRUPT_MEAN_LEVELS = 4.0  # an image this far from the CPU's on average (GPU resize/decoder noise: ~0.5)


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
    as large, but smoother: they decode faster than photos); about ``--odd-share`` of them re-encoded as
    progressive, 4:4:4, gray, 2-6 MP or EXIF-rotated (`gpu_corpus.make_odd`); then packed."""
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
    odd = make_odd(root, args.odd_share, args.quality)
    shutil.rmtree(packed, ignore_errors=True)
    pack(root, packed, progress=False, verify=False)
    reader = open_dataset(packed)
    sizes = [len(reader[i][0]) for i in range(len(reader))]
    figure("data.source", source)
    figure("data.images", len(reader))
    figure("data.odd", ", ".join(f"{kind} {n}" for kind, n in odd.items()) or "none")
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
    probe = r.get("decoder_probe") or {}
    for k in ("crop_window", "nvjpeg", "hw_backend", "hw_engines", "hw_cores", "seconds"):
        figure(f"doctor.decoder_probe.{k}", probe.get(k, "not tried (no GPU)"))
    figure("doctor.known_defects", "; ".join(d["ref"] for d in r.get("known_defects") or []) or "none listed")


# --------------------------------------------------------------------------- decode differences
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


def compare_images(gpu: torch.Tensor, cpu: torch.Tensor, names: list[str]) -> dict[str, Any]:
    """GPU against CPU output of the same images (N, C, H, W, in pixel levels): the mean difference, its p99
    over every pixel (read from a histogram, not a first slice), the worst image with its own mean and
    largest difference, the images off the CPU's by more than `CORRUPT_MEAN_LEVELS` on average and those
    that came out flat (std under `FLAT_LEVELS`) where the CPU's vary (an image the decoder skipped)."""
    d = (gpu.float() - cpu.float()).abs()
    per_mean = d.mean(dim=(1, 2, 3))
    per_max = d.amax(dim=(1, 2, 3))
    hist = torch.bincount(d.round().clamp(max=255).to(torch.int64).flatten(), minlength=256)
    p99 = int(torch.searchsorted(hist.cumsum(0), 0.99 * d.numel()).item())
    worst = int(per_mean.argmax())
    flat = (gpu.float().std(dim=(1, 2, 3)) < FLAT_LEVELS) & (cpu.float().std(dim=(1, 2, 3)) >= 4 * FLAT_LEVELS)
    off = per_mean > CORRUPT_MEAN_LEVELS
    bad = [names[i] for i in torch.nonzero(off | flat).flatten().tolist()]
    return {
        "images": len(names),
        "mean_levels": float(d.mean()),
        "p99_levels": p99,
        "worst_image": f"{names[worst]}: mean {float(per_mean[worst]):.2f}, max {float(per_max[worst]):.0f} levels",
        "flat_images": int(flat.sum()),
        "corrupt": bad,
    }


def step_decode(args: argparse.Namespace) -> None:
    """The doctor's report (``--doctor-json``), then how far the decoders are from Pillow, in pixel levels:
    DALI's CPU decoder, the `mixed` GPU decoder as training uses it (fancy chroma upsampling) and with
    DALI's default; then the whole eval transform, DALIIterator on the GPU against DALIIterator on the CPU,
    over ``--eval-images`` (`compare_images`). The step fails when a GPU image is off the CPU's or flat."""
    from gpu_corpus import pillow_rgb

    from dali_fast import DALIIterator, open_dataset
    from dali_fast.transforms.recipe import Recipe

    if args.doctor_json is not None:
        doctor_figures(args.doctor_json)
    gpu = gpu_wanted(args)
    reader = open_dataset(args.data)
    n = min(args.images, len(reader))
    datas = [np.asarray(reader[i][0]) for i in range(n)]
    ref = [pillow_rgb(d.tobytes()) for d in datas]
    cpu = _dali_decode(datas, "cpu", None)
    mean, top = _levels(cpu, ref)
    figure("decode.images", n)
    figure("decode.dali_cpu_vs_pillow.mean_levels", mean)
    figure("decode.dali_cpu_vs_pillow.max_levels", top)
    if not gpu:
        figure("decode.mixed_vs_pillow", "n/a (no GPU)")
        figure("decode.corrupt_images", "n/a (no GPU)")
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
    m = min(args.eval_images, len(reader))
    outs = {}
    for device in ("cuda", "cpu"):
        loader = DALIIterator(reader, 128, train=False, device=device, recipe=recipe)
        xs, got = [], 0
        for x, _ in loader:
            xs.append(x.float().cpu() * std + mean_t)
            got += len(x)
            if got >= m:
                break
        loader.close()
        outs[device] = torch.cat(xs)[:m]
    found = compare_images(outs["cuda"], outs["cpu"], [f"{i} ({reader.source(i)})" for i in range(m)])
    for k in ("images", "mean_levels", "p99_levels", "worst_image", "flat_images"):
        figure(f"decode.loader_eval_gpu_vs_cpu.{k}", found[k])
    figure("decode.corrupt_images", len(found["corrupt"]))
    if found["corrupt"]:
        figure("decode.corrupt_examples", "; ".join(found["corrupt"][:5]))
        FAILED.append(f"{len(found['corrupt'])} GPU images are off the CPU's or flat, e.g. {found['corrupt'][0]}")


# --------------------------------------------------------------------------- the odd-JPEG corpus
def step_odd(args: argparse.Namespace) -> None:
    """The odd-JPEG corpus (``--corpus``: images and manifest.json) decoded alone each by `mixed` (or DALI's
    CPU decoder without a GPU) and compared with Pillow per kind (`gpu_corpus.corpus_step`)."""
    gpu = gpu_wanted(args)
    corpus_step(args.corpus, gpu, torch.cuda.current_device() if gpu else None, figure, FAILED)


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


# --------------------------------------------------------------------------- the answers
def step_answers(args: argparse.Namespace) -> None:
    """The answers summary.md ends with (`gpu_answers`), from the figures the other steps wrote in ``--out``."""
    for key, value in answers(load_figures(args.out)).items():
        figure(f"answers.{key}", value)


# --------------------------------------------------------------------------- command line
STEPS = {
    "data": step_data,
    "decode": step_decode,
    "odd": step_odd,
    "failures": step_failures,
    "ceiling": step_ceiling,
    "plain-rows": step_plain_rows,
    "models": step_models,
    "controller": step_controller,
    "answers": step_answers,
}
NEEDS_NO_DATA = ("data", "odd", "answers")


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
    ap.add_argument("--eval-images", type=int, default=1024, help="decode: images of the GPU-vs-CPU eval comparison")
    ap.add_argument("--odd-share", type=float, default=0.1, help="data: share of progressive/4:4:4/gray/2-6 MP/EXIF")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="odd: a folder of images and manifest.json")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--size", default="500x375", help="data: WIDTHxHEIGHT of the photos")
    ap.add_argument("--quality", type=int, default=95)
    ap.add_argument("--jobs", type=int, default=8, help="data: processes making photos")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=1, help="ceiling, models: fewest timed epochs (after a warm-up)")
    ap.add_argument("--min-seconds", type=float, default=3.0, help="ceiling, models: shortest timed window")
    ap.add_argument("--threads", default="8,16", help="ceiling: DALI threads to compare")
    ap.add_argument("--loads", default="0.65,0.99", help="ceiling: hw_decoder_load values of the top-thread rows")
    ap.add_argument("--kind", choices=("whole", "roi"), default="roi", help="plain-rows: the plain-DALI pipeline")
    ap.add_argument("--workers", type=int, default=16, help="ceiling: TorchIterator's worker processes")
    ap.add_argument("--models", default="resnet50,resnet18")
    ap.add_argument("--steps", type=int, default=30, help="models: timed steps of the on-device ceiling")
    ap.add_argument("--warmup-steps", type=int, default=5)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.step not in NEEDS_NO_DATA and (args.data is None or not Path(args.data).exists()):
        ap.error(f"{args.step} needs --data: a packed data set (run the data step first)")
    args.out.mkdir(parents=True, exist_ok=True)
    FIGURES.clear()
    t0 = time.perf_counter()
    FAILED.clear()
    try:
        STEPS[args.step](args)
    finally:
        figure(f"{args.step}.step_seconds", time.perf_counter() - t0)
        save(args.out, args.step)
    if FAILED:
        print(f"{args.step} FAILED: {'; '.join(FAILED)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
