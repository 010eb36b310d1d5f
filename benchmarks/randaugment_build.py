"""DALI RandAugment: how the pipeline's build time grows with ``num_ops``, and where it goes.

`nvidia.dali.auto_aug` applies each of the ``num_ops`` levels as a conditional select over the whole
suite (14 operations), so the graph holds ``num_ops x 14`` branches, each traced in Python (conditionals)
and then instantiated by ``Pipeline.build``. This times the two parts apart, per ``num_ops``, alternating
the settings in one process (``--repeats`` rounds), with the pipeline `DALIIterator` builds (CPU-only
mode here). Each setting is built twice in turn: with DALI's operator-origin traces on while auto_aug
builds (as before), and off (what `transforms.dali.auto_augment` does now).

    python benchmarks/randaugment_build.py --ops 0,1,2,4,8 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from nvidia.dali.pipeline import Pipeline

from dali_fast.loaders.dali_pipeline import build_pipeline
from dali_fast.transforms import dali as dali_graph
from dali_fast.transforms.recipe import Recipe


class _NoSource:
    """A source that is never called: building a pipeline does not run it."""

    boxes = None

    def __call__(self) -> None:  # pragma: no cover - never called by a build
        raise AssertionError("a build does not read")


CUT = dali_graph._no_origin_traces  # noqa: SLF001 - the cut being measured


def one_build(num_ops: int, magnitude: int, image_size: int, traces: bool = False) -> tuple[float, float]:
    """(seconds tracing the graph in Python, seconds in Pipeline.build) of one pipeline; ``traces``: with
    DALI's operator-origin traces on while auto_aug builds (the build before the cut)."""
    dali_graph._no_origin_traces = contextlib.nullcontext if traces else CUT  # noqa: SLF001
    recipe = Recipe(
        image_size=image_size,
        auto_augment="randaugment" if num_ops else None,
        num_ops=max(num_ops, 1),
        magnitude=magnitude,
    )
    spent = {}
    real = Pipeline.build

    def timed(self):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        real(self)
        spent["build"] = time.perf_counter() - t

    Pipeline.build = timed  # type: ignore[method-assign]
    try:
        t = time.perf_counter()
        pipe = build_pipeline(
            _NoSource(),
            max_batch=64,
            train=True,
            recipe=recipe,
            gpu=False,
            device_id=None,
            seed=1,
            num_threads=2,
            prefetch=2,
        )
        total = time.perf_counter() - t
    finally:
        Pipeline.build = real  # type: ignore[method-assign]
    del pipe
    return total - spent["build"], spent["build"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="0,1,2,4,8", help="num_ops values (0: no RandAugment)")
    ap.add_argument("--magnitude", type=int, default=9)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ops = [int(x) for x in args.ops.split(",")]
    one_build(1, args.magnitude, args.image_size)  # imports and DALI's first-use set-up, not timed
    times: dict[tuple[int, bool], list[tuple[float, float]]] = {(n, t): [] for n in ops for t in (True, False)}
    for _ in range(args.repeats):
        for n in ops:  # alternating: a machine whose load changes slows every setting alike
            for traces in (True, False):
                times[n, traces].append(one_build(n, args.magnitude, args.image_size, traces))
    print(f"RandAugment magnitude {args.magnitude}, {args.image_size}px, CPU-only pipeline, median of {args.repeats}")
    print("| num_ops | origin traces | graph s | Pipeline.build s | total s | traces on / off |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in ops:
        total = {}
        for traces in (True, False):
            graph = statistics.median(t for t, _ in times[n, traces])
            build = statistics.median(b for _, b in times[n, traces])
            total[traces] = graph + build
            ratio = f"{total[True] / total[False]:.2f}x" if not traces and total[False] > 0 else ""
            print(
                f"| {n} | {'on (before)' if traces else 'off (now)'} | {graph:.2f} | {build:.2f} | "
                f"{graph + build:.2f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
