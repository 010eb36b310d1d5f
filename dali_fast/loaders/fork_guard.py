"""Fork safety: what a forked child (a DataLoader worker) inherits of its parent's DALI pipelines, worker
pools and read-ahead threads is kept alive there, untouched, and never torn down.

A loader the parent no longer reaches may still await the cycle collector when the parent forks; the child
inherits it, and its collector then runs the loader's ``__del__``. Shutting down a DALI pipeline there
waits on threads that exist only in the parent (the child hung, or aborted in DALI's ``_shutdown``), and
shutting down a worker pool there signals the parent's workers to exit. So, in the child, right after the
fork: each attribute an owner named with `hold` is moved into a list the child keeps for its whole life
(never finalized) and set to None, so ``close()`` and ``__del__`` find nothing to release; and every DALI
pipeline of the parent is kept the same way, its native half detached, so its own ``__del__`` and DALI's
exit hook do nothing there. The parent keeps and releases its own as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Any

_HELD: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
_INHERITED: list[Any] = []  # in a forked child: the parent's resources, held until the child exits


def hold(owner: Any, *attributes: str) -> None:
    """In a child forked from now on, take ``owner``'s ``attributes`` away (kept alive, set to None)."""
    _HELD[owner] = tuple(dict.fromkeys((*_HELD.get(owner, ()), *attributes)))


def inherited() -> list[Any]:
    """What this process holds of its parent's because it was forked (empty in a process never forked)."""
    return _INHERITED


def _disown_in_child() -> None:
    for owner, attributes in list(_HELD.items()):
        for name in attributes:
            value = getattr(owner, name, None)
            if value is not None:
                _INHERITED.append(value)
                with contextlib.suppress(AttributeError):
                    setattr(owner, name, None)
    pipeline = sys.modules.get("nvidia.dali.pipeline")  # DALI imported: pipelines may exist
    for ref in list(getattr(getattr(pipeline, "Pipeline", None), "_pipes", ())):
        pipe = ref()
        native = getattr(pipe, "_pipe", None)
        if native is not None:
            _INHERITED.extend((pipe, native))
            pipe._pipe = None  # noqa: SLF001 - DALI's _shutdown (its __del__, its exit hook) is then a no-op


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_in_child)
