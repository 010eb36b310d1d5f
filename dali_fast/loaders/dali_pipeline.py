"""`DALIIterator`'s pipeline: the external-source batch callable that feeds it (`BatchSource`) and its build
(with the `mixed` decoder set up for the data set's image sizes, `sample_sizes`).

The source owns the epoch's cursor: it is armed with the epoch's list of index batches and
hands them out in order, raising StopIteration when the list is done. DALI calls it ahead of
consumption (prefetch) and past the end of the epoch; since the list, not an
``iteration * batch_size`` formula, decides what comes next, prefetch depth and batch-size
changes cannot duplicate or lose samples.

DALI calls the source on the training thread, so the source does as little there as it can:

- only the encoded images (and the erasing boxes, when asked) go through the pipeline. A batch's labels
  are the records it holds, which the source knows, so the iterator takes them from the source when the
  batch is delivered (`BatchSource.consume`): DALI's feeding of a second input cost the training thread as
  much as the images' own;
- DALI takes the images without a copy (``no_copy``: a packed set's records are views of its memory map),
  handed over as one ``TensorListCPU`` over the records' own memory (DALI's per-sample wrapping of a list
  of arrays cost more than reading them). The source holds each batch's arrays until that batch is
  delivered, by when DALI has read them and copied its outputs out;
- a reader whose reads are views of a map (``reads_views``: a packed set; its reads are plain numpy on
  read-only maps, safe from any thread) is read ahead on a helper thread (`_ReadAhead`), which also wraps
  each batch's records in its TensorList: the training thread then only takes the next prepared batch.
  Anything the helper raises is raised by the source's call for that batch, never dropped.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.base import CheckedBatch, Reader, batch_reader, read_checked
from ..data.checks import pillow_reason
from ..transforms.dali import augment
from ..transforms.mixed_decoder import MixedDecoder, sample_sizes
from ..transforms.recipe import Recipe
from .bad_records import BadRecordError, SkipLog, bad_record_message
from .fork_guard import hold

log = logging.getLogger(__name__)


# Records read at once from a reader whose reads are views of a map (``reads_views``: a packed set): the
# plan's batches are read in runs of at least this many records, then handed out one batch per call. A
# read's fixed cost (numpy calls on caches that DALI's decoding threads keep cold) is paid once for several
# small batches, and views hold no memory. Other readers (files, a cache's copies) read one batch per call.
READ_AHEAD_RECORDS = 512


@dataclass
class _Read:
    """One plan batch as read: its indices, records, labels, ``{position: why}`` of its bad records, and
    (prepared ahead, when none is bad) the TensorList DALI takes."""

    indices: np.ndarray
    datas: list
    labels: np.ndarray
    bad: dict[int, str]
    jpegs: Any = None


def _read_runs(
    read: Callable[[np.ndarray], CheckedBatch], plan: Sequence[np.ndarray], at: int, run_records: int
) -> tuple[list[_Read], int]:
    """The plan's batches from ``at`` on, read at once until they hold ``run_records`` records (at least one
    batch): (the batches, the plan position after them)."""
    end, records = at, 0
    while end < len(plan) and (end == at or records < run_records):
        records += len(plan[end])
        end += 1
    parts = [np.asarray(b, dtype=np.int64) for b in plan[at:end]]
    datas, labels, bad = read(np.concatenate(parts) if len(parts) > 1 else parts[0])
    out, start = [], 0
    for indices in parts:
        n = len(indices)
        own = {pos - start: why for pos, why in bad.items() if start <= pos < start + n} if bad else {}
        out.append(_Read(indices, datas[start : start + n], labels[start : start + n], own))
        start += n
    return out, end


class ReadAheadError(RuntimeError):
    """The source was asked for a batch its read-ahead will never bring (stopped, or ended): the source's
    own failure, not DALI's."""


class _ReadAhead:
    """A helper thread that reads a plan's batches in order (in runs of `READ_AHEAD_RECORDS` records) and
    wraps each batch without a bad record in its TensorList, a bounded number of batches ahead of the
    caller. `take` returns the next one; an exception the helper met is raised by the `take` of the batch
    it was reading. `stop` ends the thread; it holds no reference to the source, so a source that is
    dropped stops it too."""

    def __init__(self, read: Callable, plan: Sequence[np.ndarray], tensor_list: Callable, ahead: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(2, ahead))
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(read, list(plan), tensor_list), name="dali_fast-read-ahead", daemon=True
        )
        self._thread.start()

    def _work(self, read: Callable, plan: list[np.ndarray], tensor_list: Callable) -> None:
        at = 0
        try:
            while at < len(plan) and not self._stopped.is_set():
                batches, at = _read_runs(read, plan, at, READ_AHEAD_RECORDS)
                for b in batches:
                    if not b.bad and b.datas:
                        b.jpegs = tensor_list(b.datas, None, False)
                    if not self._put(b):
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            self._put(e)

    def _put(self, item: object) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def take(self) -> _Read:
        """The next batch, waiting for it; an error of the helper's is raised here. Never waits on a helper
        that was stopped or has ended without a batch: that raises instead."""
        while True:
            if self._stopped.is_set():
                raise ReadAheadError("the source's read-ahead was stopped; start a new pass over the loader")
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise ReadAheadError("the source's read-ahead ended without a batch; start a new pass") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def stop(self) -> None:
        """End the thread (it exits at its next batch) and let go of what it had read. Called on the thread
        itself (a source finalized by a collection that ran there, perhaps inside the queue's own put), it
        only tells the thread to end: it neither waits for itself nor takes the queue's lock."""
        self._stopped.set()
        if threading.current_thread() is self._thread:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()


class BatchSource:
    """A batch-mode external-source callable over a planned list of index batches.

    Returns the batch's encoded images as one ``TensorListCPU`` over the records' memory (with the erasing
    boxes, ``(images, boxes)``, when asked). ``fed`` records, per batch handed to DALI, how many planned
    samples it accounts for (skipped ones included), the records it kept and their labels, in order, so the
    consumer advances its cursor exactly by what it received and yields the labels of the images it got. A
    packed set's batches are read ahead in runs of `READ_AHEAD_RECORDS` records on a helper thread; a bad
    record is named (or skipped) when its batch is handed out.
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
        self._views = bool(getattr(reader, "reads_views", False))  # read ahead on a helper thread
        self.boxes = boxes  # indices -> float32 (n, 4) rows (top, left, h, w) of their erasing boxes, a second output
        self.plan = list(plan)
        self.on_error = on_error
        self.skips = skips
        self.exclude = exclude or {}  # records known to break the decoder: skipped and counted
        self.next = 0
        self.stopped = False
        self.fed: deque[Fed] = deque()  # batches handed to DALI, not yet delivered
        self.tail_skipped: list[tuple[int, str]] = []
        self._ahead: _ReadAhead | None = None
        hold(self, "_ahead")  # a forked child never stops the read-ahead thread, which exists only in the parent
        from nvidia.dali.tensors import TensorListCPU

        self._tensor_list = TensorListCPU

    def stop(self) -> None:
        """Hand out nothing more (the consumer has left the epoch), and stop reading ahead."""
        self.stopped = True
        self._stop_reading()

    def _stop_reading(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stop()

    def rearm(
        self,
        plan: Sequence[np.ndarray],
        exclude: Mapping[int, str] | None = None,
        boxes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """Start handing out a new plan (the next epoch's, in a pipeline kept from the last one)."""
        if (boxes is None) != (self.boxes is None):
            raise ValueError("a kept pipeline's source cannot start or stop giving erasing boxes")
        self._stop_reading()
        self.boxes = boxes
        self.plan = list(plan)
        self.exclude = exclude or {}
        self.next = 0
        self.stopped = False
        self.fed.clear()
        self.tail_skipped = []

    def _take(self) -> _Read:
        """The next plan batch, as read (ahead, for a packed set) but not yet handed out."""
        if self._ahead is None:
            if self._views:
                ahead = max(1, -(-READ_AHEAD_RECORDS // max(1, len(self.plan[self.next]))))
                self._ahead = _ReadAhead(self._read, self.plan[self.next :], self._tensor_list, 2 * ahead)
            else:
                return _read_runs(self._read, self.plan, self.next, 1)[0][0]
        return self._ahead.take()

    def __call__(self) -> Any:
        consumed = batches = 0
        skipped: list[tuple[int, str]] = []
        while not self.stopped and self.next < len(self.plan):
            b = self._take()
            self.next += 1
            batches += 1
            consumed += len(b.indices)
            bad = b.bad
            if self.exclude:  # records known to break the decoder (after a pipeline failure in skip mode)
                bad = {**bad, **{pos: self.exclude[i] for pos, i in enumerate(b.indices.tolist()) if i in self.exclude}}
            datas, labels, kept, jpegs = b.datas, b.labels, b.indices, b.jpegs
            if bad:
                if self.on_error == "raise":
                    first = min(bad)
                    raise BadRecordError(bad_record_message(self.reader, int(kept[first]), bad[first]))
                skipped += [(int(kept[pos]), bad[pos]) for pos in sorted(bad)]
                keep = [pos for pos in range(len(kept)) if pos not in bad]
                datas, labels, kept, jpegs = [datas[pos] for pos in keep], labels[keep], kept[keep], None
            if datas:
                if jpegs is None:
                    # One TensorList of the records (no copy): DALI then skips its own per-sample wrapping and
                    # checks of a list of arrays, which cost the training thread more than reading them.
                    jpegs = self._tensor_list(datas, None, False)
                out = jpegs if self.boxes is None else (jpegs, self.boxes(kept))
                self.fed.append(Fed(consumed, kept.tolist(), batches, skipped, labels, (datas, out)))
                return out
        self.tail_skipped += skipped  # the plan ended on records that were all skipped
        skipped = []
        self._stop_reading()
        raise StopIteration

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

    def __del__(self) -> None:
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:
            ahead.stop()


@dataclass
class Fed:
    """One batch handed to DALI: planned samples and plan batches it accounts for, what it kept and skipped,
    the kept records' labels, and what was handed over: the records' arrays, then the output (DALI reads
    the arrays in place)."""

    consumed: int
    kept: list[int]
    batches: int
    skipped: list[tuple[int, str]]
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
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
    (``decode``: how training decodes, "whole" or "roi", see `transforms.dali.augment`); on a GPU the
    `mixed` decoder is set up for ``max_batch`` images of the source's data set (`MixedDecoder.for_data`)."""
    from nvidia.dali import pipeline_def

    decoder = MixedDecoder.for_data(num_threads, sample_sizes(source.reader), max_batch) if gpu else None

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

        # no_copy: DALI reads the source's arrays where they are (the source keeps them until delivered).
        # The labels do not go through the pipeline: the iterator takes them from the source.
        if source.boxes is None:
            jpegs = fn.external_source(source=source, batch=True, dtype=types.UINT8, no_copy=True)
            erase = None
        else:
            jpegs, erase = fn.external_source(
                source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.FLOAT], no_copy=True
            )
        return augment(
            jpegs,
            train=train,
            recipe=recipe,
            gpu=gpu,
            layout=layout,
            num_threads=num_threads,
            erase=erase,
            decode=decode,
            decoder=decoder,
        )

    p = pipe()
    p.build()
    return p
