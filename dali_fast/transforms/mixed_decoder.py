"""How one pipeline's `mixed` decoder is set up on a GPU (`MixedDecoder`): nvJPEG's memory paddings within
fixed budgets, the hardware decoder's preallocation hints from the data set's image sizes, the share of
whole-image work for the hardware JPEG engine (`hw_decoder_load`), and the decoding threads' affinity.
numpy only: DALI is imported only to read its version."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.base import Reader, StreamingReader, provides
from ..machine import cpus_per_local_rank, devices_remapped
from .decode import stored_size

# The share of JPEG work the `mixed` decoder sends to the hardware JPEG engine when it decodes whole images
# (DALI's default, 0.65, leaves a third to the CUDA decoder, whose Huffman stage runs on the CPU threads).
# 0.99 was chosen from one mean on an H200; DALI went back to 0.65 because 0.90 raised its decoder's p99
# and maximum (NVIDIA/DALI PR #6366). gpu_check measures both, p99 included; this value stays until a run
# decides. DALI_FAST_HW_DECODER_LOAD sets another.
HW_DECODER_LOAD = 0.99
HW_DECODER_LOAD_ENV = "DALI_FAST_HW_DECODER_LOAD"

# nvJPEG preallocates, for the `mixed` decoder, one device buffer and two pinned host buffers per
# thread (DALI's decoders.image* docstring). Per-thread sizes are what DALI's ImageNet examples use,
# but the totals are bounded: with every core of a 224-core node as a thread they would reach tens
# of GB of GPU memory. So each pipeline spends at most these budgets, split between its threads.
DEVICE_PADDING_PER_THREAD = 211_025_920
HOST_PADDING_PER_THREAD = 140_544_512
DECODER_DEVICE_BUDGET = 512 * 2**20  # all threads' device paddings together, per pipeline
DECODER_PINNED_BUDGET = 1024 * 2**20  # all threads' pinned host paddings together (2 per thread)
MIXED_MAX_THREADS = 8  # default threads for GPU decoding (DALI's ResNet-50 example uses 4 per GPU)


def default_num_threads(gpu: bool = False) -> int:
    """CPU threads for one pipeline: this process's cores, split between local ranks; at most
    ``MIXED_MAX_THREADS`` when decoding on the GPU, where the threads only feed nvJPEG."""
    cpus = cpus_per_local_rank()
    return min(cpus, MIXED_MAX_THREADS) if gpu else cpus


def decoder_preallocation(num_threads: int, gpu: bool = True) -> dict[str, int]:
    """What one pipeline's decoder preallocates with ``num_threads`` threads: the per-thread paddings
    passed to DALI, and the device and pinned-host totals, both within their budgets."""
    if not gpu:
        return {"threads": num_threads, "device_padding": 0, "host_padding": 0, "device_total": 0, "pinned_total": 0}
    device = min(DEVICE_PADDING_PER_THREAD, DECODER_DEVICE_BUDGET // num_threads)
    host = min(HOST_PADDING_PER_THREAD, DECODER_PINNED_BUDGET // (2 * num_threads))
    return {
        "threads": num_threads,
        "device_padding": device,
        "host_padding": host,
        "device_total": device * num_threads,
        "pinned_total": 2 * host * num_threads,
    }


def hw_decoder_load(value: str | None = None) -> float:
    """The `mixed` decoder's ``hw_decoder_load`` for whole images: ``value``, else the
    ``DALI_FAST_HW_DECODER_LOAD`` environment variable, else `HW_DECODER_LOAD`; a value that is not a number
    from 0 to 1 is a one-line ValueError naming where it came from."""
    where = "hw_decoder_load"
    if value is None:
        value, where = os.environ.get(HW_DECODER_LOAD_ENV), HW_DECODER_LOAD_ENV
        if not value:
            return HW_DECODER_LOAD
    try:
        load = float(value)
    except ValueError:
        load = -1.0
    if not 0.0 <= load <= 1.0:
        raise ValueError(f"{where}={value!r}: use a share from 0 to 1 (0.65 is DALI's default, {HW_DECODER_LOAD} ours)")
    return load


# The hardware decoder preallocates for ``max batch`` images of the hinted size (nvImageCodec's
# nvjpegDecodeBatchedPreAllocate, taken here as 3 bytes a pixel); the hint is shrunk to keep that within this.
HW_HINT_BUDGET = 512 * 2**20
HINT_PERCENTILE = 99  # the hint covers this share of the data set's widths and of its heights


def preallocation_hints(sizes: Sequence[tuple[int, int]], max_batch: int) -> tuple[int, int]:
    """``(width, height)`` for the `mixed` decoder's ``preallocate_width_hint`` / ``preallocate_height_hint``:
    the `HINT_PERCENTILE` of the widths and of the heights in ``sizes`` (the data set's, stored), shrunk with
    its aspect kept until ``max_batch`` images of it fit `HW_HINT_BUDGET`; (0, 0), DALI's "no hint", without
    sizes. Without hints the engine's buffers grow during the first epoch, as larger images come."""
    if not sizes or max_batch < 1:
        return 0, 0
    widths, heights = sorted(w for w, _ in sizes), sorted(h for _, h in sizes)
    k = min(len(sizes) - 1, math.ceil(HINT_PERCENTILE / 100 * len(sizes)) - 1)
    width, height = widths[k], heights[k]
    shrink = min(1.0, math.sqrt(HW_HINT_BUDGET / (max_batch * width * height * 3)))
    return max(1, int(width * shrink)), max(1, int(height * shrink))


def decoder_affinity(dali_version: str | None = None) -> bool:
    """The `mixed` decoder's ``affine``: True (DALI ties each decoding thread to the GPU's CPUs, as NVML
    names them, within the thread's own CPU set) unless this DALI looks that set up by the CUDA index
    read as an NVML index (releases before 1.40; NVIDIA/DALI PR #5566 reads it by UUID) while
    CUDA_VISIBLE_DEVICES remaps the devices: it would then pin the threads to another GPU's socket, so
    they are left to the process's own CPU set (False)."""
    if not devices_remapped():
        return True
    if dali_version is None:
        import nvidia.dali

        dali_version = nvidia.dali.__version__
    try:
        major, minor = (int(x) for x in dali_version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (1, 40)


# Records whose stored sizes set the `mixed` decoder's preallocation hints: spread evenly over the data set,
# more where a read is a view of a map (a packed set), none from a reader that streams remote shards.
SIZE_SAMPLE_VIEWS = 256
SIZE_SAMPLE_FILES = 64


def sample_sizes(reader: Reader) -> list[tuple[int, int]]:
    """The stored (width, height) of records spread evenly over ``reader`` (JPEG and PNG headers; others
    are left out); none from a reader of streamed shards, where a read may fetch a whole shard."""
    if provides(reader, StreamingReader) or len(reader) == 0:
        return []
    count = SIZE_SAMPLE_VIEWS if getattr(reader, "reads_views", False) else SIZE_SAMPLE_FILES
    sizes = []
    for i in np.unique(np.linspace(0, len(reader) - 1, min(count, len(reader))).astype(np.int64)).tolist():
        try:
            size = stored_size(reader[i][0])
        except Exception:  # noqa: BLE001 - a bad record is the feed's to name; here it only has no size
            size = None
        if size is not None:
            sizes.append(size)
    return sizes


@dataclass(frozen=True)
class MixedDecoder:
    """How one pipeline's `mixed` decoder is set up.

    Args:
        threads: the pipeline's threads: nvJPEG's memory paddings are per thread, within fixed budgets.
        hw_load: the share of whole-image JPEG work for the hardware engine (`hw_decoder_load`).
        width_hint: the hardware decoder's preallocation width (`preallocation_hints`; 0: none).
        height_hint: its preallocation height.
        affine: tie the decoding threads to the GPU's CPUs (`decoder_affinity`).
    """

    threads: int
    hw_load: float = HW_DECODER_LOAD
    width_hint: int = 0
    height_hint: int = 0
    affine: bool = True

    @classmethod
    def for_data(cls, threads: int, sizes: Sequence[tuple[int, int]], max_batch: int) -> MixedDecoder:
        """The decoder for a pipeline of ``max_batch`` images drawn from images of ``sizes``: the load from
        the environment (or ours), hints from the sizes, the affinity rule for this process."""
        width, height = preallocation_hints(sizes, max_batch)
        return cls(threads, hw_decoder_load(), width, height, decoder_affinity())

    def arguments(self, roi: bool = False) -> dict[str, Any]:
        """The decoder's arguments: bounded memory paddings, the preallocation hints, the thread affinity;
        for whole images, chroma upsampled the "fancy" way, as DALI's CPU decoder, Pillow and
        `TorchIterator` do (DALI's default for `mixed` is another filter: the same JPEG would train on other
        pixels on a GPU), with ``hw_load`` of the work on the hardware JPEG engine. A crop window (``roi``)
        keeps the GPU decoder's own upsampling: with nvJPEG older than 13.2 nvImageCodec refuses a window
        with fancy upsampling on both its GPU decoders (nvJPEG may get its one-pixel edge wrong) and hands
        it to its CPU decoder."""
        pre = decoder_preallocation(self.threads, gpu=True)
        out: dict[str, Any] = {
            "device_memory_padding": pre["device_padding"],
            "host_memory_padding": pre["host_padding"],
            "affine": self.affine,
        }
        if self.width_hint > 0 and self.height_hint > 0:
            out.update(preallocate_width_hint=self.width_hint, preallocate_height_hint=self.height_hint)
        if not roi:
            out.update(jpeg_fancy_upsampling=True, hw_decoder_load=self.hw_load)
        return out
