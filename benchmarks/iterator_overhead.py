"""Is the external source the bottleneck? DALI's own file reader vs DALIIterator's feeds, side by side.

    pip install scikit-image      # the photos extra (benchmarks/photos.py makes the default data)
    python benchmarks/iterator_overhead.py [--data FOLDER] [--images 400] [--rounds 5] [--batch-size 64] [--rss-epochs 30]

Rows (images/s over full epochs, all in this one run, the same operators after the source):
  (a) DALI fn.readers.file over the ImageFolder                            (the reference)
  (b) DALIIterator over the ImageFolder (each batch's files read by the reader threads)
  (c) DALIIterator over the packed data set (memory-mapped)
  (d) DALIIterator over the packed data set with a warm LRU cache

The data are real photos (benchmarks/photos.py: 470x370, quality 90, as the speed facts use), or
``--data`` (an ImageFolder). Every row runs one warm-up epoch, then one epoch per round, rows alternating
(each round starts at the next row), so drift of the machine's speed falls on every row alike; the table
gives each row's median over the rounds and its ratio to row (a). ``--rss-epochs N`` then runs rows
(b)-(d) N more epochs each and prints the process's resident memory and threads: flat when nothing grows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dali_fast import DALIIterator, open_dataset, pack
from dali_fast.pipeline import augment, default_num_threads
from dali_fast.recipe import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from photos import make_photos  # noqa: E402 - a sibling script


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=None, help="an ImageFolder (default: real photos, made here)")
    ap.add_argument("--images", type=int, default=400, help="photos to make when --data is not given")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument(
        "--rss-epochs",
        type=int,
        default=0,
        help="then run each DALIIterator row this many epochs, printing the process's resident memory and thread count",
    )
    args = ap.parse_args()
    threads = default_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or make_photos(Path(tmp) / "photos", args.images, 10, (470, 370), 90, 0)
        packed = Path(tmp) / "packed"
        pack(root, packed, progress=False, verify=False)
        n = len(open_dataset(root))
        kb = open_dataset(packed).data_size / n / 1024
        print(
            f"{n} images ({kb:.0f} KB each on average), batch {args.batch_size}, {args.image_size}px, "
            f"{threads} threads, {'GPU' if torch.cuda.is_available() else 'CPU-only'} mode, {os.cpu_count()} cpus"
        )
        folder_epoch, folder_loader = iterator_epochs(open_dataset(root), args, threads)
        packed_epoch, packed_loader = iterator_epochs(open_dataset(packed), args, threads)
        cached_epoch, cached_loader = iterator_epochs(open_dataset(packed), args, threads, 2**31)
        rows = {
            "(a) DALI fn.readers.file": file_reader_epochs(root, args, threads),
            "(b) DALIIterator, ImageFolder": folder_epoch,
            "(c) DALIIterator, packed": packed_epoch,
            "(d) DALIIterator, packed + LRU": cached_epoch,
        }
        names = list(rows)
        for run in rows.values():  # warm-up: page cache, pipelines, the LRU cache
            assert run() == n
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                got = rows[name]()
                times[name].append(time.perf_counter() - t0)
                assert got == n, (name, got)
        print(f"    cache: {cached_loader.cache_stats()}")
        rate = {name: n / statistics.median(ts) for name, ts in times.items()}
        ref = rate[names[0]]
        print(f"\nmedian of {args.rounds} rounds, rows alternating in one process\n")
        print("| feed | img/s | x (a) |\n|---|---:|---:|")
        for name, value in rate.items():
            print(f"| {name} | {value:.0f} | {value / ref:.2f} |")
        if args.rss_epochs:
            print(f"\nresident memory over {args.rss_epochs} more epochs of each row, one row after the other\n")
            print(
                "| feed | RSS after its 1st | after its last | highest | threads 1st / last |\n|---|---:|---:|---:|---:|"
            )
            for name in names[1:]:
                rss, threads_seen = [], []
                for _ in range(args.rss_epochs):
                    assert rows[name]() == n
                    rss.append(resident_mib())
                    threads_seen.append(threading.active_count())
                print(
                    f"| {name} | {rss[0]:.0f} MiB | {rss[-1]:.0f} MiB | {max(rss):.0f} MiB | "
                    f"{threads_seen[0]} / {threads_seen[-1]} |"
                )
        for loader in (folder_loader, packed_loader, cached_loader):
            loader.close()


def resident_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    main()
