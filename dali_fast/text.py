"""What the package says to people: counted nouns, and progress bars that turn into one log line
where no terminal shows them."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun that agrees with it: "1 sample", "2 samples" (``many`` for irregular plurals)."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def progress_bar(total: int, desc: str, unit: str, *, enabled: bool = True, leave: bool = True) -> Any:
    """A tqdm bar on stderr when stderr is a terminal; otherwise (a log file, CI) no bar, and one log line
    saying the stage has begun. Close it (``finally``) before an error is written, so the error has its own line."""
    from tqdm import tqdm

    drawn = enabled and sys.stderr.isatty()
    if enabled and not drawn:
        log.info("%s: %s ...", desc, plural(total, {"img": "image"}.get(unit, unit)))
    return tqdm(total=total, desc=desc, unit=unit, leave=leave, disable=not drawn)


def by_reason(pairs: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """(where, why) pairs as one line, counted by reason in the order each reason first comes, with the
    first ``shown`` places of each: ``2 x why (first: a, b); 1 x other (first: c)``."""
    groups: dict[str, list[str]] = {}
    for where, why in pairs:
        groups.setdefault(why, []).append(where)
    return "; ".join(
        f"{len(places)} x {why} (first: {', '.join(places[:shown])}{', ...' if len(places) > shown else ''})"
        for why, places in groups.items()
    )
