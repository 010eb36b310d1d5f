"""The feed alone: records/s of the external source that DALI calls on the training thread.

    pip install scikit-image      # the photos extra: real photographs, nothing downloaded
    python benchmarks/feed.py [--images 2000] [--batch-size 256] [--rounds 5] [--keep DIR] [--profile]

What is timed is only the callable DALIIterator hands to ``fn.external_source`` (reads, checks, labels,
erasing boxes), called until it raises StopIteration, as DALI calls it: no decoding, no pipeline. The data
are real photos of ImageNet size (scripts/photos.py, 640x480, quality 95: about 100 KB each) in four
forms: a packed set, the ImageFolder itself, WebDataset shards of the same files, and the packed set behind
a warm LRU cache. The ImageFolder and WebDataset rows are compared with reading the same bytes with a pool
of threads and doing nothing else (their targets: within 2x of that). Every row runs once per round, rows
alternating in one process, after one untimed warm-up epoch each (the page cache is warm: this measures
the feed's own cost, not the disk); the table gives the median of the rounds.

Then the feed inside DALI: DALIIterator in CPU-only mode over the packed set, decoding and cropping to
``--image-size`` on ``--dali-threads`` threads, at each of ``--dali-batch-sizes``; per record, the CPU time
of the training thread (``time.thread_time``, not wall time: on a busy machine wall time counts DALI's own
threads) spent in the source callable, and in the callable plus DALI's own feeding of what it returned
(``Pipeline._iter_setup``: checks, wrapping, and the copy unless the source's arrays are taken in place). One
warm-up epoch, then one timed epoch per round: the steady state, page faults of the map excluded.

``--profile`` runs one epoch of each row under cProfile and prints where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import io
import os
import pstats
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np

import dali_fast
from dali_fast import open_dataset, pack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from photos import make_photos  # noqa: E402 - scripts/photos.py

SIZE, QUALITY = (640, 480), 95  # about 100 KB per photo, as ImageNet's training JPEGs (110 KB on average)
SHARD_RECORDS = 500


def write_shards(folder: Path, out: Path) -> None:
    """The ImageFolder's files as WebDataset shards (key.jpg + key.cls), in the folder's order."""
    out.mkdir()
    reader = open_dataset(folder)
    files = [Path(reader.source(i)) for i in range(len(reader))]
    labels = reader.labels.tolist()
    for s in range(0, len(files), SHARD_RECORDS):
        with tarfile.open(out / f"train-{s // SHARD_RECORDS:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for k in range(s, min(s + SHARD_RECORDS, len(files))):
                for ext, data in (("jpg", files[k].read_bytes()), ("cls", str(labels[k]).encode())):
                    info = tarfile.TarInfo(f"s{k:07d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def prepare(work: Path, images: int) -> dict[str, Path]:
    paths = {"folder": work / "photos", "packed": work / "packed", "shards": work / "shards"}
    if not paths["folder"].exists():
        make_photos(paths["folder"], images, 10, SIZE, QUALITY, 0)
    if not paths["packed"].exists():
        pack(paths["folder"], paths["packed"], progress=False)
    if not paths["shards"].exists():
        write_shards(paths["folder"], paths["shards"])
    return paths


def plans(n: int, batch: int, epochs: int) -> list[list[np.ndarray]]:
    """Each epoch's shuffled index batches, as the sampler makes them."""
    out = []
    for e in range(epochs):
        order = np.random.default_rng(e).permutation(n)
        out.append([order[i : i + batch] for i in range(0, n, batch)])
    return out


def load_package(folder: Path, name: str = "dali_fast_compared") -> ModuleType:
    """The dali_fast package in ``folder`` (another revision of it), imported under another name beside
    this one: its modules import each other relatively, so they stay within that copy."""
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _module(package: ModuleType, *names: str) -> ModuleType:
    """``package``'s module of the first of ``names`` that it has (this revision's, or an older one's)."""
    for name in names[:-1]:
        try:
            return importlib.import_module(f"{package.__name__}.{name}")
        except ImportError:
            continue
    return importlib.import_module(f"{package.__name__}.{names[-1]}")


def source_rows(package: ModuleType, paths: dict[str, Path], batch: int, cache_bytes: int) -> dict[str, Callable]:
    """One epoch of each source, through ``package``'s DALIIterator wiring (its reader, cache, erasing
    boxes and BatchSource), as a function of the epoch's plan."""
    iterator = _module(package, "loaders.dali_iterator", "iterator")
    pipeline = _module(package, "loaders.dali_pipeline", "pipeline")
    skips = _module(package, "loaders.base", "pipeline")  # SkipLog's home
    recipe = _module(package, "transforms.recipe", "recipe")
    packed = package.open_dataset(paths["packed"])

    def dali(reader, **kw):
        return iterator.DALIIterator(reader, batch, device="cpu", **kw)

    loaders = {
        "packed": dali(packed),
        "packed + erasing boxes": dali(packed, recipe=recipe.Recipe(random_erasing=0.25)),
        "packed + LRU cache (warm)": dali(packed, cache_bytes=cache_bytes),
        "ImageFolder": dali(package.open_dataset(paths["folder"])),
        "WebDataset shards": dali(package.open_dataset(paths["shards"])),
    }

    def epoch(loader, plan: list[np.ndarray]) -> int:
        """One epoch through the loader's external source, wired as DALIIterator wires it."""
        boxes = loader._boxes()  # noqa: SLF001
        source = pipeline.BatchSource(loader.dataset, plan, loader.on_error, skips.SkipLog(), boxes=boxes)
        n = 0
        try:
            while True:
                out = source()  # the images (a TensorList), or a tuple of them and more outputs
                n += len(out[0] if isinstance(out, tuple) else out)
                source.consume()
        except StopIteration:
            pass
        return n

    return {name: (lambda plan, lo=lo: epoch(lo, plan)) for name, lo in loaders.items()}


class InsideDali:
    """Per record, the training thread's CPU time in ``package``'s source callable and in DALI's feeding of
    it (`Pipeline._iter_setup`, which calls the callable), over one epoch of a DALIIterator in CPU mode."""

    def __init__(self, package: ModuleType, packed: Path, batch: int, image_size: int, threads: int) -> None:
        self.package, self.packed, self.batch = package, packed, batch
        self.image_size, self.threads = image_size, threads
        self.pipeline = _module(package, "loaders.dali_pipeline", "pipeline")

    def epoch(self) -> tuple[float, float]:
        """(callable µs/record, callable + DALI's feed µs/record) of the epoch after a warm-up epoch."""
        from nvidia.dali.pipeline import Pipeline

        spent = {"call": 0.0, "feed": 0.0}
        source_cls, real_call, real_setup = (
            self.pipeline.BatchSource,
            self.pipeline.BatchSource.__call__,
            Pipeline._iter_setup,
        )

        def call(source: object) -> tuple:
            t0 = time.thread_time()
            try:
                return real_call(source)
            finally:
                spent["call"] += time.thread_time() - t0

        def setup(pipe: Pipeline) -> None:
            t0 = time.thread_time()
            try:
                real_setup(pipe)
            finally:
                spent["feed"] += time.thread_time() - t0

        loader = self.package.DALIIterator(
            self.package.open_dataset(self.packed), self.batch, device="cpu", num_threads=self.threads,
            image_size=self.image_size,
        )  # fmt: skip
        source_cls.__call__, Pipeline._iter_setup = call, setup
        try:
            for epoch in (0, 1):
                spent["call"] = spent["feed"] = 0.0
                loader.set_epoch(epoch)
                n = sum(len(labels) for _, labels in loader)
        finally:
            source_cls.__call__, Pipeline._iter_setup = real_call, real_setup
            loader.close()
        return 1e6 * spent["call"] / n, 1e6 * spent["feed"] / n


def inside_dali_table(args: argparse.Namespace, packed: Path, compared: ModuleType | None) -> None:
    """The feed inside DALI at each batch size, this revision (and ``compared``), medians of the rounds."""
    sizes = [int(b) for b in args.dali_batch_sizes.split(",") if b]
    if not sizes:
        return
    revisions = {"this revision": dali_fast, **({args.compare_with.parent.name: compared} if compared else {})}
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):  # revisions and batch sizes alternate within each round
        for name, package in revisions.items():
            for batch in sizes:
                row = InsideDali(package, packed, batch, args.image_size, args.dali_threads)
                got.setdefault((name, batch), []).append(row.epoch())
    print(
        f"\nthe feed inside DALI: the training thread's CPU time per record (time.thread_time), DALIIterator in "
        f"CPU-only mode, {args.dali_threads} threads, {args.image_size}px; median of {args.rounds} rounds\n"
    )
    print("| revision | batch | in the source callable, µs | callable + DALI's feed, µs |\n|---|---:|---:|---:|")
    for (name, batch), values in got.items():
        call = statistics.median(v[0] for v in values)
        feed = statistics.median(v[1] for v in values)
        print(f"| {name} | {batch} | {call:.1f} | {feed:.1f} |")


def pool_epoch(pool: ThreadPoolExecutor, read: Callable[[int], bytes], plan: list[np.ndarray]) -> int:
    """The target: the same records' bytes read by a thread pool, batch by batch, and nothing else (each
    batch split into one run of reads per thread, so the pool's own cost is per run, not per file)."""

    def run(indices: list[int]) -> list[bytes]:
        return [read(i) for i in indices]

    n, threads = 0, pool._max_workers  # noqa: SLF001
    for batch in plan:
        items = batch.tolist()
        step = -(-len(items) // threads)
        runs = [pool.submit(run, items[k : k + step]) for k in range(0, len(items), step)]
        n += sum(len(r.result()) for r in runs)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8, help="threads of the reference thread-pool reads")
    ap.add_argument("--keep", type=Path, default=None, help="make (or reuse) the data here instead of a temp dir")
    ap.add_argument("--profile", action="store_true", help="one epoch of each row under cProfile")
    ap.add_argument(
        "--dali-batch-sizes",
        default="64,256",
        help="the feed inside DALI at these batch sizes (comma-separated; empty: not measured)",
    )
    ap.add_argument("--dali-threads", type=int, default=2, help="DALI threads of the inside-DALI rows")
    ap.add_argument("--image-size", type=int, default=224, help="the crop size of the inside-DALI rows")
    ap.add_argument(
        "--compare-with",
        type=Path,
        default=None,
        help="a dali_fast package folder of another revision (git archive REV dali_fast | tar -x -C DIR; "
        "pass DIR/dali_fast): every source row runs with both, alternating, and the table gives the ratio",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("DALI_FAST_CACHE", str(work / "cache"))
        paths = prepare(work, args.images)
        packed, folder, shards = (open_dataset(paths[k]) for k in ("packed", "folder", "shards"))
        n = len(packed)
        mb = packed.data_size / n / 1e6  # MB per record
        print(f"{n} photos {SIZE[0]}x{SIZE[1]} q{QUALITY}, {mb * 1000:.0f} KB each on average; batch {args.batch_size}")
        cache_bytes = 2 * packed.data_size + 2**20
        rows = source_rows(dali_fast, paths, args.batch_size, cache_bytes)
        names = list(rows)
        before = load_package(args.compare_with) if args.compare_with else None
        compared = before and source_rows(before, paths, args.batch_size, cache_bytes)
        if compared:
            rows.update({f"{name} [compared]": run for name, run in compared.items()})
        files = [folder.source(i) for i in range(len(folder))]
        members = [shards.member(i) for i in range(len(shards))]  # (file, offset, size)
        pool = ThreadPoolExecutor(args.threads)

        def read_file(i: int) -> bytes:
            with open(files[i], "rb", buffering=0) as f:
                return f.readall()

        fds = {p: os.open(p, os.O_RDONLY) for p in {m[0] for m in members}}

        def read_member(i: int) -> bytes:
            path, offset, size = members[i]
            return os.pread(fds[path], size, offset)

        targets = {
            "ImageFolder": f"ImageFolder files read by {args.threads} threads (target)",
            "WebDataset shards": f"WebDataset members read by {args.threads} threads (target)",
        }
        rows[targets["ImageFolder"]] = lambda plan: pool_epoch(pool, read_file, plan)
        rows[targets["WebDataset shards"]] = lambda plan: pool_epoch(pool, read_member, plan)
        epoch_plans = plans(n, args.batch_size, args.rounds + 1)
        for run in rows.values():  # warm-up: page cache, the LRU cache, lazy maps and pools
            assert run(epoch_plans[0]) == n
        if args.profile:
            for name, run in rows.items():
                prof = cProfile.Profile()
                prof.enable()
                run(epoch_plans[0])
                prof.disable()
                print(f"\n## {name}: one epoch under cProfile (top 12 by own time)\n")
                stats = pstats.Stats(prof, stream=sys.stdout)
                stats.sort_stats("tottime").print_stats(12)
        times: dict[str, list[float]] = {name: [] for name in rows}
        for r in range(args.rounds):
            for name, run in rows.items():
                t0 = time.perf_counter()
                got = run(epoch_plans[r + 1])
                times[name].append(time.perf_counter() - t0)
                assert got == n, (name, got)
        rate = {name: n / statistics.median(ts) for name, ts in times.items()}
        print(f"\nmedian of {args.rounds} rounds, rows alternating in one process\n")
        head = "| source | records/s | µs/record | MB/s | x target |"
        if compared:
            head += f" records/s, {args.compare_with.parent.name} | x that |"
        print(head + "\n|---|" + "---:|" * (head.count("|") - 2))
        for name in names + list(targets.values()):
            value = rate[name]
            ratio = f"{value / rate[targets[name]]:.2f}" if name in targets else "-"
            line = f"| {name} | {value:,.0f} | {1e6 / value:.1f} | {value * mb:,.0f} | {ratio} |"
            if compared:
                other = rate.get(f"{name} [compared]")
                line += f" {other:,.0f} | {value / other:.1f} |" if other else " - | - |"
            print(line)
        pool.shutdown()
        for fd in fds.values():
            os.close(fd)
        inside_dali_table(args, paths["packed"], before)


if __name__ == "__main__":
    main()
