"""The `dali-fast` command."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cli_options import AUGMENTS, build_parser
from .text import plural

log = logging.getLogger("dali_fast")


class UserError(Exception):
    """Bad input: reported as one line, exit code 2."""


def _cmd_make_synthetic(args: argparse.Namespace) -> int:
    from .data.synthetic import make_synthetic

    make_synthetic(args.out, images=args.images, classes=args.classes, seed=args.seed, multi_label=args.multi_label)
    where = f"{args.out} (targets in {Path(args.out) / 'labels.csv'})" if args.multi_label else args.out
    print(f"wrote {plural(args.images, 'image')} in {plural(args.classes, 'class', 'classes')} to {where}")
    return 0


def _open_options(args: argparse.Namespace, dataset: str | None) -> dict[str, Any]:
    """The keywords of `open_dataset` the flags give: ``--classes`` (the class map), and ``--cache-dir``,
    ``--cache-limit`` and ``--storage-option``, which are refused for local data (never accepted and then
    ignored)."""
    options = _url_options(args, dataset)
    if getattr(args, "classes", None) is not None:
        options["classes"] = args.classes
    return options


def _url_options(args: argparse.Namespace, dataset: str | None) -> dict[str, Any]:
    flags = {"--cache-dir": args.cache_dir, "--cache-limit": args.cache_limit, "--storage-option": args.storage_option}
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        return {}
    from .data.remote.store import is_remote

    if not is_remote(dataset):
        what = "the synthetic set" if dataset is None else dataset
        raise UserError(f"{given[0]} applies to data at a URL (s3://, gs://, https://, ...), not to {what}")
    options: dict[str, Any] = {}
    for key, value in args.storage_option or []:
        if key in options:
            raise UserError(f"--storage-option {key} is given twice; give each key once")
        options[key] = value
    kw = {"cache_dir": args.cache_dir, "cache_limit": args.cache_limit, "storage_options": options or None}
    return {k: v for k, v in kw.items() if v is not None}


def _cmd_pack(args: argparse.Namespace) -> int:
    from .data.remote.store import is_remote

    src: Any = args.src
    targets = _targets(args)
    options = _url_options(args, args.src if is_remote(args.src) else args.dst)  # for whichever is a URL
    if args.classes is not None or (options and is_remote(args.src)):  # opened here, read by its reader
        from .data.open import open_dataset

        opened = options if is_remote(args.src) else {}  # a URL's cache and storage options, the class map
        src, targets = open_dataset(args.src, **opened, classes=args.classes, **targets), {}
    if args.format == "webdataset":
        from .data.pack.webdataset import pack_shards

        if args.shard_size == 0:
            raise UserError("--shard-size 0: shards need a size; give one such as 256M, or leave it out")
        kw = {"max_side": args.max_side, "workers": args.workers, "prefix": args.prefix}
        if is_remote(args.dst) and "storage_options" in options:
            kw["storage_options"] = options["storage_options"]
        if args.shard_size is not None:
            kw["shard_size"] = args.shard_size
        report = pack_shards(src, args.dst, verify=not args.no_verify, shuffle=not args.no_shuffle, **kw, **targets)
        print(report.summary())
        return 0
    from .data.pack.packed import pack

    unused = _changed(args, ("prefix", "no_shuffle"))
    if unused:
        raise UserError(f"{unused[0]} is for WebDataset shards; add --format webdataset")
    kw = {"max_side": args.max_side, "workers": args.workers, "shard_size": args.shard_size or None}
    report = pack(src, args.dst, verify=not args.no_verify, **kw, **targets)
    print(report.summary())  # what was left out, and why, is logged above, once per file
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools.inspect import inspect_dataset

    return inspect_dataset(
        args.dataset, verify=args.verify, emit=print, open_options=_open_options(args, args.dataset), **_targets(args)
    )


def _targets(args: argparse.Namespace) -> dict[str, Any]:
    """``open_dataset``'s ``target`` and ``num_classes`` from --target and --num-classes."""
    return {"target": args.target, "num_classes": args.num_classes}


def _dataset_with_targets(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """``args.dataset`` opened with --target/--num-classes (and ``options``) when either is given (else as it
    is: bench and train open it themselves); the synthetic default set has class targets only."""
    if args.target is None and args.num_classes is None:
        return args.dataset
    if args.dataset is None:
        raise UserError(
            f"--target {args.target or 'class'} needs a DATASET with targets (the default synthetic set has one "
            "class per image); make one with `dali-fast make-synthetic OUT --multi-label`"
        )
    from .data.open import open_dataset

    return open_dataset(args.dataset, **_targets(args), **options)


def _recipe(args: argparse.Namespace, augment: str | None) -> Any:
    """The recipe the flags describe (a bad combination is one line, before any work)."""
    import torch

    from .transforms.recipe import Recipe

    dtype = getattr(args, "dtype", None)
    return Recipe(
        dtype=getattr(torch, dtype) if dtype else None,
        image_size=args.image_size,
        auto_augment=None if augment in (None, "none") else augment,
        random_erasing=args.random_erasing,
        eval_crop_fraction=args.eval_crop_fraction,
        resolution=args.progressive,
    )


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
        cache_bytes=args.cache_bytes,
        total_epochs=args.total_epochs,
        total_images=args.total_images,
        progressive=args.progressive,
        out=args.out,
        emit=log.info,
        open_options=_open_options(args, args.dataset),
    )
    print(stages_summary(result, Path(args.out)))
    return 0


def _changed(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The flags among ``names`` (argparse dests) given a value other than their default, as --flags."""
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != args.default_of(n)]


def _cmd_bench(args: argparse.Namespace) -> int:
    from .tools.bench import run_bench
    from .tools.report import bench_summary

    loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    if not loaders:
        raise UserError("--loaders is empty; name one or more of baseline,torch,dali")
    twice = sorted({x for x in loaders if loaders.count(x) > 1})
    if twice:
        raise UserError(f"--loaders lists {', '.join(twice)} more than once; name each loader once")
    if set(loaders) == {"baseline"}:  # the plain DataLoader has neither: a flag never accepted and then ignored
        unused = _changed(args, ("cache_bytes", "controller"))
        if unused:
            raise UserError(
                f"{unused[0]} does nothing to the baseline (a plain DataLoader); add torch or dali to --loaders"
            )
    if _changed(args, ("eval_crop_fraction",)):  # every row times a training loader
        raise UserError("--eval-crop-fraction shapes evaluation batches, and bench times training; use it with train")
    if args.label_smoothing and not (args.mixup or args.cutmix):
        raise UserError("--label-smoothing alone changes only the loss, not the loading bench times; use it with train")
    if args.dtype == "uint8" and (args.mixup or args.cutmix):
        raise UserError("--mixup and --cutmix blend normalized images, not uint8 ones; drop --dtype uint8 or them")
    augments = _augments(args.augment)
    recipe = _recipe(args, None)
    mix = {"alpha_mixup": args.mixup, "alpha_cutmix": args.cutmix, "label_smoothing": args.label_smoothing}
    options = _open_options(args, args.dataset)
    result = run_bench(
        _dataset_with_targets(args, options),
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
        open_options=options,
        ranks=args.ranks,
        isolate=args.isolate,
    )
    if result.get("rank", 0) == 0:  # under torchrun, rank 0 speaks for the ranks
        print(bench_summary(result, Path(args.out)))
    return 0 if all("error" not in r for r in result["rows"]) else 1


def _cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from .data.open import open_dataset
    from .data.remote.store import is_remote
    from .data.synthetic import default_dataset
    from .train.config import TrainConfig
    from .train.run import run_train

    augments = _augments(args.augment)
    if len(augments) > 1:
        raise UserError(f"--augment {args.augment!r}: train takes one (bench compares several)")
    flags = {f.name for f in dataclasses.fields(TrainConfig)} & vars(args).keys()  # the flags are its fields
    config = TrainConfig(**{k: getattr(args, k) for k in flags}, recipe=_recipe(args, augments[0])).checked()
    url = next((p for p in (args.dataset, args.val) if is_remote(p)), args.dataset)  # what the URL options are for
    url_options = _url_options(args, url)
    declared = {"classes": args.classes} if args.classes is not None else {}  # --classes: the map of both sets
    options = {**(url_options if is_remote(args.dataset) else {}), **declared}
    if args.target is None and args.num_classes is None:
        reader = open_dataset(args.dataset or default_dataset(args.images)[1], **options)
    else:
        reader = _dataset_with_targets(args, options)
    with contextlib.ExitStack() as opened:  # a streamed set's downloads ahead stop (and clean up) before exit
        opened.callback(_close, reader)
        if args.val is not None:  # opened as the training set is: its URL options (where a URL), its targets,
            # and the training set's class map, so that a validation set without some class numbers the others alike
            val_options = url_options if is_remote(args.val) else {}
            val = open_dataset(args.val, **val_options, **_given_targets(args), classes=reader.classes)
            opened.callback(_close, val)
            config = dataclasses.replace(config, val=val)
        run_train(reader, config, emit=print)
    return 0


def _close(reader: Any) -> None:
    """Stop a reader's downloads ahead, where it has any (a streamed set at a URL)."""
    close = getattr(reader, "close", None)
    if callable(close):
        close()


def _given_targets(args: argparse.Namespace) -> dict[str, Any]:
    """--target and --num-classes as `open_dataset` keywords, those given only."""
    return {k: v for k, v in _targets(args).items() if v is not None}


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


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "make-synthetic": _cmd_make_synthetic,
    "pack": _cmd_pack,
    "inspect": _cmd_inspect,
    "bench": _cmd_bench,
    "stages": _cmd_stages,
    "train": _cmd_train,
    "doctor": _cmd_doctor,
}


# Loggers of the object-store clients: WARNING and above, and under -v also their INFO lines (not their
# DEBUG lines, which are every request's headers).
CHATTY = ("botocore", "aiobotocore", "s3fs", "fsspec", "gcsfs", "urllib3")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.default_of = parser.commands[args.command].get_default  # what `_changed` compares with
    quiet = int(os.environ.get("RANK", "0")) > 0  # under torchrun only rank 0 talks; the others warn
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in CHATTY:  # their INFO lines ("Found credentials in environment variables") on every run
        logging.getLogger(name).setLevel(logging.INFO if args.verbose else logging.WARNING)
    from .data.remote.errors import RemoteDataError

    try:
        from .data.checks import apply_pixel_limit_env

        if getattr(args, "dataset", None) == "":  # Path("") is the current folder
            raise UserError("the data set is an empty path (''); name a folder, shards or a URL")
        apply_pixel_limit_env()
        with _log_above_bars():
            return int(COMMANDS[args.command](args) or 0)
    except (UserError, ValueError, FileNotFoundError, FileExistsError, RemoteDataError) as e:
        print(f"dali-fast {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dali-fast {args.command}: interrupted", file=sys.stderr)
        return 130


def _log_above_bars() -> Any:
    """On a terminal, log lines are written above the progress bars, not into them (without a terminal
    there are no bars: each stage logs a line instead)."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


if __name__ == "__main__":
    sys.exit(main())
