"""The `dali-fast` command."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .data.base import ON_ERROR

log = logging.getLogger("dali_fast")


class UserError(Exception):
    """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong and where the help is), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _cmd_make_synthetic(args: argparse.Namespace) -> int:
    from .data.synthetic import make_synthetic

    make_synthetic(args.out, images=args.images, classes=args.classes, seed=args.seed)
    print(f"wrote {args.images} images in {args.classes} classes to {args.out}")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    from .data.writer import pack

    kw = {"max_side": args.max_side, "workers": args.workers, "shard_size": args.shard_size or None}
    report = pack(args.src, args.dst, verify=not args.no_verify, **kw)
    print(report.summary())  # what was left out, and why, is logged above, once per file
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools.inspect import inspect_dataset

    return inspect_dataset(args.dataset, verify=args.verify, emit=print)


def _size(text: str) -> int:
    """Bytes from '0', '512M', '8G', '1.5GiB'."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 0, 512M or 8G")
    return int(value)


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (argparse names the flag in its message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small; use {minimum} or more")
        return value

    return parse


def _number(ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse type: a finite number for which ``ok`` holds, else "'TEXT' is not WHAT"."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


_positive = _number(lambda v: v > 0, "a positive number")
_alpha = _number(lambda v: v >= 0, "a number >= 0 (0 turns it off)")  # a Beta distribution's alpha
_probability = _number(lambda v: 0 <= v <= 1, "in [0, 1]")
_crop_fraction = _number(lambda v: 0 < v <= 1, "in (0, 1]")


def _recipe(args: argparse.Namespace, augment: str | None) -> Any:
    """The recipe the flags describe (a bad combination is one line, before any work)."""
    from .transforms.recipe import Recipe

    return Recipe(
        image_size=args.image_size,
        auto_augment=None if augment in (None, "none") else augment,
        random_erasing=args.random_erasing,
        eval_crop_fraction=args.eval_crop_fraction,
        resolution=args.progressive,
    )


def _progressive(text: str) -> Any:
    """``--progressive START:END:FROM_EPOCH:TO_EPOCH[:STEP]`` as a `Progressive` ramp."""
    from .transforms.recipe import Progressive

    try:
        return Progressive.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--progressive {text!r}: ")) from None


def _augments(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in AUGMENTS]
    if not names or bad:
        raise UserError(f"--augment {text!r}: use one or more of {','.join(AUGMENTS)}, comma-separated")
    if len(set(names)) != len(names):
        raise UserError(f"--augment {text!r} names one more than once; name each once")
    return names


def _cmd_stages(args: argparse.Namespace) -> int:
    from .tools.report import stages_summary
    from .tools.stages import run_stages

    result = run_stages(
        args.dataset,
        images=args.images,
        epochs=args.epochs,
        batch_size=args.batch_size,
        image_size=args.image_size,
        model=args.model,
        cache_bytes=args.cache_bytes or None,
        total_epochs=args.total_epochs,
        total_images=args.total_images,
        progressive=args.progressive,
        out=args.out,
        emit=log.info,
    )
    print(stages_summary(result, Path(args.out)))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .tools.bench import run_bench
    from .tools.report import bench_summary

    if args.stages:
        if args.no_limit or args.alternate:
            flag = "--no-limit" if args.no_limit else "--alternate"
            raise UserError(f"{flag} belongs to the loader rows; --stages runs its stages one after another")
        return _cmd_stages(args)
    if args.total_epochs != 90 or args.total_images != 1_281_167:
        raise UserError("--total-epochs and --total-images project a whole run: use them with --stages")

    loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    if not loaders:
        raise UserError("--loaders is empty; name one or more of baseline,torch,dali")
    twice = sorted({x for x in loaders if loaders.count(x) > 1})
    if twice:
        raise UserError(f"--loaders lists {', '.join(twice)} more than once; name each loader once")
    augments = _augments(args.augment)
    recipe = _recipe(args, None)
    mix = {"alpha_mixup": args.mixup, "alpha_cutmix": args.cutmix, "label_smoothing": args.label_smoothing}
    result = run_bench(
        args.dataset,
        images=args.images,
        loaders=loaders,
        epochs=args.epochs,
        batch_size=args.batch_size,
        image_size=args.image_size,
        model=args.model,
        cache_bytes=args.cache_bytes,
        controller=args.controller,
        out=args.out,
        on_error=args.on_error,
        recipe=recipe,
        augments=augments,
        mix=mix if args.mixup or args.cutmix else None,
        limit=not args.no_limit,
        alternate=args.alternate,
        emit=log.info,
    )
    print(bench_summary(result, Path(args.out)))
    return 0 if all("error" not in r for r in result["rows"]) else 1


def _cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from .data.open import open_dataset
    from .data.synthetic import default_dataset
    from .train.config import TrainConfig
    from .train.run import run_train

    augments = _augments(args.augment)
    if len(augments) > 1:
        raise UserError(f"--augment {args.augment!r}: train takes one (bench compares several)")
    flags = {f.name for f in dataclasses.fields(TrainConfig)} & vars(args).keys()  # the flags are its fields
    config = TrainConfig(**{k: getattr(args, k) for k in flags}, recipe=_recipe(args, augments[0])).checked()
    run_train(open_dataset(args.dataset or default_dataset(args.images)[1]), config, emit=print)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from .tools.diagnosis import diagnose
    from .tools.doctor import probe

    readings = probe(quick=args.quick)
    result = diagnose(readings)
    if args.json:
        print(json.dumps({"readings": readings.to_dict(), "problem": result.problem}, indent=2))
    else:
        print("\n".join(result.lines))
    if result.problem is not None:
        print(f"dali-fast doctor: the GPU path cannot run: {result.problem}", file=sys.stderr)
        return 1
    if not args.json:
        print("the GPU path works: DALI decodes on the GPU")
    return 0


def _add_data_args(s: argparse.ArgumentParser) -> None:
    """The data and batch arguments `bench` and `train` share."""
    s.add_argument("dataset", nargs="?", default=None, help="packed set or ImageFolder (default: the synthetic set)")
    s.add_argument("--images", type=_count(1), default=2000, help="size of the default synthetic set")
    s.add_argument("--batch-size", type=_count(1), default=64)
    s.add_argument("--image-size", type=_count(1), default=224)
    s.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="raise",
        help="an undecodable or unreadable image: stop naming it (raise), or skip, count and log it (skip)",
    )


AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")


def _add_recipe_args(s: argparse.ArgumentParser, several: bool) -> None:
    """The training recipe's flags (train and bench)."""
    s.add_argument(
        "--augment",
        default="none",
        metavar="|".join(AUGMENTS),
        help="automatic augmentation per image" + (" (comma-separated: one row each, side by side)" if several else ""),
    )
    s.add_argument("--random-erasing", type=_probability, default=0.0, metavar="P", help="random erasing probability")
    s.add_argument("--mixup", type=_alpha, default=0.0, metavar="A", help="mixup Beta alpha (0: off)")
    s.add_argument("--cutmix", type=_alpha, default=0.0, metavar="A", help="cutmix Beta alpha (0: off)")
    s.add_argument(
        "--label-smoothing", type=_probability, default=0.0, metavar="E", help="label smoothing of the targets"
    )
    s.add_argument(
        "--progressive",
        type=_progressive,
        default=None,
        metavar="START:END:FROM_EPOCH:TO_EPOCH",
        help="progressive resizing: train at START px up to epoch FROM_EPOCH, then ramp in steps of 32 px "
        "(or a fifth field, STEP) to END px at epoch TO_EPOCH (FFCV's ImageNet recipe: 160:192:65:76); "
        "--image-size stays the evaluation size",
    )
    s.add_argument(
        "--eval-crop-fraction",
        type=_crop_fraction,
        default=0.875,
        metavar="F",
        help="evaluation: resize the shorter side to size/F, then centre crop",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dali-fast", description="Feed the GPU: DALI data loading for PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("make-synthetic", help="write a synthetic ImageNet-like ImageFolder of JPEGs")
    s.add_argument("out", help="output folder (OUT/<class>/<image>.jpg)")
    s.add_argument("--images", type=_count(1), default=1000)
    s.add_argument("--classes", type=_count(1), default=10)
    s.add_argument("--seed", type=_count(0), default=0)
    s.set_defaults(func=_cmd_make_synthetic)

    s = sub.add_parser("pack", help="pack an ImageFolder into one memory-mappable data set")
    s.add_argument("src", help="ImageFolder root SRC/<class>/<image>")
    s.add_argument("dst", help="destination folder (must not exist)")
    s.add_argument("--no-verify", action="store_true", help="do not decode each image (faster; structural check only)")
    s.add_argument(
        "--max-side", type=_count(1), default=None, help="re-encode images whose longer side exceeds N pixels"
    )
    s.add_argument(
        "--workers",
        type=_count(1),
        default=None,
        help="processes that read, verify and re-encode (default: every CPU); the output is the same for any N",
    )
    s.add_argument(
        "--shard-size",
        type=_size,
        default=0,
        metavar="BYTES",
        help="write data-00000.bin, data-00001.bin, ... of at most this size (e.g. 64G) under one index",
    )
    s.set_defaults(func=_cmd_pack)

    s = sub.add_parser("inspect", help="describe a data set (packed or ImageFolder)")
    s.add_argument("dataset")
    s.add_argument("--verify", action="store_true", help="check every record's crc32 (packed sets)")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("bench", help="compare the loaders side by side: img/s, utilization, memory, cache")
    _add_data_args(s)
    s.add_argument("--loaders", default="baseline,torch,dali", help="comma-separated: baseline,torch,dali")
    s.add_argument("--epochs", type=_count(1), default=2, help="timed epochs after one warm-up epoch")
    s.add_argument("--model", default="none", choices=["none", "resnet_tiny", "resnet18", "resnet50"])
    s.add_argument("--cache-bytes", type=_size, default=0, help="LRU cache budget, e.g. 2G (0: off)")
    s.add_argument("--controller", action="store_true", help="let BatchSizeController pick the batch size per epoch")
    s.add_argument("--out", default="bench-results", help="folder for results.json and bench.png")
    s.add_argument(
        "--no-limit",
        action="store_true",
        help="skip the limit row (the machine's decode-only img/s on the same data and processes)",
    )
    s.add_argument(
        "--alternate",
        action="store_true",
        help="start every row, then time them in turn, one epoch each (a changing machine load then slows "
        "every row alike; all loaders stay alive meanwhile)",
    )
    _add_recipe_args(s, several=True)
    s.add_argument(
        "--stages",
        action="store_true",
        help="measure the optimizations cumulatively, one row each (baseline, +cache, +factory, +device ops, "
        "+DALI, +controller, +progressive resizing), with the projected time of a whole training run",
    )
    s.add_argument("--total-epochs", type=_count(1), default=90, help="with --stages: epochs of the projected run")
    s.add_argument(
        "--total-images", type=_count(1), default=1_281_167, help="with --stages: images per epoch of the projected run"
    )
    s.set_defaults(func=_cmd_bench)

    s = sub.add_parser("train", help="train a small ResNet with the chosen loader; loss, accuracy, img/s per epoch")
    _add_data_args(s)
    s.add_argument("--loader", default="dali", choices=["dali", "torch", "baseline"])
    s.add_argument("--epochs", type=_count(1), default=5)
    s.add_argument("--model", default="resnet18", choices=["resnet_tiny", "resnet18", "resnet50"])
    s.add_argument("--lr", type=_positive, default=0.05)
    s.add_argument("--controller", action="store_true", help="adjust the batch size between epochs from memory")
    s.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True, help="mixed precision on GPU")
    s.add_argument("--seed", type=_count(0), default=0)
    s.add_argument("--num-workers", type=_count(0), default=None, help="decode workers (torch/baseline loaders)")
    s.add_argument(
        "--drop-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave out each epoch's incomplete last training batch",
    )
    s.add_argument("--checkpoint", metavar="DIR", default=None, help="save model/optimizer/loader state in DIR")
    s.add_argument("--checkpoint-every", type=_count(1), default=500, metavar="K", help="steps between checkpoints")
    s.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt, mid-epoch included")
    s.add_argument(
        "--record-indices",
        metavar="FILE",
        default=None,
        help="append each batch's sample indices as JSON lines (per rank: FILE.rank<N> or a {rank} placeholder)",
    )
    s.add_argument("--out", default=None, help="folder for train.json (rank 0 writes it)")
    _add_recipe_args(s, several=False)
    s.set_defaults(func=_cmd_train)

    s = sub.add_parser("doctor", help="check the GPU path: torch/CUDA, driver and GPUs, DALI, a GPU JPEG decode")
    s.add_argument(
        "--quick",
        action="store_true",
        help="NVML only (driver, GPUs): no CUDA context, no DALI pipeline; for health checks during training",
    )
    s.add_argument("--json", action="store_true", help="print the readings as JSON")
    s.set_defaults(func=_cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = int(os.environ.get("RANK", "0")) > 0  # under torchrun only rank 0 talks; the others warn
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"dali-fast {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dali-fast {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
