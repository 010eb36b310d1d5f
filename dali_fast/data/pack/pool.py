"""The ordered worker pool both formats write through: each task runs in this process or in a forked worker,
the results come back in the tasks' order (so the output is byte-identical for any number of workers), and
a fixed number of tasks is in flight whatever the data set's size. Also the pool's size and the checks both
formats make before any work."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ...machine import available_cpus, die_with_parent
from ...text import plural

T, R = TypeVar("T"), TypeVar("R")

PACK_CHUNK = 16  # images per task handed to a worker
PACK_WINDOW = 4  # tasks in flight per worker: what bounds the memory of a pack
PACK_SMALL = 256  # below this many images the default is one process (starting workers costs more)

log = logging.getLogger(__name__)


def check_pack_options(max_side: int | None, workers: int | None) -> None:
    """Refuse a ``max_side`` or ``workers`` below 1 in one line before any work; warn of more workers than
    the CPUs this process may use (they would only compete: `pool_size` caps them)."""
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side={max_side}: must be a positive number of pixels")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers}: must be 1 or more")
    if workers is not None and workers > available_cpus():
        cpus = available_cpus()
        log.warning(
            "workers=%d: more than the %s this process may use; packing with %d", workers, plural(cpus, "CPU"), cpus
        )


def check_destination(dst: Path, src: Path | None) -> None:
    """Refuse a local destination that exists, or one inside a source folder (the next pack of that folder
    would read it as a class), before any work."""
    if dst.exists():
        raise FileExistsError(f"{dst}: already exists; remove it or choose another destination")
    if src is not None and src.is_dir() and dst.resolve().is_relative_to(src.resolve()):
        raise ValueError(f"{dst}: inside the source {src}; choose a destination outside it")


def pool_size(workers: int | None, images: int) -> int:
    """The processes a pack of ``images`` uses: ``workers`` capped at the CPUs this process may use, by
    default every CPU once starting the workers pays off (`PACK_SMALL` images), else one."""
    if workers is None:
        workers = available_cpus() if images >= PACK_SMALL else 1
    return min(workers, available_cpus())


def prepared_in_order(
    tasks: Iterable[tuple[T, tuple[Any, ...]]],
    work: Callable[..., R],
    workers: int,
    setup: Callable[..., None] | None = None,
    setup_args: tuple[Any, ...] = (),
) -> Iterator[tuple[T, R]]:
    """``(tag, work(*args))`` for each ``(tag, args)`` of ``tasks``, in order: in this process with one
    worker, else by ``workers`` processes with at most ``workers * PACK_WINDOW`` tasks in flight, each
    worker first running ``setup(*setup_args)``. ``tasks`` is drawn lazily (what a task reads is read as it
    is submitted). The workers die with this process, even when it is killed, and the tasks not started
    when the caller stops are cancelled."""
    tasks = iter(tasks)
    if workers <= 1:
        for tag, args in tasks:
            yield tag, work(*args)
        return
    # fork, as DataLoader's workers on Linux: forkserver and spawn would re-run the caller's script in
    # every worker unless it guards itself with `if __name__ == "__main__"`.
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    start = (os.getpid(), setup, setup_args)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker, initargs=start) as pool:
        pending: deque = deque()

        def submit() -> None:
            task = next(tasks, None)
            if task is not None:
                tag, args = task
                pending.append((tag, pool.submit(work, *args)))

        for _ in range(workers * PACK_WINDOW):
            submit()
        try:
            while pending:
                tag, future = pending.popleft()
                submit()
                yield tag, future.result()
        finally:
            for _, future in pending:
                future.cancel()


# pragma: no mutate start (runs in the worker processes, where mutmut does not follow; the pool tests cover it)
def _start_worker(parent: int, setup: Callable[..., None] | None, setup_args: tuple[Any, ...]) -> None:
    """A worker: dies with its parent, then runs the caller's ``setup``."""
    die_with_parent(parent)
    if setup is not None:
        setup(*setup_args)


# pragma: no mutate end
