"""Baseline vs TorchIterator vs DALIIterator on this machine, side by side in one run (ratios to the baseline).

    python benchmarks/loaders.py [--images 1000] [--image-size 224] [--model none]

The same measurement as `dali-fast bench`; kept here with the other benchmarks.
"""

from __future__ import annotations

import argparse

from dali_fast.tools.bench import run_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--model", default="none")
    ap.add_argument("--out", default="build/bench-loaders")
    a = ap.parse_args()
    result = run_bench(
        images=a.images, epochs=a.epochs, batch_size=a.batch_size, image_size=a.image_size, model=a.model, out=a.out
    )
    print(result["table"])


if __name__ == "__main__":
    main()
