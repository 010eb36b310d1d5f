"""How gpu_check times a row of the loader-ceiling and models steps: epochs after a warm-up until a window
of at least ``min_seconds`` of timed work, every ``next()`` timed (p50, p99 and max of the batch times),
the JPEG engine's and the GPU's utilization sampled meanwhile (NVML), and the share of a data set the
hardware decoder takes at all (nvImageCodec with its hardware backend only).

A window of a few tenths of a second (two epochs of 4,096 images at 32k img/s) is mostly iterator resets,
prefetch refills and a handful of NVML readings; a window of 3 s or more is mostly decoding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

MIN_SECONDS = 3.0  # the shortest timed window of a row
MAX_EPOCHS = 200  # a timed window never runs more epochs than this, however fast they are


def sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


class BatchTimes:
    """The time of each ``next()`` of an iterator, in seconds, and how many images the batches held."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.images = 0

    def over(self, batches: Iterable[Any], count: Callable[[Any], int]) -> None:
        """Run ``batches`` to the end, timing each ``next()`` and counting its images with ``count``."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.times.append(time.perf_counter() - t0)
            self.images += count(batch)

    def stats(self) -> dict[str, float]:
        """p50, p99 and max of the batch times, in milliseconds (empty without batches)."""
        if not self.times:
            return {}
        ms = np.array(self.times) * 1000
        return {
            "batch_ms_p50": float(np.percentile(ms, 50)),
            "batch_ms_p99": float(np.percentile(ms, 99)),
            "batch_ms_max": float(ms.max()),
        }


def timed_window(
    epoch: Callable[[int, BatchTimes], None],
    *,
    gpu: bool,
    min_epochs: int = 1,
    min_seconds: float = MIN_SECONDS,
    first: int = 1,
) -> tuple[float, BatchTimes, int]:
    """Run ``epoch(number, times)`` for epochs ``first``, ``first + 1``, ... until at least ``min_epochs``
    ran and ``min_seconds`` passed (the caller ran its warm-up before): (seconds, the batch times, epochs)."""
    times = BatchTimes()
    t0, n = time.perf_counter(), 0
    while n < min_epochs or (time.perf_counter() - t0 < min_seconds and n < MAX_EPOCHS):
        epoch(first + n, times)
        sync(gpu)
        n += 1
    return time.perf_counter() - t0, times, n


def loader_epoch(loader: Any) -> Callable[[int, BatchTimes], None]:
    """One epoch of a dali_fast loader (``set_epoch`` then its batches), timed batch by batch."""

    def run(number: int, times: BatchTimes) -> None:
        loader.set_epoch(number)
        times.over(loader, lambda batch: len(batch[1]))

    return run


class EngineSampler:
    """Samples NVML's JPEG-engine and GPU utilization every ``interval`` s in a thread."""

    def __init__(self, nvml: Any, handle: Any, interval: float = 0.05) -> None:
        self.nvml, self.handle, self.interval = nvml, handle, interval
        self.jpeg: list[float] = []
        self.gpu: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EngineSampler:
        if self.nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                util = self.nvml.nvmlDeviceGetJpgUtilization(self.handle)
                self.jpeg.append(float(util[0] if isinstance(util, list | tuple) else util))
            except Exception:  # noqa: BLE001 - no JPEG engine (or not readable): no JPEG figure
                pass
            try:
                self.gpu.append(float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:  # noqa: BLE001
                pass

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def idle(self) -> bool:
        """The engine was read and read 0 % every time."""
        return bool(self.jpeg) and max(self.jpeg) == 0

    def figures(self) -> dict[str, Any]:
        why = "n/a (no NVML reading)"
        return {
            "jpeg_util_peak": max(self.jpeg) if self.jpeg else why,
            "jpeg_util_mean": float(np.mean(self.jpeg)) if self.jpeg else why,
            "gpu_util_mean": float(np.mean(self.gpu)) if self.gpu else why,
            "nvml_samples": len(self.jpeg) or len(self.gpu),
        }


def engine_eligible_share(datas: list[bytes], device: int, batch: int = 256) -> tuple[float, int]:
    """(the share of ``datas`` nvImageCodec's hardware JPEG decoder decodes, how many it refused): each
    decoded with the hardware backend alone, as the engine would take it; what it cannot (progressive
    JPEGs, some chroma layouts) comes back as None."""
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(device_id=device, backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
    refused = 0
    for k in range(0, len(datas), batch):
        streams = [nvimgcodec.CodeStream(d) for d in datas[k : k + batch]]
        refused += sum(img is None for img in decoder.decode(streams))
    return (len(datas) - refused) / max(1, len(datas)), refused
