"""The ordered worker pool both formats write through: each task runs in this process or in a forked worker,
the results come back in the tasks' order (so the output is byte-identical for any number of workers), and
a fixed number of tasks is in flight whatever the data set's size."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from ...machine import die_with_parent

T, R = TypeVar("T"), TypeVar("R")

PACK_CHUNK = 16  # images per task handed to a worker
PACK_WINDOW = 4  # tasks in flight per worker: what bounds the memory of a pack
PACK_SMALL = 256  # below this many images the default is one process (starting workers costs more)


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
