"""Is the external source the bottleneck? DALI's own file reader vs DALIIterator's feeds, side by side.

    python benchmarks/iterator_overhead.py [--images 600] [--epochs 2] [--batch-size 64] [--image-size 224]

Rows (images/s over full epochs, after one warm-up epoch each, all in this one run):
  (a) DALI fn.readers.file over the ImageFolder, the same operators        (the reference)
  (b) DALIIterator over the ImageFolder (files read on demand)
  (c) DALIIterator over the packed data set (memory-mapped)
  (d) DALIIterator over the packed data set with a warm LRU cache
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from dali_fast import DALIIterator, open_dataset, pack
from dali_fast.pipeline import augment, default_num_threads
from dali_fast.recipe import Recipe
from dali_fast.synthetic import make_synthetic


def time_epochs(run_epoch, epochs: int) -> float:
    run_epoch()  # warm-up
    t0 = time.perf_counter()
    n = sum(run_epoch() for _ in range(epochs))
    return n / (time.perf_counter() - t0)


def file_reader_rate(root: Path, args, threads: int) -> float:
    import nvidia.dali.fn as fn
    from nvidia.dali import pipeline_def
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    gpu = torch.cuda.is_available()

    @pipeline_def(batch_size=args.batch_size, num_threads=threads, device_id=0 if gpu else None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="files")
        images = augment(jpegs, train=True, recipe=Recipe(image_size=args.image_size), gpu=gpu, num_threads=threads)
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="files", last_batch_policy=LastBatchPolicy.PARTIAL)

    def epoch() -> int:
        n = sum(int(b[0]["labels"].shape[0]) for b in it)
        it.reset()
        return n

    return time_epochs(epoch, args.epochs)


def iterator_rate(dataset, args, threads: int, cache_bytes: int = 0) -> float:
    loader = DALIIterator(
        dataset, args.batch_size, image_size=args.image_size, num_threads=threads, cache_bytes=cache_bytes
    )
    state = {"epoch": 0}

    def epoch() -> int:
        loader.set_epoch(state["epoch"])
        state["epoch"] += 1
        return sum(int(labels.shape[0]) for _, labels in loader)

    rate = time_epochs(epoch, args.epochs)
    if cache_bytes:
        print(f"    cache: {loader.cache_stats()}")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--data", type=Path, default=None, help="an ImageFolder (default: a synthetic one)")
    args = ap.parse_args()
    threads = default_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or make_synthetic(Path(tmp) / "images", images=args.images, classes=10)
        packed = Path(tmp) / "packed"
        pack(root, packed, progress=False, verify=False)
        n = len(open_dataset(root))
        print(
            f"{n} images, batch {args.batch_size}, {args.image_size}px, {threads} threads, "
            f"{'GPU' if torch.cuda.is_available() else 'CPU-only'} mode, {os.cpu_count()} cpus"
        )
        rows = [("(a) DALI fn.readers.file", file_reader_rate(root, args, threads))]
        rows.append(("(b) DALIIterator, ImageFolder", iterator_rate(open_dataset(root), args, threads)))
        rows.append(("(c) DALIIterator, packed", iterator_rate(open_dataset(packed), args, threads)))
        rows.append(("(d) DALIIterator, packed + LRU", iterator_rate(open_dataset(packed), args, threads, 2**31)))
        ref = rows[0][1]
        print("\n| feed | img/s | x (a) |\n|---|---:|---:|")
        for name, rate in rows:
            print(f"| {name} | {rate:.0f} | {rate / ref:.2f} |")


if __name__ == "__main__":
    main()
