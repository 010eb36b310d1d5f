"""What each training recipe costs, per loader, side by side in one run.

Runs `dali-fast bench` once over every (augmentation, loader) pair on the same packed set: no
automatic augmentation, RandAugment (n=2, m=9) and TrivialAugmentWide, each with the plain
DataLoader baseline, TorchIterator and DALIIterator. Prints img/s, each row against the same
loader without augmentation (the recipe's cost) and DALI against TorchIterator for the same
recipe. On the CPU here DALI runs its CPU-only operators; on a GPU host the augmentations are GPU
kernels, where the per-pixel work of these policies should favour DALI most.

    python benchmarks/recipes.py --images 1000 --epochs 2 --image-size 160
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dali_fast.tools.bench import run_bench

AUGMENTS = ["none", "randaugment", "trivialaugment"]


def table(rows: list[dict]) -> str:
    speed = {(r["loader"], r["augment"]): r.get("img_per_s") for r in rows}
    lines = [
        "| loader | augment | img/s | vs. same loader, none | DALI / Torch |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['loader']} | {r['augment']} | failed: {r['error']} | | |")
            continue
        none = speed.get((r["loader"], "none"))
        torch_same = speed.get(("torch", r["augment"]))
        vs_none = f"{r['img_per_s'] / none:.2f}x" if none else "-"
        vs_torch = f"{r['img_per_s'] / torch_same:.2f}x" if r["loader"] == "dali" and torch_same else ""
        lines.append(f"| {r['loader']} | {r['augment']} | {r['img_per_s']:.0f} | {vs_none} | {vs_torch} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=160)
    ap.add_argument("--loaders", default="baseline,torch,dali")
    ap.add_argument("--out", default=None, help="folder for results.json (default: a temporary folder)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="recipes-"))
    result = run_bench(
        None,
        images=args.images,
        loaders=args.loaders.split(","),
        epochs=args.epochs,
        batch_size=args.batch_size,
        image_size=args.image_size,
        augments=AUGMENTS,
        out=out,
    )
    m = result["machine"]
    where = m["gpu"] or f"{m['cpu_count']} CPU cores, no GPU (DALI CPU-only mode)"
    print(
        f"\n{args.images} images, {args.epochs} timed epochs, batch {args.batch_size}, {args.image_size}px on {where}\n"
    )
    print(table(result["rows"]))
    (out / "recipes.json").write_text(json.dumps(result["rows"], indent=1, default=str))
    print(f"\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
