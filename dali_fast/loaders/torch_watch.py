"""`TorchIterator`'s watch over its decode workers while a pass waits for them: a pass never waits forever.

DataLoader itself names a worker that died only every 5 s, and never one that lives but is stuck (a
deadlock in a native library, a finalizer that waits on a thread the fork left behind): the pass then
waits for ever. `watched` waits in short polls instead: a worker that died is named at the next poll (half
a second); a worker that holds a task and has used no CPU time for `stuck_seconds` (default 120 s,
``DALI_FAST_STUCK_WORKER_S``; longer than a remote read's own timeout, so a slow server is not taken for
a stuck worker) is named as stuck, its Python stack written to stderr first (`torch_worker.worker_init`
registers the dump on SIGUSR1), then killed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

POLL_S = 0.5  # seconds of each wait for a worker's result: how soon a dead worker is named
STUCK_ENV = "DALI_FAST_STUCK_WORKER_S"
STUCK_DEFAULT_S = 120.0
DUMP_SIGNAL = signal.SIGUSR1  # a worker writes its Python stack to stderr on it
_TIMED_OUT = "DataLoader timed out after"  # DataLoader's RuntimeError when a wait of `timeout` s ends empty
_NOTHING = object()  # a poll that ended without a result


class StuckWorkerError(RuntimeError):
    """A decode worker held a task without using the CPU for `stuck_seconds`: it was killed."""


def stuck_seconds() -> float:
    """Seconds a worker may hold a task without using the CPU (``DALI_FAST_STUCK_WORKER_S``, else 120)."""
    text = os.environ.get(STUCK_ENV, "")
    try:
        value = float(text) if text else STUCK_DEFAULT_S
    except ValueError:
        raise ValueError(f"{STUCK_ENV}={text!r}: must be a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{STUCK_ENV}={text!r}: must be a number of seconds above 0")
    return value


def cpu_ticks(pid: int) -> int | None:
    """The CPU time (user + system, in clock ticks) process ``pid`` has used; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class _Watch:
    """Each busy worker's CPU time and when it last changed."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.seen: dict[int, tuple[int | None, float]] = {}  # pid -> (cpu ticks, since when unchanged)

    def stuck(self, busy: list[Any], now: float) -> Any:
        """The first of ``busy`` (worker processes holding a task) that has used no CPU for the limit."""
        pids = {w.pid for w in busy}
        self.seen = {pid: seen for pid, seen in self.seen.items() if pid in pids}
        for w in busy:
            ticks, before = cpu_ticks(w.pid), self.seen.get(w.pid)
            if before is None or ticks is None or ticks != before[0]:
                self.seen[w.pid] = (ticks, now)  # first seen busy, or it used the CPU since
            elif now - before[1] >= self.limit:
                return w
        return None


def busy_workers(it: Any) -> list[Any]:
    """The worker processes of DataLoader iterator ``it`` that hold a task whose result has not come."""
    workers = getattr(it, "_workers", [])
    ids = {info[0] for info in getattr(it, "_task_info", {}).values() if len(info) == 1}
    return [workers[i] for i in sorted(ids) if i < len(workers)]


def watched(loader: Any) -> Iterator[Any]:
    """``iter(loader)`` (a DataLoader with worker processes), waiting for each result in polls of
    `POLL_S`: a dead worker raises DataLoader's own error at the next poll; a stuck one is killed and
    raises `StuckWorkerError` naming it."""
    loader.timeout = POLL_S  # read by the iterator DataLoader makes (or, persistent, re-arms) for this pass
    it = iter(loader)
    it._timeout = POLL_S  # noqa: SLF001 - a persistent iterator made before keeps its own copy
    watch = _Watch(stuck_seconds())
    checked = time.monotonic()
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except RuntimeError as e:
            if not str(e).startswith(_TIMED_OUT):
                raise
            item = _NOTHING
        now = time.monotonic()
        if item is _NOTHING or now - checked >= POLL_S:  # also while others' results come (idle tasks do)
            checked = now
            worker = watch.stuck(busy_workers(it), now)
            if worker is not None:
                raise _stuck(it, worker, watch.limit)
        if item is not _NOTHING:
            yield item


def _stuck(it: Any, worker: Any, limit: float) -> StuckWorkerError:
    """Dump ``worker``'s stack to stderr, kill it, and say so. DataLoader's SIGCHLD handler is told to
    forget the pool's workers first: it would report the kill as a death, in place of this error."""
    from torch.utils.data import _utils

    if getattr(it, "_worker_pids_set", False):
        _utils.signal_handling._remove_worker_pids(id(it))  # noqa: SLF001 - what DataLoader's shutdown does first
        it._worker_pids_set = False  # noqa: SLF001
    for sig, pause in ((DUMP_SIGNAL, 0.5), (signal.SIGKILL, 0.0)):
        try:
            os.kill(worker.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(pause)
    return StuckWorkerError(
        f"DataLoader worker (pid {worker.pid}) is stuck: it held a task for {limit:g} s without using the CPU; "
        f"its Python stack is on stderr, and it was killed (set {STUCK_ENV} to wait longer)"
    )
