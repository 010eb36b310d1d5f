"""Spies: wrap a function to see how its calls ran."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ConcurrencySpy:
    """Wraps ``real``: each call holds for ``hold`` seconds (so calls that can overlap do), and the spy counts
    the calls running at once, the most ever (`most`), and the names of the threads they ran on (`threads`).

    Args:
        real: the function to call after the hold, with the same arguments.
        hold: seconds each call waits, counted as running, before it calls ``real``.
    """

    def __init__(self, real: Callable, hold: float = 0.02):
        self.real, self.hold = real, hold
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.threads: set[str] = set()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.threads.add(threading.current_thread().name)
        time.sleep(self.hold)
        with self.lock:
            self.now -= 1
        return self.real(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ConcurrencySpy(now={self.now}, most={self.most}, threads={sorted(self.threads)})"
