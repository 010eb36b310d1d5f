"""What progressive resizing costs and saves, side by side in one process.

Three parts (``--part``, default all):

- ``sizes``: img/s of one epoch at each size (default 160, 192, 224 px) for `TorchIterator` and
  `DALIIterator`, each loader made once per size and warmed up, then the timed epochs taken in turn
  (size after size, loader after loader, ``--repeats`` rounds), so a changing machine load slows all alike.
- ``run``: the wall time of a whole ``--epochs`` run (the loader made, every epoch, closed) with the ramp
  (``--ramp``, default 160:224:1:4) and without it (every epoch at the ramp's end size), for both loaders,
  runs alternating; ``--model`` adds a training step per batch (``none``: loading only).
- ``builds``: the two ways DALI can change the size between epochs, on the same hand-written graph
  (decode with a random crop, resize, crop-mirror-normalize): a new pipeline per size (what `DALIIterator`
  does), or one pipeline whose size is a per-sample argument input fed by the external source with every
  batch. Per size: the build time and the epoch time, and the total of a ramp over those sizes.

    python benchmarks/progressive.py --images 512 --batch-size 64 [--model resnet_tiny] [--device cpu]

Synthetic JPEGs of about 500x375 (`make_synthetic`), packed; CPU-only mode where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dali_fast import DALIIterator, Progressive, Recipe, TorchIterator, open_dataset, pack
from dali_fast.data.synthetic import make_synthetic

LOADERS = {"torch": TorchIterator, "dali": DALIIterator}


def epoch(loader: Any, e: int, step: Any = None) -> tuple[int, float]:
    """(images, seconds) of epoch ``e``."""
    loader.set_epoch(e)
    t, n = time.perf_counter(), 0
    for images, labels in loader:
        if step is not None:
            step(images, labels)
        n += len(labels)
    return n, time.perf_counter() - t


def make(kind: str, reader: Any, batch: int, recipe: Recipe, device: str) -> Any:
    kw: dict[str, Any] = {"num_workers": None} if kind == "torch" else {}
    return LOADERS[kind](reader, batch, recipe=recipe, device=device, **kw)


def part_sizes(reader: Any, args: argparse.Namespace) -> dict[str, Any]:
    loaders = {
        (k, s): make(k, reader, args.batch_size, Recipe(image_size=s), args.device) for k in LOADERS for s in args.sizes
    }
    for loader in loaders.values():
        epoch(loader, 0)  # warm-up: workers or pipeline started, pages cached
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in loaders}
    for r in range(args.repeats):
        for key, loader in loaders.items():
            n, s = epoch(loader, r + 1)
            rates[key].append(n / s)
    for loader in loaders.values():
        loader.close()
    out = {f"{k}@{s}": statistics.median(v) for (k, s), v in rates.items()}
    for k in LOADERS:
        base = out[f"{k}@{args.sizes[-1]}"]
        for s in args.sizes:
            print(
                f"{k:5s} {s} px: {out[f'{k}@{s}']:7.0f} img/s  ({out[f'{k}@{s}'] / base:.2f}x of {args.sizes[-1]} px)"
            )
    return out


def part_run(reader: Any, args: argparse.Namespace) -> dict[str, Any]:
    ramp = Progressive.parse(args.ramp)
    variants = {"ramp": Recipe(image_size=ramp.end, resolution=ramp), "fixed": Recipe(image_size=ramp.end)}
    print(f"ramp {ramp}: sizes by epoch {[ramp(e) for e in range(args.epochs)]}")
    step = None
    if args.model != "none":
        from dali_fast.train.trainer import Trainer

        trainer = Trainer(args.model, len(reader.classes))

        def step(images: torch.Tensor, labels: torch.Tensor) -> None:
            trainer.step(images, labels)

    walls: dict[str, list[float]] = {f"{k}/{v}": [] for k in LOADERS for v in variants}
    for _ in range(args.repeats):
        for k in LOADERS:
            for v, recipe in variants.items():
                t = time.perf_counter()
                loader = make(k, reader, args.batch_size, recipe, args.device)
                for e in range(args.epochs):
                    epoch(loader, e, step)
                loader.close()
                walls[f"{k}/{v}"].append(time.perf_counter() - t)
    out = {key: statistics.median(v) for key, v in walls.items()}
    for k in LOADERS:
        print(
            f"{k:5s} {args.epochs} epochs, model={args.model}: ramp {out[f'{k}/ramp']:.1f} s, fixed {ramp.end} px "
            f"{out[f'{k}/fixed']:.1f} s ({out[f'{k}/ramp'] / out[f'{k}/fixed']:.2f}x)"
        )
    return out


class _Source:
    """Batches of (jpegs, labels[, sizes]) in order over the data set, the size set per epoch."""

    def __init__(self, reader: Any, batch: int, with_sizes: bool) -> None:
        self.reader, self.batch, self.size, self.at, self.with_sizes = reader, batch, 224, 0, with_sizes

    def __call__(self, info: Any) -> Any:
        n = len(self.reader)
        if self.at >= n:
            raise StopIteration
        idx = range(self.at, min(self.at + self.batch, n))
        self.at += self.batch
        jpegs = [np.asarray(self.reader[i][0]) for i in idx]
        labels = [np.int64(self.reader[i][1]) for i in idx]
        if not self.with_sizes:
            return jpegs, labels
        return jpegs, labels, [np.float32(self.size) for _ in idx]


def _pipeline(source: _Source, batch: int, size: int | None, gpu: bool) -> Any:
    """``size`` fixed in the graph, or None: the size comes with every sample from the source."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch, num_threads=torch.get_num_threads(), device_id=0 if gpu else None, seed=0)
    def pipe():  # type: ignore[no-untyped-def]
        if size is None:
            jpegs, labels, sizes = fn.external_source(
                source=source, num_outputs=3, batch=True, dtype=[types.UINT8, types.INT64, types.FLOAT]
            )
        else:
            jpegs, labels = fn.external_source(
                source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64]
            )
        images = fn.decoders.image_random_crop(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        if size is None:
            images = fn.resize(images, resize_x=sizes, resize_y=sizes)
            crop = {"crop_h": sizes, "crop_w": sizes}
        else:
            images = fn.resize(images, resize_x=size, resize_y=size)
            crop = {"crop": (size, size)}
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mirror=fn.random.coin_flip(),
            mean=[124.0, 116.0, 104.0],
            std=[58.0, 57.0, 57.0],
            **crop,
        )
        return images, labels

    return pipe()


class _Run:
    """A pipeline, its source and iterator: epochs at a size (set on the source before each epoch starts)."""

    def __init__(self, reader: Any, batch: int, size: int | None, gpu: bool) -> None:
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        t = time.perf_counter()
        self.source = _Source(reader, batch, with_sizes=size is None)
        if size is not None:
            self.source.size = size
        pipe = _pipeline(self.source, batch, size, gpu)
        pipe.build()
        self.it = DALIGenericIterator(
            pipe,
            ["images", "labels"],
            auto_reset=False,
            prepare_first_batch=False,
            last_batch_policy=LastBatchPolicy.PARTIAL,
        )
        self.build_s = time.perf_counter() - t
        self.started = False

    def epoch(self, size: int) -> tuple[int, float]:
        self.source.size, self.source.at = size, 0
        if self.started:
            self.it.reset()
        self.started = True
        t, n = time.perf_counter(), 0
        for out in self.it:
            assert out[0]["images"].shape[-1] == size
            n += len(out[0]["labels"])
        return n, time.perf_counter() - t


def part_builds(reader: Any, args: argparse.Namespace) -> dict[str, Any]:
    gpu = args.device != "cpu" and torch.cuda.is_available()
    result: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        result.setdefault(key, []).append(value)

    for _ in range(args.repeats):
        shared = _Run(reader, args.batch_size, None, gpu)  # one pipeline for every size
        note("argument:build_s", shared.build_s)
        for size in args.sizes:
            own = _Run(reader, args.batch_size, size, gpu)  # a pipeline for this size
            note(f"rebuild@{size}:build_s", own.build_s)
            for run in (own, shared):
                run.epoch(size)  # the first epoch at the size: warm-up
            for way, run in (("rebuild", own), ("argument", shared)):
                n, s = run.epoch(size)
                note(f"{way}@{size}:img_per_s", n / s)
            del own
        del shared
    out = {k: statistics.median(v) for k, v in result.items()}
    print(f"argument input: one build, {out['argument:build_s'] * 1000:.0f} ms")
    for size in args.sizes:
        a, r = out[f"argument@{size}:img_per_s"], out[f"rebuild@{size}:img_per_s"]
        print(
            f"{size} px: rebuild {out[f'rebuild@{size}:build_s'] * 1000:.0f} ms build, {r:.0f} img/s | "
            f"argument input {a:.0f} img/s ({a / r:.2f}x)"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",")], default=[160, 192, 224])
    ap.add_argument("--ramp", default="160:224:1:4", help="the ramp of the 'run' part (START:END:FROM:TO)")
    ap.add_argument("--epochs", type=int, default=6, help="epochs of the 'run' part")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="none", help="'none' (loading only) or a dali_fast model name")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--part", choices=["sizes", "run", "builds", "all"], default="all")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        make_synthetic(Path(d) / "img", images=args.images, classes=10, progress=False)
        pack(Path(d) / "img", Path(d) / "p", progress=False, verify=False)
        reader = open_dataset(Path(d) / "p")
        figures: dict[str, Any] = {"settings": vars(args)}
        for part, fn in (("sizes", part_sizes), ("run", part_run), ("builds", part_builds)):
            if args.part in (part, "all"):
                print(f"--- {part}")
                figures[part] = fn(reader, args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
