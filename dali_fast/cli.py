"""The `dali-fast` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("dali_fast")


class UserError(Exception):
    """Bad input: reported as one line, exit code 2."""


def _cmd_make_synthetic(args: argparse.Namespace) -> int:
    from .synthetic import make_synthetic

    make_synthetic(args.out, images=args.images, classes=args.classes, seed=args.seed)
    print(f"wrote {args.images} images in {args.classes} classes to {args.out}")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    from .records import pack

    report = pack(args.src, args.dst, verify=not args.no_verify, max_side=args.max_side)
    print(report.summary())
    for path, reason in report.skipped:
        print(f"  left out {path}: {reason}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    import numpy as np

    from .records import MemmapReader, open_dataset

    reader = open_dataset(args.dataset)
    n = len(reader)
    print(f"data set: {args.dataset} ({type(reader).__name__})")
    print(f"records:  {n}")
    print(
        f"classes:  {len(reader.classes)} ({', '.join(reader.classes[:5])}{', ...' if len(reader.classes) > 5 else ''})"
    )
    if isinstance(reader, MemmapReader):
        lengths = np.asarray(reader.records["length"], dtype=np.int64)
        total = int(lengths.sum())
        counts = np.bincount(np.asarray(reader.records["label"], dtype=np.int64), minlength=len(reader.classes))
    else:
        sizes = [Path(reader.source(i)).stat().st_size for i in range(n)]
        total = int(sum(sizes))
        counts = np.bincount(reader.labels, minlength=len(reader.classes))
    print(f"bytes:    {total} ({total / 2**20:.1f} MiB), mean {total / max(n, 1) / 1024:.1f} KiB per record")
    print(f"per class: min {int(counts.min()) if n else 0}, max {int(counts.max()) if n else 0}")
    if args.verify:
        if not isinstance(reader, MemmapReader):
            raise UserError(f"{args.dataset}: --verify checks crc32 of a packed data set; pack it first")
        bad = reader.verify(progress=True)
        if bad:
            print(f"verify:   {len(bad)} corrupt records: " + ", ".join(f"{i} ({reader.source(i)})" for i in bad[:10]))
            return 1
        print(f"verify:   all {n} records match their crc32")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dali-fast", description="Feed the GPU: DALI data loading for PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("make-synthetic", help="write a synthetic ImageNet-like ImageFolder of JPEGs")
    s.add_argument("out", help="output folder (OUT/<class>/<image>.jpg)")
    s.add_argument("--images", type=int, default=1000)
    s.add_argument("--classes", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_make_synthetic)

    s = sub.add_parser("pack", help="pack an ImageFolder into one memory-mappable data set")
    s.add_argument("src", help="ImageFolder root SRC/<class>/<image>")
    s.add_argument("dst", help="destination folder (must not exist)")
    s.add_argument("--no-verify", action="store_true", help="do not decode each image (faster; structural check only)")
    s.add_argument("--max-side", type=int, default=None, help="re-encode images whose longer side exceeds N pixels")
    s.set_defaults(func=_cmd_pack)

    s = sub.add_parser("inspect", help="describe a data set (packed or ImageFolder)")
    s.add_argument("dataset")
    s.add_argument("--verify", action="store_true", help="check every record's crc32 (packed sets)")
    s.set_defaults(func=_cmd_inspect)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


# Later commands (bench, train, doctor) register themselves here.
_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
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
