"""One pass over a loader (one ``iter()``): its token, the rule that ``close()`` ends it for every backend,
and what a pass says when asked for a batch after it was abandoned or closed."""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)

ABANDONED = (
    "this pass over the loader was abandoned when another started (iter(), set_epoch() or load_state_dict()); "
    "iterate one pass at a time"
)
CLOSED = (
    "this pass over the loader ended when the loader was closed (close()); start a new pass with iter(loader) "
    "(the epoch from its start, or from a state loaded with load_state_dict())"
)


class Pass:
    """The token of one pass (one ``iter()``): whether ``close()`` ended it, and its backend run (a weak
    reference, so that a pass the caller drops still releases what its run holds at once)."""

    __slots__ = ("closed", "run")

    def __init__(self) -> None:
        self.closed = False
        self.run: weakref.ref | None = None


def close_ends_the_pass(cls: type) -> None:
    """Wrap ``cls``'s own ``close()`` so that it first ends the pass in progress (`end_pass`)."""
    own = cls.__dict__.get("close")
    if own is None or getattr(own, "_ends_the_pass", False):
        return

    @functools.wraps(own)
    def close(self: Any, *args: Any, **kw: Any) -> Any:
        end_pass(self)
        return own(self, *args, **kw)

    close._ends_the_pass = True  # type: ignore[attr-defined]
    cls.close = close  # type: ignore[attr-defined]


def end_pass(loader: Any) -> None:
    """``close()`` from outside a pass's run: the pass ends, its run is closed now (what it holds is
    released), and asking it for another batch raises `CLOSED`. Called from inside the run (a backend
    rebuilding), it does nothing."""
    token = loader.__dict__.get("_current_pass")
    if token is None:
        return
    gen = loader._active() if loader._active is not None else None  # noqa: SLF001
    if gen is not None and inspect.getgeneratorstate(gen) == inspect.GEN_RUNNING:
        return
    token.closed = True
    loader._current_pass = None  # noqa: SLF001
    loader._epoch_bs = None  # noqa: SLF001
    run = token.run() if token.run is not None else None
    if run is not None:
        run.close()  # GeneratorExit at its yield: its finally blocks release pipelines and worker iterators
    log.debug("close() ended the pass in progress")
