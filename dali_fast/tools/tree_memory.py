"""The memory a loader costs its user: the PSS of a process tree (a process and every process under it,
its decode workers included), read from /proc, sampled in a thread while a phase runs.

PSS (proportional set size) counts each page once over all processes: a page shared by the main
process and four workers counts a fifth in each, so the sum over a tree is what the tree occupies. A
main process's RSS alone leaves its workers out; a sum of RSS counts shared pages once per process.
Linux only (``/proc/<pid>/smaps_rollup``); elsewhere every reading is None.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ..machine import read_proc_kib


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (those of each of its threads), from /proc; [] when it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def descendants(root: int) -> set[int]:
    """Every live process under ``root`` (children, their children...), ``root`` left out."""
    seen: set[int] = set()
    frontier = children(root)
    while frontier:
        pid = frontier.pop()
        if pid not in seen:
            seen.add(pid)
            frontier += children(pid)
    return seen


def pss_bytes(pid: int) -> int | None:
    """The PSS of one process in bytes, or None where it cannot be read (gone, or no smaps_rollup)."""
    kib = read_proc_kib(f"/proc/{pid}/smaps_rollup", "Pss")
    return None if kib is None else kib * 1024


def tree_pss(root: int, exclude: Iterable[int] = ()) -> int | None:
    """The PSS of ``root`` and every process under it, in bytes, leaving out the processes in
    ``exclude`` and everything under them (another loader's workers, alive beside this one).
    None when ``root`` itself cannot be read."""
    skip = set(exclude)
    own = pss_bytes(root)
    if own is None:
        return None
    total, frontier, seen = own, children(root), {root}
    while frontier:
        pid = frontier.pop()
        if pid in seen or pid in skip:
            continue
        seen.add(pid)
        total += pss_bytes(pid) or 0  # a worker that exits between the listing and the reading adds nothing
        frontier += children(pid)
    return total


class TreeMemory:
    """Samples the PSS of this process's tree every ``interval`` seconds while a phase runs, and keeps
    each phase's peak. ``read_now`` adds a reading on demand (bench takes one at each epoch's end).

    Reading smaps_rollup costs about 3 ms for a 250 MB process here (the kernel walks its page tables),
    so the default interval is a quarter of a second; every row pays it alike.
    """

    def __init__(self, root: int | None = None, interval: float = 0.25) -> None:
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self._phase: tuple[str, frozenset[int]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read_now(self) -> int | None:
        """One reading of the running phase's tree (None outside a phase or where /proc has none)."""
        with self._lock:
            if self._phase is None:
                return None
            name, exclude = self._phase
            value = tree_pss(self.root, exclude)
            if value is not None and value > self.peaks.get(name, -1):
                self.peaks[name] = value
            return value

    @contextmanager
    def phase(self, name: str, exclude: Iterable[int] = ()) -> Iterator[None]:
        """Readings taken inside go to ``name``'s peak (one at the start, then every ``interval``); the
        processes in ``exclude`` and under them are left out."""
        with self._lock:
            self._phase = (name, frozenset(exclude))
        self.read_now()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="dali_fast-pss", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
            with self._lock:
                self._phase = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.read_now()

    def peak(self, name: str) -> int | None:
        """The largest reading of ``name``'s phases so far, in bytes (None before any)."""
        return self.peaks.get(name)
