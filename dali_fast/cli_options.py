"""The `dali-fast` command's options: the parser and its help (every option shows its default; a usage
error is one line, exit code 2); the value types are `cli_values`'. `dali_fast.cli` runs the commands."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from .cli_values import (
    alpha_arg,
    classes_file,
    count_arg,
    crop_fraction_arg,
    positive_arg,
    probability_arg,
    progressive_arg,
    size_arg,
    storage_option_arg,
)
from .data.base import ON_ERROR
from .data.targets import TARGET_KINDS


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help already says it or there is none to say
    (a switch that is off, an option that is unset); descriptions and the synopsis keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS  # 0 is a default to show
        if "(default" in text or unset or not action.option_strings:
            return text
        shown = ("on" if default else "off") if isinstance(default, bool) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong and where the help is), exit code 2, and
    every option's help shows its default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _add_model_arg(s: argparse.ArgumentParser) -> None:
    """``--model`` of the commands that time loading (bench, stages)."""
    s.add_argument(
        "--model",
        default="none",
        choices=["none", "resnet_tiny", "resnet18", "resnet50"],
        help="a training step per batch with this model (none: loading only)",
    )


def _add_remote_args(s: argparse.ArgumentParser) -> None:
    """The options of data at a URL (refused for local data, which has no use for them)."""
    s.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="data at a URL: the node-local folder its shards are cached in (default: $DALI_FAST_CACHE/remote)",
    )
    s.add_argument(
        "--cache-limit",
        type=size_arg,
        metavar="BYTES",
        default=None,
        help="data at a URL: bytes of shards the cache may hold on this node, e.g. 200G (default: the disk's "
        "free space at open, less a margin)",
    )
    s.add_argument(
        "--storage-option",
        type=storage_option_arg,
        action="append",
        metavar="KEY=VALUE",
        default=None,
        help="data at a URL: an fsspec option such as endpoint_url=http://minio:9000 or anon=true; VALUE is read "
        "as JSON where it parses (true, 3), else as text; repeatable",
    )


def _add_data_args(s: argparse.ArgumentParser, on_error: bool = True) -> None:
    """The data and batch arguments `bench`, `stages` and `train` share."""
    s.add_argument("dataset", nargs="?", default=None, help=DATASETS + " (default: the synthetic set of --images)")
    _add_remote_args(s)
    s.add_argument("--images", type=count_arg(1), default=2000, help="size of the default synthetic set")
    s.add_argument("--batch-size", type=count_arg(1), default=64, help="images per batch")
    s.add_argument("--image-size", type=count_arg(1), default=224, help="output side in pixels")
    if not on_error:
        return
    s.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="raise",
        help="an undecodable or unreadable image: stop naming it (raise), or skip, count and log it (skip)",
    )


def _add_target_args(s: argparse.ArgumentParser) -> None:
    """``--target`` and ``--num-classes``: what a sample's target is (`open_dataset`'s ``target``)."""
    s.add_argument(
        "--target",
        choices=TARGET_KINDS,
        default=None,
        help="what a sample's target is: class (one class index), multihot (a list of class indices, as rows "
        "of K 0/1) or float (a list of D numbers), the lists from each sample's .json (WebDataset) or "
        "labels.csv beside the class folders (default: the data set's own: class, or what it was packed with)",
    )
    s.add_argument(
        "--num-classes", type=count_arg(1), default=None, metavar="K", help="K, the classes of --target multihot"
    )
    _add_classes_arg(s)


def _add_classes_arg(s: argparse.ArgumentParser) -> None:
    """``--classes FILE``: the class map (`open_dataset`'s ``classes``)."""
    s.add_argument(
        "--classes",
        type=classes_file,
        metavar="FILE",
        default=None,
        help="the class names in label order, one per line or JSON (a list, or name -> index): every split "
        "numbers its classes by this list (default: the data set's own classes)",
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
    s.add_argument("--random-erasing", type=probability_arg, default=0.0, metavar="P", help="random erasing probability")
    s.add_argument("--mixup", type=alpha_arg, default=0.0, metavar="A", help="mixup Beta alpha (0: off)")
    s.add_argument("--cutmix", type=alpha_arg, default=0.0, metavar="A", help="cutmix Beta alpha (0: off)")
    s.add_argument(
        "--label-smoothing", type=probability_arg, default=0.0, metavar="E", help="label smoothing of the targets"
    )
    s.add_argument(
        "--progressive",
        type=progressive_arg,
        default=None,
        metavar="START:END:FROM_EPOCH:TO_EPOCH",
        help="progressive resizing: train at START px up to epoch FROM_EPOCH, then ramp in steps of 32 px "
        "(or a fifth field, STEP) to END px at epoch TO_EPOCH (FFCV's ImageNet recipe: 160:192:65:76); "
        "--image-size stays the evaluation size",
    )
    s.add_argument(
        "--eval-crop-fraction",
        type=crop_fraction_arg,
        default=0.875,
        metavar="F",
        help="evaluation: resize the shorter side to size/F, then centre crop",
    )


DATASETS = (
    "a packed set, an ImageFolder root, WebDataset shards (a .tar, a folder of .tar files, or a brace pattern such "
    "as 'train-{000000..000146}.tar', quoted), Parquet files (a .parquet, a folder or Hugging Face snapshot, or a "
    "pattern such as 'data/train-*.parquet', quoted) or a URL of shards or of Parquet files (s3://, gs://, https://, any fsspec URL)"
)


def _command(sub: Any, name: str, what: str) -> argparse.ArgumentParser:
    """A sub-command whose --help starts with what it does."""
    return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dali-fast", description="Feed the GPU: DALI data loading for PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True)

    s = _command(sub, "make-synthetic", "write a synthetic ImageNet-like ImageFolder of JPEGs")
    s.add_argument("out", help="output folder (OUT/<class>/<image>.jpg)")
    s.add_argument("--images", type=count_arg(1), default=1000, help="images to write")
    s.add_argument("--classes", type=count_arg(1), default=10, help="classes (each with its own tint and stripes)")
    s.add_argument("--seed", type=count_arg(0), default=0, help="the seed of the images")
    s.add_argument(
        "--multi-label",
        action="store_true",
        help="several classes per image (a coloured patch each) under OUT/images, listed in OUT/labels.csv",
    )

    s = _command(sub, "pack", "write a data set as one memory-mappable packed set, or as WebDataset shards")
    s.add_argument("src", help=DATASETS.replace("or of Parquet files", "or of Parquet files to convert"))
    s.add_argument("dst", help="destination folder (must not exist), or with --format webdataset a URL")
    s.add_argument(
        "--format",
        choices=("packed", "webdataset"),
        default="packed",
        help="packed: index.bin + data.bin (read in place, O(1) per record); webdataset: tar shards "
        "PREFIX-000000.tar, ... (.jpg/.png with .cls or .json), for object storage",
    )
    s.add_argument("--no-verify", action="store_true", help="do not decode each image (faster; structural check only)")
    s.add_argument(
        "--max-side", type=count_arg(1), default=None, help="re-encode images whose longer side exceeds N pixels"
    )
    s.add_argument(
        "--workers",
        type=count_arg(1),
        default=None,
        help="processes that read, verify and re-encode (default: every CPU); the output is the same for any N",
    )
    s.add_argument(
        "--shard-size",
        type=size_arg,
        default=None,
        metavar="BYTES",
        help="packed: write data-00000.bin, data-00001.bin, ... of at most this size (e.g. 64G) under one index "
        "(default: one data.bin); webdataset: each shard's most bytes (default: 256M)",
    )
    s.add_argument(
        "--prefix", default="shard", help="webdataset: the shards' names PREFIX-000000.tar, ... and the keys' start"
    )
    s.add_argument(
        "--no-shuffle",
        action="store_true",
        help="webdataset: keep the source's order (default: a fixed shuffle, so each shard mixes the classes)",
    )
    _add_target_args(s)
    _add_remote_args(s)

    s = _command(sub, "inspect", "describe a data set: records, classes, bytes")
    s.add_argument("dataset", help=DATASETS)
    _add_remote_args(s)
    s.add_argument("--verify", action="store_true", help="check every record's crc32 (packed sets)")
    _add_target_args(s)

    s = _command(sub, "bench", "compare the loaders side by side: img/s, utilization, memory, cache")
    _add_data_args(s)
    ffcv = "ffcv (FFCV's Loader over a .beton of the same data, written once into the cache; pip install ffcv)"
    ffcv += ", spdl (SPDL's pipeline and FFmpeg decoder; pip install spdl, and FFmpeg's libraries)"
    s.add_argument("--loaders", default="baseline,torch,dali", help=f"comma-separated: baseline,torch,dali, {ffcv}")
    s.add_argument("--epochs", type=count_arg(1), default=2, help="timed epochs after one warm-up epoch")
    s.add_argument(
        "--dtype",
        choices=("float32", "float16", "uint8"),
        default="float32",
        help="the batches' dtype: normalized float, or uint8 left for the consumer to normalize on its device",
    )
    _add_model_arg(s)
    s.add_argument("--cache-bytes", type=size_arg, default=0, help="LRU cache budget, e.g. 2G (0: off)")
    s.add_argument("--controller", action="store_true", help="let BatchSizeController pick the batch size per epoch")
    s.add_argument("--out", default="bench-results", help="folder for results.json and bench.png")
    limit = "skip the limit row (the machine's decode-only img/s on the same data and processes)"
    s.add_argument("--no-limit", action="store_true", help=limit)
    _add_target_args(s)
    s.add_argument(
        "--alternate",
        action="store_true",
        help="start every row, then time them in turn, one epoch each (a changing machine load then slows "
        "every row alike; all loaders stay alive meanwhile)",
    )
    ranks = "every row as N ranks here, each on its shard, each step waiting for the slowest (as DDP); not under torchrun"
    s.add_argument("--ranks", type=count_arg(1), default=1, help=ranks)
    s.add_argument("--isolate", action="store_true", help="each loader's rows in a fresh process: their own memory")
    _add_recipe_args(s, several=True)

    s = _command(
        sub, "stages", "measure what each optimization buys, cumulatively, one row each, and project a whole run"
    )
    _add_data_args(s, on_error=False)
    _add_classes_arg(s)
    s.add_argument("--epochs", type=count_arg(1), default=2, help="timed epochs of each stage after one warm-up epoch")
    _add_model_arg(s)
    s.add_argument("--cache-bytes", type=size_arg, default=None, help="LRU cache budget, e.g. 2G (default: half the data)")
    s.add_argument("--out", default="stages-results", help="folder for stages.json and stages.png")
    s.add_argument(
        "--progressive",
        type=progressive_arg,
        default=None,
        metavar="START:END:FROM_EPOCH:TO_EPOCH",
        help="the last row's resolution schedule (default: FFCV's ramp scaled to --total-epochs)",
    )
    s.add_argument("--total-epochs", type=count_arg(1), default=90, help="epochs of the projected run")
    s.add_argument("--total-images", type=count_arg(1), default=1_281_167, help="images per epoch of the projected run")

    s = _command(sub, "train", "train a small ResNet with the chosen loader; loss, accuracy, img/s per epoch")
    _add_data_args(s)
    val = "evaluate on this set (as DATASET) and train on all of DATASET (default: 20%% of it held out, whole shards)"
    s.add_argument("--val", metavar="PATH|URL", default=None, help=val)
    s.add_argument("--loader", default="dali", choices=["dali", "torch", "baseline"], help="the loader to train with")
    s.add_argument("--epochs", type=count_arg(1), default=5, help="epochs")
    s.add_argument(
        "--model",
        default="resnet18",
        choices=["resnet_tiny", "resnet18", "resnet50"],
        help="the model (resnet_tiny is sized for CPUs)",
    )
    s.add_argument("--lr", type=positive_arg, default=0.05, help="learning rate")
    s.add_argument("--controller", action="store_true", help="adjust the batch size between epochs from memory")
    s.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True, help="mixed precision on GPU")
    s.add_argument(
        "--seed", type=count_arg(0), default=0, help="the run's seed: split, initial weights, order, augmentation"
    )
    s.add_argument(
        "--num-workers",
        type=count_arg(0),
        default=None,
        help="decode workers (torch/baseline loaders; default: one per CPU, up to 8)",
    )
    s.add_argument(
        "--drop-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave out each epoch's incomplete last training batch",
    )
    s.add_argument("--checkpoint", metavar="DIR", default=None, help="save model/optimizer/loader state in DIR")
    s.add_argument("--checkpoint-every", type=count_arg(1), default=500, metavar="K", help="steps between checkpoints")
    s.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt, mid-epoch included")
    s.add_argument(
        "--record-indices",
        metavar="FILE",
        default=None,
        help="append each batch's sample indices as JSON lines (per rank: FILE.rank<N> or a {rank} placeholder)",
    )
    s.add_argument("--out", default=None, help="folder for train.json (rank 0 writes it)")
    _add_target_args(s)
    _add_recipe_args(s, several=False)

    s = _command(sub, "doctor", "check the GPU path: torch/CUDA, driver and GPUs, DALI, a GPU JPEG decode")
    s.add_argument(
        "--quick",
        action="store_true",
        help="NVML only (driver, GPUs): no CUDA context, no DALI pipeline; for health checks during training",
    )
    s.add_argument("--json", action="store_true", help="print the readings as JSON")
    # The synopsis: every command with every option, as argparse writes each usage line.
    usages = [c.format_usage().removeprefix("usage: ").rstrip() for c in sub.choices.values()]
    p.epilog = "synopsis:\n" + "\n".join("  " + u.replace("\n", "\n  ") for u in usages)
    p.epilog += "\n\n`dali-fast COMMAND --help` says what each option does."
    p.commands = sub.choices  # type: ignore[attr-defined]  # each command's parser, by name
    return p
