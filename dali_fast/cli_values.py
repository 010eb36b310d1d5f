"""The `dali-fast` command's value types: sizes, counts, numbers in a range, ``KEY=VALUE`` options, resolution
ramps and class list files, each an argparse type whose error names what is wrong in one line."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any


def size_arg(text: str) -> int:
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


def storage_option_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as (key, value): VALUE read as JSON where it parses (``true``, ``3``, ``{"verify": false}``),
    else kept as text (``http://minio:9000``)."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE; e.g. endpoint_url=http://minio:9000")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def count_arg(minimum: int) -> Callable[[str], int]:
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


def number_arg(ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
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


positive_arg = number_arg(lambda v: v > 0, "a positive number")


alpha_arg = number_arg(lambda v: v >= 0, "a number >= 0 (0 turns it off)")  # a Beta distribution's alpha


probability_arg = number_arg(lambda v: 0 <= v <= 1, "in [0, 1]")


crop_fraction_arg = number_arg(lambda v: 0 < v <= 1, "in (0, 1]")


def progressive_arg(text: str) -> Any:
    """``--progressive START:END:FROM_EPOCH:TO_EPOCH[:STEP]`` as a `Progressive` ramp."""
    from .transforms.recipe import Progressive

    try:
        return Progressive.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--progressive {text!r}: ")) from None


def classes_file(text: str) -> list[str]:
    """``--classes FILE``: the class names in it, in index order (`data.classes.read_classes_file`: one name
    per line, a JSON list, or a JSON object of name -> index)."""
    from .data.classes import read_classes_file

    try:
        return read_classes_file(text)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
