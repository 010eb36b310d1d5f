"""Where a CPU loader's time goes: images/s, CPU ms per image in the main process and in the workers, and
the main process's page faults per image, row beside row in one run.

    python benchmarks/torch_cpu.py DATASET [--rounds 5] [--epochs 2] [--batch-size 32] [--workers 2]
                                           [--image-size 224] [--loaders baseline,torch,torch:uint8,limit]
                                           [--compare-with OTHER_REVISION/dali_fast]

Rows: the plain DataLoader baseline, `TorchIterator` (``torch``; ``torch:uint8`` with ``dtype=torch.uint8``)
and ``limit`` (bench's ceiling: every record read and decoded whole, in ``--workers`` processes; a row's
img/s over it is bench's "of limit") as ``--loaders`` names them, and with ``--compare-with`` the
`TorchIterator` of another revision (``git archive REV dali_fast | tar -x -C DIR``; pass DIR/dali_fast).
Each row lives in a Python process of its own, made once and warmed up by one epoch (the default
training recipe: random-resized crop, flip, normalize), with ``--workers`` decode processes. Then the rows
take turns, ``--epochs`` timed epochs each per round, so a machine whose load changes slows every row
alike. Per row, the medians over the rounds of: images/s; CPU ms per image of the row's main process and
of its workers (from /proc, so Linux only); minor page faults per image in the main process; and how busy
the row kept the cpus (all its CPU time over wall time x cpus). A row at 100 % busy is bound by its CPU
cost per image, so the CPU columns say what a change saved and where.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, minor faults) of a process, from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[7])


def _children() -> set[int]:
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def _workers_cpu() -> tuple[dict[int, float], float]:
    """CPU seconds of each live child, and of all reaped children so far."""
    live = {pid: s[0] for pid in _children() if (s := _stat(pid)) is not None}
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return live, reaped.ru_utime + reaped.ru_stime


def serve(kind: str, dataset: str, batch_size: int, workers: int, image_size: int) -> None:
    """A row's process: builds the loader, warms it up, then runs one timed epoch per "epoch" line on stdin."""
    import torch

    import dali_fast
    from dali_fast import open_dataset
    from dali_fast.loaders.factory import make_loader

    reader = open_dataset(dataset)
    if kind == "limit":
        from dali_fast.tools.bench_rows import limit_row

        loader = limit_row(reader, workers=workers, batch_size=batch_size, monitor=None, progress=False).loader
    else:
        backend, _, dtype = kind.partition(":")
        kw = {"dtype": getattr(torch, dtype)} if dtype else {}
        loader = make_loader(
            reader, batch_size, backend=backend, train=True, image_size=image_size, num_workers=workers, **kw
        )
    epoch = 0

    def run() -> int:
        nonlocal epoch
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        epoch += 1
        if kind == "limit":
            return sum(loader)  # each batch: how many records it decoded
        return sum(len(labels) for _, labels in loader)

    run()  # warm-up: workers started, caches filled
    print(json.dumps({"ready": True, "package": str(Path(dali_fast.__file__).parent)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "epoch":
            break
        live0, reaped0 = _workers_cpu()
        main0, faults0 = _stat(os.getpid())  # type: ignore[misc]
        t0 = time.perf_counter()
        images = run()
        seconds = time.perf_counter() - t0
        main1, faults1 = _stat(os.getpid())  # type: ignore[misc]
        live1, reaped1 = _workers_cpu()
        # live at both ends: the difference; ended meanwhile: all its CPU (in the reaped total) less its start
        workers_cpu = sum(c - live0.get(pid, 0.0) for pid, c in live1.items()) + (reaped1 - reaped0)
        workers_cpu -= sum(c for pid, c in live0.items() if pid not in live1)
        got = {"images": images, "seconds": seconds, "main_cpu": main1 - main0, "workers_cpu": workers_cpu}
        got["main_faults"] = faults1 - faults0
        print(json.dumps(got), flush=True)
    if hasattr(loader, "close"):
        loader.close()


class Row:
    """A row's process, started and warmed up."""

    def __init__(self, name: str, kind: str, args: argparse.Namespace, package: Path | None = None) -> None:
        self.name = name
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, str(args.dataset)]
        argv += ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
        argv += ["--image-size", str(args.image_size)]
        env = dict(os.environ)
        if package is not None:
            env["PYTHONPATH"] = str(package.resolve().parent)
        # a neutral working folder: this checkout's own dali_fast must not shadow the compared one
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        hello = json.loads(self._line())
        if package is not None and Path(hello["package"]) != package.resolve():
            sys.exit(f"row {name} ran {hello['package']}, not {package}")
        self.results: list[dict] = []

    def _line(self) -> str:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            sys.exit(f"row {self.name} ended early (exit {self.proc.wait()})")
        return line

    def epoch(self) -> dict:
        self.proc.stdin.write("epoch\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        got = json.loads(self._line())
        self.results.append(got)
        return got

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", nargs="?")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per row and round")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--loaders", default="baseline,torch")
    ap.add_argument("--compare-with", type=Path, default=None, help="another revision's dali_fast folder")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: a row's process
    args = ap.parse_args()
    if args.dataset is None:
        ap.error("DATASET is required")
    if args.serve:
        serve(args.serve, args.dataset, args.batch_size, args.workers, args.image_size)
        return
    specs = [(kind, kind, None) for kind in args.loaders.split(",")]
    if args.compare_with is not None:
        specs.append(("torch [compared]", "torch", args.compare_with))
    rows = [Row(name, kind, args, package) for name, kind, package in specs]
    try:
        for r in range(args.rounds):
            for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                got = [row.epoch() for _ in range(args.epochs)]
                row.results[-args.epochs :] = [
                    {k: sum(g[k] for g in got) for k in ("images", "seconds", "main_cpu", "workers_cpu", "main_faults")}
                ]
    finally:
        for row in rows:
            row.close()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(
        f"{args.dataset}: {args.rounds} rounds x {args.epochs} epochs per row, batch {args.batch_size}, "
        f"{args.image_size} px, {args.workers} workers, {cpus} cpus; medians over the rounds\n"
    )
    print(
        "| loader | img/s | x first row | main CPU ms/img | workers CPU ms/img | total CPU ms/img | "
        "main page faults/img | busy % |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    for row in rows:
        res = row.results

        def med(f, res=res) -> float:
            return statistics.median(f(x) for x in res)

        speed = med(lambda x: x["images"] / x["seconds"])
        first = first or speed
        main_ms, work_ms = (
            med(lambda x: 1e3 * x["main_cpu"] / x["images"]),
            med(lambda x: 1e3 * x["workers_cpu"] / x["images"]),
        )
        total = med(lambda x: 1e3 * (x["main_cpu"] + x["workers_cpu"]) / x["images"])
        faults = med(lambda x: x["main_faults"] / x["images"])
        busy = med(lambda x: 100 * (x["main_cpu"] + x["workers_cpu"]) / (x["seconds"] * cpus))
        print(
            f"| {row.name} | {speed:.0f} | {speed / first:.2f}x | {main_ms:.3f} | {work_ms:.3f} | {total:.3f} | "
            f"{faults:.1f} | {busy:.0f} |"
        )


if __name__ == "__main__":
    main()
