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


class DaliCalls(list):
    """The DALI operators `transforms.dali.augment` called, as (name, args, kwargs) in call order, each
    operator returning its own name (so an operator's input names the one that made it)."""

    def last(self, name: str) -> tuple[tuple, dict]:
        """(args, kwargs) of the last call of ``name``."""
        return next((args, kwargs) for n, args, kwargs in reversed(self) if n == name)

    def names(self) -> list[str]:
        return [n for n, _, _ in self]


def record_dali_ops(monkeypatch, auto_augment=None):
    """DALI's operators replaced by recorders (`DaliCalls`): ``decode`` for ``fn.decoders.image``,
    ``decode_roi`` for ``fn.decoders.image_random_crop``, ``flip`` for ``fn.random.coin_flip``, and the
    operators of ``fn`` by their own names. ``auto_augment`` replaces the graph's automatic augmentation
    (default: none, the images pass through). Returns (`dali_fast.transforms.dali`, the calls)."""
    import nvidia.dali.fn as fn

    import dali_fast.transforms.dali as graph

    seen = DaliCalls()

    def record(name):
        def op(*args, **kwargs):
            seen.append((name, args, kwargs))
            return name

        return op

    for name in ("resize", "crop_mirror_normalize", "erase", "cast", "random_resized_crop"):
        monkeypatch.setattr(fn, name, record(name))
    monkeypatch.setattr(fn.decoders, "image_random_crop", record("decode_roi"))
    monkeypatch.setattr(fn.decoders, "image", record("decode"))
    monkeypatch.setattr(fn.random, "coin_flip", record("flip"))
    monkeypatch.setattr(graph, "auto_augment", auto_augment or (lambda images, recipe: images))
    return graph, seen
