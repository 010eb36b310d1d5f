"""`DALIIterator`'s pipeline: the external-source batch callable that feeds it (`BatchSource`) and its build.

The source owns the epoch's cursor: it is armed with the epoch's list of index batches and
hands them out in order, raising StopIteration when the list is done. DALI calls it ahead of
consumption (prefetch) and past the end of the epoch; since the list, not an
``iteration * batch_size`` formula, decides what comes next, prefetch depth and batch-size
changes cannot duplicate or lose samples.

DALI takes the source's arrays without a copy (``no_copy``: a packed set's records are views of its
memory map), handed over as one ``TensorListCPU`` over the records' own memory (DALI's per-sample wrapping
of a list of arrays cost the training thread more than reading them). The source also holds each batch's
arrays until that batch is delivered (`BatchSource.consume`), by when DALI has read them and copied its
outputs out.
"""

from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.base import Reader, batch_reader, read_checked
from ..data.checks import pillow_reason
from ..transforms.dali import augment
from ..transforms.recipe import Recipe
from .bad_records import BadRecordError, SkipLog, bad_record_message

log = logging.getLogger(__name__)


# Records read at once from a reader whose reads are views of a map (``reads_views``: a packed set): the
# plan's batches are read in runs of at least this many records, then handed out one batch per call. DALI
# calls the source on the training thread, where a read's fixed cost (numpy calls on caches that DALI's
# decoding threads keep cold) was 5x what it is outside DALI: a run pays it once for several small batches,
# and views hold no memory. Other readers (files, a cache's copies) read one batch per call.
READ_AHEAD_RECORDS = 512


class BatchSource:
    """A batch-mode external-source callable over a planned list of index batches.

    Returns ``(encoded images, labels)`` per call: the images as one ``TensorListCPU`` over the records'
    memory, the labels as one array (and the erasing boxes as a third, when asked). ``fed`` records, per batch handed to DALI,
    how many planned samples it accounts for (skipped ones included), in order, so the
    consumer can advance its cursor exactly by what it received. A packed set's batches are read in runs
    of `READ_AHEAD_RECORDS` records; a bad record is named (or skipped) when its batch is handed out.
    """

    def __init__(
        self,
        reader: Reader,
        plan: Sequence[np.ndarray],
        on_error: str,
        skips: SkipLog,
        exclude: Mapping[int, str] | None = None,
        boxes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.reader = reader
        self._read = batch_reader(reader)  # what the reader provides, looked up once
        self._run_records = READ_AHEAD_RECORDS if getattr(reader, "reads_views", False) else 1
        self.boxes = boxes  # indices -> float32 (n, 4) rows (top, left, h, w) of their erasing boxes, a third output
        self.plan = list(plan)
        self.on_error = on_error
        self.skips = skips
        self.exclude = exclude or {}  # records known to break the decoder: skipped and counted
        self.next = 0
        self.stopped = False
        self.fed: deque[Fed] = deque()  # batches handed to DALI, not yet delivered
        self.tail_skipped: list[tuple[int, str]] = []
        self._ahead: deque[tuple[np.ndarray, list, np.ndarray, dict[int, str]]] = deque()  # read, not handed out
        from nvidia.dali.tensors import TensorListCPU

        self._tensor_list = TensorListCPU

    def stop(self) -> None:
        """Hand out nothing more (the consumer has left the epoch)."""
        self.stopped = True

    def rearm(
        self,
        plan: Sequence[np.ndarray],
        exclude: Mapping[int, str] | None = None,
        boxes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """Start handing out a new plan (the next epoch's, in a pipeline kept from the last one)."""
        if (boxes is None) != (self.boxes is None):
            raise ValueError("a kept pipeline's source cannot start or stop giving erasing boxes")
        self.boxes = boxes
        self.plan = list(plan)
        self.exclude = exclude or {}
        self.next = 0
        self.stopped = False
        self.fed.clear()
        self.tail_skipped = []
        self._ahead.clear()

    def __call__(self) -> tuple:
        consumed = batches = 0
        skipped: list[tuple[int, str]] = []
        while not self.stopped and self.next < len(self.plan):
            if not self._ahead:
                self._read_ahead()
            indices, datas, labels, bad = self._ahead.popleft()
            self.next += 1
            batches += 1
            consumed += len(indices)
            if self.exclude:  # records known to break the decoder (after a pipeline failure in skip mode)
                bad.update((pos, self.exclude[i]) for pos, i in enumerate(indices.tolist()) if i in self.exclude)
            kept = indices
            if bad:
                if self.on_error == "raise":
                    first = min(bad)
                    raise BadRecordError(bad_record_message(self.reader, int(indices[first]), bad[first]))
                skipped += [(int(indices[pos]), bad[pos]) for pos in sorted(bad)]
                keep = [pos for pos in range(len(indices)) if pos not in bad]
                datas, labels, kept = [datas[pos] for pos in keep], labels[keep], indices[keep]
            if datas:
                # One TensorList of the records (no copy): DALI then skips its own per-sample wrapping and
                # checks of a list of arrays, which cost the training thread more than reading them.
                jpegs = self._tensor_list(datas, None, False)
                out = (jpegs, labels) if self.boxes is None else (jpegs, labels, self.boxes(kept))
                self.fed.append(Fed(consumed, kept.tolist(), batches, skipped, (datas, *out)))
                return out
        self.tail_skipped += skipped  # the plan ended on records that were all skipped
        skipped = []
        raise StopIteration

    def _read_ahead(self) -> None:
        """Read the next plan batch, or for a packed set the next batches of `READ_AHEAD_RECORDS` records
        (or the plan's rest), at once."""
        at, records, stop = self.next + len(self._ahead), 0, len(self.plan)
        end = at
        while end < stop and (end == at or records < self._run_records):
            records += len(self.plan[end])
            end += 1
        parts = [np.asarray(b, dtype=np.int64) for b in self.plan[at:end]]
        datas, labels, bad = self._read(np.concatenate(parts) if len(parts) > 1 else parts[0])
        start = 0
        for indices in parts:
            n = len(indices)
            own = {pos - start: why for pos, why in bad.items() if start <= pos < start + n} if bad else {}
            self._ahead.append((indices, datas[start : start + n], labels[start : start + n], own))
            start += n

    def finish(self) -> None:
        """The pipeline delivered everything: count the skipped records after its last batch."""
        for i, reason in self.tail_skipped:
            self.skips.add(i, self.reader.source(i), reason)
        self.tail_skipped = []

    def consume(self) -> Fed:
        """The oldest batch handed to DALI, now delivered: its skipped records are counted here, so a
        batch that was prefetched but never delivered (the pipeline failed first) counts nothing."""
        fed = self.fed.popleft()
        for i, reason in fed.skipped:
            self.skips.add(i, self.reader.source(i), reason)
        return fed


@dataclass
class Fed:
    """One batch handed to DALI: planned samples and plan batches it accounts for, what it kept and skipped,
    and what was handed over: the records' arrays, then the outputs (DALI reads the arrays in place)."""

    consumed: int
    kept: list[int]
    batches: int
    skipped: list[tuple[int, str]]
    arrays: tuple = ()


def undecodable(reader: Reader, indices: Sequence[int]) -> dict[int, str]:
    """The records among ``indices`` that do not decode on the CPU (Pillow), with the reason for each."""
    from PIL import Image

    out: dict[int, str] = {}
    for i in indices:
        data, _, reason = read_checked(reader, i)
        if reason is None:
            try:
                with Image.open(io.BytesIO(bytes(data))) as im:
                    im.load()
            except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
                reason = pillow_reason(e)
        if reason is not None:
            out[int(i)] = reason
    return out


def shutdown_pipeline(pipe: Any) -> None:
    """Stop a DALI pipeline's worker threads and free its buffers now, not at garbage collection."""
    shutdown = getattr(pipe, "_shutdown", None)  # what Pipeline.__del__ calls
    if shutdown is not None:
        shutdown()


def derive_seed(*parts: int) -> int:
    """A 31-bit pipeline seed from integers (seed, epoch, rank, start position)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def build_pipeline(
    source: BatchSource,
    *,
    max_batch: int,
    train: bool,
    recipe: Recipe,
    gpu: bool,
    device_id: int | None,
    seed: int,
    num_threads: int,
    prefetch: int,
    layout: str = "CHW",
    decode: str | None = None,
):
    """Build the decode → (random-resized-)crop → augment → normalize/flip → erase pipeline, fed by ``source``
    (``decode``: how training decodes, "whole" or "roi", see `transforms.dali.augment`)."""
    from nvidia.dali import pipeline_def

    conditionals = {"enable_conditionals": True} if train and recipe.auto_augment is not None else {}

    @pipeline_def(
        batch_size=max_batch,
        num_threads=num_threads,
        device_id=device_id if gpu else None,
        seed=seed,
        prefetch_queue_depth=prefetch,
        **conditionals,
    )
    def pipe():
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types

        # no_copy: DALI reads the source's arrays where they are (the source keeps them until delivered)
        if source.boxes is None:
            jpegs, labels = fn.external_source(
                source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64], no_copy=True
            )
            erase = None
        else:
            jpegs, labels, erase = fn.external_source(
                source=source,
                num_outputs=3,
                batch=True,
                dtype=[types.UINT8, types.INT64, types.FLOAT],
                no_copy=True,
            )
        images = augment(
            jpegs,
            train=train,
            recipe=recipe,
            gpu=gpu,
            layout=layout,
            num_threads=num_threads,
            erase=erase,
            decode=decode,
        )
        if gpu:
            labels = labels.gpu()
        return images, labels

    p = pipe()
    p.build()
    return p
