"""What keeping one DALI pipeline across epochs saves: builds, build time and epoch time, side by side.

Runs the same DALIIterator epochs twice in one process: once rebuilding the pipeline every epoch
(the loader is closed after each epoch, as before), once keeping it (the default). CPU-only mode
here; on a GPU a build also sets up nvJPEG and the hardware decoder and preallocates its buffers.

    python benchmarks/pipeline_builds.py --images 512 --epochs 5
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dali_fast import DALIIterator, open_dataset, pack
from dali_fast.data.synthetic import make_synthetic


def run(reader, epochs: int, batch: int, size: int, rebuild: bool) -> dict[str, float]:
    loader = DALIIterator(reader, batch, image_size=size, device="auto")
    build_s = []
    real_build = loader._build  # noqa: SLF001 - timing the build itself

    def timed_build(*args, **kwargs):
        t = time.perf_counter()
        out = real_build(*args, **kwargs)
        build_s.append(time.perf_counter() - t)
        return out

    loader._build = timed_build  # noqa: SLF001
    epoch_s = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        t = time.perf_counter()
        for _ in loader:
            pass
        epoch_s.append(time.perf_counter() - t)
        if rebuild:
            loader.close()
    loader.close()
    return {
        "builds": loader.pipelines_built,
        "build_ms": 1000 * sum(build_s) / len(build_s),
        "epoch_s": sum(epoch_s[1:]) / max(1, len(epoch_s) - 1),
        "total_s": sum(epoch_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=96)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        make_synthetic(Path(d) / "img", images=args.images, classes=4, progress=False)
        pack(Path(d) / "img", Path(d) / "p", progress=False, verify=False)
        reader = open_dataset(Path(d) / "p")
        rows = {
            "rebuild per epoch": run(reader, args.epochs, args.batch_size, args.image_size, rebuild=True),
            "one pipeline": run(reader, args.epochs, args.batch_size, args.image_size, rebuild=False),
        }
    print(f"{args.images} images, {args.epochs} epochs, batch {args.batch_size}, {args.image_size}px")
    print("| mode | builds | ms per build | epoch s (after the first) | total s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['builds']} | {r['build_ms']:.1f} | {r['epoch_s']:.3f} | {r['total_s']:.3f} |")


if __name__ == "__main__":
    main()
