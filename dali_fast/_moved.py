"""Old import paths that the documentation once showed, kept for code written against them: each name
still resolves, to the same object as at its new home, with a DeprecationWarning naming that home."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib import import_module
from typing import Any


def moved(old: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old``: ``homes`` maps each name to its new module."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved: import it from {home} (or from dali_fast); {old} will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(import_module(home), name)

    return __getattr__
