"""Memory of each loader's processes over many epochs: does a decode worker's resident set stay flat?

    python benchmarks/worker_rss.py DATASET [--epochs 30] [--loaders baseline,torch,dali] [--workers 2]
                                            [--batch-size 32] [--image-size 224] [--augment POLICY] [--eval]
                                            [--json OUT.json]

Each loader runs in a fresh Python process of its own (so the main process's figure is that loader's
alone): ``--epochs`` training epochs (random-resized-crop, flip, normalize) over DATASET (an ImageFolder
or a packed set), with ``--workers`` decode processes for the DataLoader-based loaders and as many
threads for DALI. After each epoch it reads, from /proc, the resident set (RSS) of the main process
and of each of its worker processes, and their private memory (USS: pages no other process maps).

The table shows each process's RSS after epoch 1, the largest RSS over the first ten epochs and over
the last ten, and the growth from epoch 1 and from the first ten to the last ten (a batch in flight
more or less moves a single reading; the maxima of ten readings do not). RSS of workers includes pages they share with the main
process (torch's libraries, the shared batch memory), so USS is shown beside it. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def proc_kib(pid: int, key: str, path: str = "status") -> int | None:
    """A kB field of /proc/PID/status (``VmRSS``) or /proc/PID/smaps_rollup (``Private_Dirty``...)."""
    try:
        with open(f"/proc/{pid}/{path}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (every thread's children), sorted."""
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(x) for x in f.read().split())
        except OSError:
            continue
    return sorted(out)


def memory(pid: int) -> dict[str, float]:
    """RSS and USS (private clean + dirty) of ``pid`` in MiB."""
    rss = proc_kib(pid, "VmRSS") or 0
    private = sum(proc_kib(pid, k, "smaps_rollup") or 0 for k in ("Private_Clean", "Private_Dirty"))
    return {"rss": rss * 1024 / MIB, "uss": private * 1024 / MIB}


def run_one(
    kind: str, dataset: str, epochs: int, workers: int, batch_size: int, image_size: int, augment: str, train: bool
) -> dict:
    """Run ``epochs`` epochs of one loader in this process; memory of the process tree after each."""
    from dali_fast.data.open import open_dataset
    from dali_fast.loaders.factory import make_loader
    from dali_fast.transforms.recipe import Recipe

    reader = open_dataset(dataset)
    recipe = Recipe(image_size=image_size, auto_augment=None if augment == "none" else augment)
    loader = make_loader(
        reader, batch_size, backend=kind, train=train, image_size=image_size, num_workers=workers, seed=0, recipe=recipe
    )
    me = os.getpid()
    per_epoch = []
    t0 = time.perf_counter()
    try:
        for epoch in range(epochs):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            elif hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            n = sum(len(labels) for _, labels in loader)
            kids = children(me)
            per_epoch.append(
                {
                    "epoch": epoch + 1,
                    "images": n,
                    "main": memory(me),
                    "workers": {str(k): memory(k) for k in kids},
                }
            )
    finally:
        if hasattr(loader, "close"):
            loader.close()
        else:
            from dali_fast.loaders.dataloader import shutdown_workers

            shutdown_workers(loader)
    return {"loader": kind, "seconds": time.perf_counter() - t0, "epochs": per_epoch}


def table(results: list[dict]) -> str:
    """One row per process: RSS (USS) after epoch 1, the largest over the first and the last ten epochs."""
    lines = [
        "| loader | process | epoch 1 RSS (USS) | max, epochs 1-10 | max, last 10 epochs | growth since epoch 1 "
        "| growth, first to last 10 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['loader']} | failed: {r['error']} | | | | | |")
            continue
        eps = r["epochs"]
        first, last = eps[: min(10, len(eps))], eps[-min(10, len(eps)) :]
        procs = [("main", lambda e: e["main"])]
        for k, pid in enumerate(eps[-1]["workers"]):
            procs.append((f"worker {k}", lambda e, pid=pid: e["workers"].get(pid)))
        for name, get in procs:

            def peak(window, get=get):
                seen = [m for m in (get(e) for e in window) if m is not None]
                return (max(m["rss"] for m in seen), max(m["uss"] for m in seen)) if seen else None

            one, early, late = get(eps[0]), peak(first), peak(last)
            cells = ["-" if one is None else f"{one['rss']:.0f} ({one['uss']:.0f})"]
            cells += ["-" if p is None else f"{p[0]:.0f} ({p[1]:.0f})" for p in (early, late)]
            since = "-" if one is None or late is None else f"{late[0] - one['rss']:+.0f} MiB"
            growth = "-" if early is None or late is None else f"{late[0] - early[0]:+.0f} MiB"
            lines.append(f"| {r['loader']} | {name} | {' | '.join(cells)} | {since} | {growth} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--loaders", default="baseline,torch,dali")
    ap.add_argument("--workers", type=int, default=2, help="decode processes (DALI: threads); default 2")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--augment", default="none", help="automatic augmentation (randaugment, trivialaugment...)")
    ap.add_argument("--eval", action="store_true", help="the evaluation transform (resize, centre crop)")
    ap.add_argument("--json", type=Path, help="also write every epoch's figures here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one loader in this process, print JSON
    a = ap.parse_args()
    if a.one:
        args = (a.one, a.dataset, a.epochs, a.workers, a.batch_size, a.image_size, a.augment, not a.eval)
        print(json.dumps(run_one(*args)))
        return
    results = []
    for kind in [k.strip() for k in a.loaders.split(",") if k.strip()]:
        cmd = [sys.executable, __file__, a.dataset, "--one", kind, "--epochs", str(a.epochs)]
        cmd += ["--workers", str(a.workers), "--batch-size", str(a.batch_size), "--image-size", str(a.image_size)]
        cmd += ["--augment", a.augment] + (["--eval"] if a.eval else [])
        print(f"{kind}: {a.epochs} epochs ...", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            why = (p.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"loader": kind, "error": f"exit {p.returncode}: {why}"})
            continue
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(
        f"RSS and (USS) in MiB of each process after epochs; {a.epochs} epochs of {a.dataset}, "
        f"{'eval' if a.eval else 'train'}, augment {a.augment}, batch {a.batch_size}, {a.image_size} px, "
        f"{a.workers} workers/threads\n"
    )
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
