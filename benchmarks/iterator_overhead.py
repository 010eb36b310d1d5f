"""Is the external source the bottleneck? DALI's own file reader vs DALIIterator's feeds, side by side.

    pip install scikit-image      # the photos extra (scripts/photos.py makes the default data)
    python benchmarks/iterator_overhead.py [--data FOLDER] [--images 400] [--rounds 5] [--epochs 3] [--rss-epochs 30]
                                           [--rows pabcde] [--compare-with OTHER_REVISION/dali_fast]

Rows (images/s over full epochs, all in this one run):
  (p) the plain DALI pipeline a user would write: fn.readers.file -> decoders.image_random_crop -> resize
      -> crop_mirror_normalize, read through DALIGenericIterator                (the reference)
  (a) DALI fn.readers.file over the ImageFolder, then this project's graph (`augment`): what is left between
      it and (p) is the graph's cost; between it and (b)-(d), the feed's
  (b) DALIIterator over the ImageFolder (each batch's files read by the reader threads)
  (c) DALIIterator over the packed data set (memory-mapped)
  (d) DALIIterator over the packed data set with a warm LRU cache
  (e) a bare external source: the same operators fed the images' bytes from memory by a trivial callable
      (the floor of any external source: what is left between it and (a) is DALI's, not the feed's)
Rows (a)-(e) run the same operators after the source (`augment`).

The data are real photos (scripts/photos.py: 470x370, quality 90, as the speed facts use), or
``--data`` (an ImageFolder); ``--rows`` picks rows by letter (``p`` always). Each row runs in a process of
its own (as a training process would: DALI pipelines sharing one process were seen to change each other's
cost), one warm-up epoch then ``--epochs`` timed epochs, and the rows alternate over ``--rounds`` rounds
(each round starts at the next row), so drift of the machine's speed falls on every row alike. The table
gives each row's median img/s and its ratios to rows (p) and (a), and the CPU time its process spent per
image (all threads: decoding and feeding; steadier than wall time on a shared machine) and its ratio to
(p)'s; **cores** is the CPU time over the wall time (near the thread count when nothing else ran; far
below it, the machine was shared and the row's img/s says less). ``--rss-epochs N`` then runs every row N
more epochs and prints its process's resident memory and Python threads: flat when nothing grows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import dali_fast
from dali_fast import DALIIterator, open_dataset, pack
from dali_fast.transforms.dali import augment
from dali_fast.transforms.mixed_decoder import default_num_threads
from dali_fast.transforms.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from photos import make_photos  # noqa: E402 - scripts/photos.py


def file_reader_epochs(root: Path, args, threads: int) -> Callable[[], int]:
    import nvidia.dali.fn as fn
    from nvidia.dali import pipeline_def
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    gpu = torch.cuda.is_available()

    @pipeline_def(batch_size=args.batch_size, num_threads=threads, device_id=0 if gpu else None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="files")
        recipe = Recipe(image_size=args.image_size)
        return augment(jpegs, train=True, recipe=recipe, gpu=gpu, num_threads=threads), labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="files", last_batch_policy=LastBatchPolicy.PARTIAL)

    def epoch() -> int:
        n = sum(int(b[0]["labels"].shape[0]) for b in it)
        it.reset()
        return n

    return epoch


def plain_epochs(root: Path, args, threads: int) -> Callable[[], int]:
    """Row (p): the pipeline a DALI user would write, not this project's graph: ``fn.readers.file`` →
    ``decoders.image_random_crop`` → ``resize`` → ``crop_mirror_normalize`` with DALI's defaults (the same
    crop rule, bilinear, flip and ImageNet normalization), read through ``DALIGenericIterator``."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    gpu = torch.cuda.is_available()
    size = args.image_size

    @pipeline_def(batch_size=args.batch_size, num_threads=threads, device_id=0 if gpu else None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=(size, size),
            mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
            std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="files", last_batch_policy=LastBatchPolicy.PARTIAL)

    def epoch() -> int:
        n = sum(int(b[0]["labels"].shape[0]) for b in it)
        it.reset()
        return n

    return epoch


def bare_source_epochs(root: Path, args, threads: int) -> Callable[[], int]:
    """Row (e): the images' bytes in memory, handed out by a trivial batch callable, shuffled per epoch."""
    import numpy as np
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    folder = open_dataset(root)
    data = [np.fromfile(folder.source(i), np.uint8) for i in range(len(folder))]
    labels = folder.labels
    state = {"epoch": 0, "at": 0, "order": np.arange(len(data))}

    def source():
        at = state["at"]
        if at >= len(data):
            raise StopIteration
        state["at"] = at + args.batch_size
        batch = state["order"][at : at + args.batch_size]
        return [data[i] for i in batch], labels[batch]

    gpu = torch.cuda.is_available()

    @pipeline_def(batch_size=args.batch_size, num_threads=threads, device_id=0 if gpu else None, seed=0)
    def pipe():
        jpegs, y = fn.external_source(source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
        recipe = Recipe(image_size=args.image_size)
        return augment(jpegs, train=True, recipe=recipe, gpu=gpu, num_threads=threads), y

    p = pipe()
    p.build()
    it = DALIGenericIterator(
        p, ["images", "labels"], auto_reset=False, prepare_first_batch=False, last_batch_policy=LastBatchPolicy.PARTIAL
    )

    def epoch() -> int:
        n = sum(int(b[0]["labels"].shape[0]) for b in it)
        state["epoch"] += 1
        state["at"], state["order"] = 0, np.random.default_rng(state["epoch"]).permutation(len(data))
        it.reset()
        return n

    return epoch


def iterator_epochs(dataset, args, threads: int, cache_bytes: int = 0) -> tuple[Callable[[], int], DALIIterator]:
    loader = DALIIterator(
        dataset, args.batch_size, image_size=args.image_size, num_threads=threads, cache_bytes=cache_bytes
    )
    state = {"epoch": 0}

    def epoch() -> int:
        loader.set_epoch(state["epoch"])
        state["epoch"] += 1
        return sum(int(labels.shape[0]) for _, labels in loader)

    return epoch, loader


ROWS = {
    "p": "(p) plain DALI pipeline",
    "a": "(a) DALI fn.readers.file",
    "b": "(b) DALIIterator, ImageFolder",
    "c": "(c) DALIIterator, packed",
    "d": "(d) DALIIterator, packed + LRU",
    "e": "(e) bare external source",
}


def run_row(args) -> None:
    """In a process of its own: one row's pipeline, a warm-up epoch, ``--epochs`` timed epochs, then
    ``--rss-epochs`` more; prints one JSON line."""
    threads = default_num_threads()
    if args.row == "p":
        run = plain_epochs(args.data, args, threads)
    elif args.row == "a":
        run = file_reader_epochs(args.data, args, threads)
    elif args.row == "e":
        run = bare_source_epochs(args.data, args, threads)
    else:
        dataset = open_dataset(args.data if args.row == "b" else args.packed)
        run, _ = iterator_epochs(dataset, args, threads, 2**31 if args.row == "d" else 0)
    n = run()  # warm-up: page cache, the pipeline, the LRU cache
    t0, c0 = time.perf_counter(), time.process_time()
    images = sum(run() for _ in range(args.epochs))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss, threads_seen = [], []
    for _ in range(args.rss_epochs):
        assert run() == n
        rss.append(resident_mib())
        threads_seen.append(threading.active_count())
    package = str(Path(dali_fast.__file__).parent)
    print(
        json.dumps(
            {"images": images, "seconds": seconds, "cpu": cpu, "rss": rss, "threads": threads_seen, "package": package}
        )
    )


def row_in_a_process(
    row: str, root: Path, packed: Path, args, rss_epochs: int = 0, package: Path | None = None
) -> dict:
    """Run one row in a child process (through the dali_fast package folder ``package`` when given)."""
    argv = [sys.executable, __file__, "--row", row, "--data", str(root), "--packed", str(packed)]
    argv += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--image-size", str(args.image_size)]
    argv += ["--rss-epochs", str(rss_epochs)]
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = str(package.resolve().parent)
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        sys.exit(f"row {ROWS[row]} failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert package is None or Path(got["package"]) == package.resolve(), got["package"]  # it ran the other revision
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=None, help="an ImageFolder (default: real photos, made here)")
    ap.add_argument("--images", type=int, default=400, help="photos to make when --data is not given")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per row and round")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument(
        "--rss-epochs",
        type=int,
        default=0,
        help="then run each row this many epochs in a process of its own, printing its resident memory and threads",
    )
    ap.add_argument(
        "--compare-with",
        type=Path,
        default=None,
        help="a dali_fast package folder of another revision (git archive REV dali_fast | tar -x -C DIR; pass "
        "DIR/dali_fast): rows (b)-(d) also run through it, in the same rounds",
    )
    ap.add_argument("--rows", default="".join(ROWS), help="the rows to run, by letter (default: all)")
    ap.add_argument("--row", choices=sorted(ROWS), help=argparse.SUPPRESS)  # one row, in a child process
    ap.add_argument("--packed", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        run_row(args)
        return
    unknown = set(args.rows) - set(ROWS)
    if unknown or "p" not in args.rows:
        ap.error(f"--rows {args.rows}: letters of {''.join(ROWS)}, with p (the reference)")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or make_photos(Path(tmp) / "photos", args.images, 10, (470, 370), 90, 0)
        packed = Path(tmp) / "packed"
        pack(root, packed, progress=False, verify=False)
        n = len(open_dataset(root))
        kb = open_dataset(packed).data_size / n / 1024
        print(
            f"{n} images ({kb:.0f} KB each on average), batch {args.batch_size}, {args.image_size}px, "
            f"{default_num_threads()} threads, {'GPU' if torch.cuda.is_available() else 'CPU-only'} mode, "
            f"{os.cpu_count()} cpus"
        )
        rows = [row for row in ROWS if row in args.rows]
        names = rows + ([f"{row}*" for row in "bcd" if row in rows] if args.compare_with else [])
        label = {**ROWS, **{f"{row}*": f"{ROWS[row]} [compared]" for row in "bcd"}}
        rate: dict[str, list[float]] = {row: [] for row in names}
        cost: dict[str, list[float]] = {row: [] for row in names}
        busy: dict[str, list[float]] = {row: [] for row in names}
        for r in range(args.rounds):
            for row in names[r % len(names) :] + names[: r % len(names)]:
                other = args.compare_with if row.endswith("*") else None
                got = row_in_a_process(row.rstrip("*"), root, packed, args, package=other)
                assert got["images"] == n * args.epochs, (row, got)
                rate[row].append(got["images"] / got["seconds"])
                cost[row].append(1000 * got["cpu"] / got["images"])
                busy[row].append(got["cpu"] / got["seconds"])
        speed = {row: statistics.median(v) for row, v in rate.items()}
        ms = {row: statistics.median(v) for row, v in cost.items()}
        cores = {row: statistics.median(v) for row, v in busy.items()}
        print(
            f"\nmedian of {args.rounds} rounds of {args.epochs} epochs; each row in a process of its own, rows alternating\n"
        )
        with_a = "a" in speed  # (a): the same reference reader, this project's graph
        head = "| feed | img/s | x (p) |" + (" x (a) |" if with_a else "") + " CPU ms/img | (p)'s CPU / this | cores |"
        print(head + "\n|---|" + "---:|" * (head.count("|") - 2))
        for row in names:
            vs_a = f" {speed[row] / speed['a']:.2f} |" if with_a else ""
            print(
                f"| {label[row]} | {speed[row]:.0f} | {speed[row] / speed['p']:.2f} |{vs_a} {ms[row]:.2f} | "
                f"{ms['p'] / ms[row]:.2f} | {cores[row]:.2f} |"
            )
        if args.rss_epochs:
            print(f"\nresident memory over {args.rss_epochs} more epochs, each row in a process of its own\n")
            print("| feed | RSS after its 1st | after its 10th | after its last | threads 1st / last |")
            print("|---|---:|---:|---:|---:|")
            for row in rows:
                got = row_in_a_process(row, root, packed, args, args.rss_epochs)
                rss, seen = got["rss"], got["threads"]
                print(
                    f"| {ROWS[row]} | {rss[0]:.0f} MiB | {rss[min(9, len(rss) - 1)]:.0f} MiB | {rss[-1]:.0f} MiB | "
                    f"{seen[0]} / {seen[-1]} |"
                )


def resident_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    main()
