"""DALIIterator's feed: a packed set read ahead in runs (the same batches, bad records named at their own
batch), and DALI reading the source's arrays in place, which the source keeps until the batch is delivered."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import IndexReader, jpeg_bytes
from loader_cases import bad_reader

from dali_fast.loaders.bad_records import BadRecordError, SkipLog


class ViewsReader:
    """``reader``, declaring that its reads are views (as a packed set does), so the source reads ahead."""

    reads_views = True

    def __init__(self, reader):
        self.reader = reader
        self.classes = reader.classes
        self.calls: list[int] = []

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        return self.reader[i]

    def source(self, i):
        return self.reader.source(i)

    def read_batch_checked(self, indices):
        from dali_fast.data.base import read_batch_checked

        self.calls.append(len(indices))
        return read_batch_checked(self.reader, indices)


def _drain(source) -> list[tuple]:
    out = []
    with pytest.raises(StopIteration):
        while True:
            out.append(source())
    return out


@pytest.mark.parametrize("run", [1, 4, 512])
def test_a_packed_set_is_read_ahead_in_runs_and_handed_out_batch_by_batch(monkeypatch, run):
    """Reading ahead changes how many records one read takes, not what DALI gets: the same batches, skipped
    records accounted to their own batch, and in raise mode the error at the call of the bad record's batch."""
    import dali_fast.loaders.dali_pipeline as pipeline

    monkeypatch.setattr(pipeline, "READ_AHEAD_RECORDS", run)
    reader = bad_reader(reversed_labels=True)  # records 2, 5 and 7 are bad; record i has label 9 - i
    plan = [np.array([0, 1, 2]), np.array([5, 7]), np.array([9, 8, 3]), np.array([4, 6])]
    plain = pipeline.BatchSource(reader, plan, "skip", SkipLog(), exclude={8: "breaks the decoder"})
    ahead_reader = ViewsReader(reader)
    ahead = pipeline.BatchSource(ahead_reader, plan, "skip", SkipLog(), exclude={8: "breaks the decoder"})
    want, got = _drain(plain), _drain(ahead)
    assert [[bytes(np.asarray(d)) for d in out] for out in got] == [[bytes(np.asarray(d)) for d in out] for out in want]
    fed = [(f.consumed, f.kept, f.batches, f.skipped, f.labels.tolist()) for f in (ahead.consume() for _ in got)]
    assert fed == [
        (f.consumed, f.kept, f.batches, f.skipped, f.labels.tolist()) for f in (plain.consume() for _ in want)
    ]
    assert [f[1] for f in fed] == [[0, 1], [9, 3], [4, 6]] and [f[4] for f in fed] == [[9, 8], [0, 6], [5, 3]]
    assert ahead_reader.calls == {1: [3, 2, 3, 2], 4: [5, 5], 512: [10]}[run]  # records per read
    raising = pipeline.BatchSource(ViewsReader(reader), plan[2:] + plan[:1], "raise", SkipLog())
    raising(), raising()  # read with record 2 already
    assert [f.labels.tolist() for f in raising.fed] == [[0, 1, 6], [5, 3]]
    with pytest.raises(BadRecordError, match=r"^record 2 \(mem://2.jpg\): truncated JPEG"):
        raising()


def test_the_source_keeps_what_it_hands_to_dali_until_the_batch_is_delivered(monkeypatch):
    """DALI reads the source's arrays in place (``no_copy``) and holds no reference to them: the source
    keeps each batch's arrays until `consume`, and the external source is built without a copy."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn as fn

    from dali_fast.loaders.dali_pipeline import BatchSource, build_pipeline
    from dali_fast.transforms.recipe import Recipe

    reader = IndexReader([jpeg_bytes(20, 16)] * 6)
    source = BatchSource(reader, [np.array([0, 1]), np.array([2, 3])], "raise", SkipLog())
    out = source()
    records, handed = source.fed[0].arrays
    assert handed is out
    # one TensorList over the records' own memory: DALI wraps nothing per sample, and nothing is copied
    assert type(out).__name__ == "TensorListCPU" and len(out) == len(records) == 2
    assert [np.asarray(t).ctypes.data for t in out] == [r.ctypes.data for r in records]
    assert source.consume().arrays[0] is records and not source.fed
    seen = []
    real = fn.external_source

    def external_source(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fn, "external_source", external_source)
    p = build_pipeline(
        source, max_batch=2, train=False, recipe=Recipe(image_size=8), gpu=False, device_id=None, seed=1,
        num_threads=1, prefetch=1,
    )  # fmt: skip
    p._shutdown()
    assert [kw["no_copy"] for kw in seen] == [True]


class FreshCopies(IndexReader):
    """Each read returns new, writable copies that nothing else holds, so the feed's copy is the only one."""

    def __init__(self, items):
        super().__init__(items)
        self.handed: list[np.ndarray] = []

    def read_batch_checked(self, indices):
        datas = [np.array(self.items[i]) for i in indices]
        self.handed += datas
        return datas, np.asarray(indices, dtype=np.int64), {}


@pytest.mark.parametrize("views", [False, True], ids=["read-by-the-caller", "read-ahead"])
def test_dali_is_done_with_a_batch_s_arrays_when_it_is_delivered(views):
    """Each batch's encoded bytes are overwritten with zeros the moment the loader hands the batch over (its
    arrays consumed): the images stay those of an untouched run, batch after batch, over prefetching and two
    epochs. DALI had read them (in place) and its outputs owe nothing to them any more; TensorLists made
    on the read-ahead thread too."""
    pytest.importorskip("nvidia.dali")
    import dali_fast.loaders.dali_pipeline as pipeline
    from dali_fast import DALIIterator

    items = [jpeg_bytes(24 + i, 20 + i % 3, (30 * i % 250, 90, 200)) for i in range(10)]

    def epochs(reader, poison: bool) -> list[torch.Tensor]:
        loader = DALIIterator(reader, 3, train=False, image_size=16, device="cpu", num_threads=2, prefetch=2)
        real = pipeline.BatchSource.consume

        def consume(self):
            fed = real(self)
            if poison:
                for a in fed.arrays[0]:
                    a[:] = 0
            return fed

        out = []
        pipeline.BatchSource.consume = consume
        try:
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                out += [x.clone() for x, _ in loader]
        finally:
            pipeline.BatchSource.consume = real
            loader.close()
        return out

    reader = FreshCopies(items)
    reader.reads_views = views
    poisoned = epochs(reader, True)
    assert len(reader.handed) == 20 and all(not a.any() for a in reader.handed)  # every record was zeroed after use
    clean = epochs(IndexReader(items), False)
    assert len(poisoned) == len(clean) == 8 and all(torch.equal(a, b) for a, b in zip(poisoned, clean, strict=True))


def within(seconds: float, call):
    """``call()`` on a thread: its result, or its exception raised here. A call still waiting after
    ``seconds`` fails the test instead of hanging the suite."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _read_ahead_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "dali_fast-read-ahead" and t.is_alive()]


class ThreadNoting(ViewsReader):
    """A views reader that notes the thread of each read, and fails the reads of ``fail`` with an OSError."""

    def __init__(self, reader, fail=()):
        super().__init__(reader)
        self.threads: list[str] = []
        self.fail = set(fail)

    def read_batch_checked(self, indices):
        import threading

        self.threads.append(threading.current_thread().name)
        if self.fail & set(np.asarray(indices).tolist()):
            raise OSError(f"cannot read records {sorted(self.fail)}")
        return super().read_batch_checked(indices)


def test_a_packed_set_is_read_and_wrapped_on_a_helper_thread_not_the_caller_s(monkeypatch):
    """The training thread (DALI's caller) only takes prepared batches: the reads, and the TensorLists of
    batches with no bad record, are made on the helper thread; other readers are read on the caller's."""
    import threading

    import dali_fast.loaders.dali_pipeline as pipeline

    monkeypatch.setattr(pipeline, "READ_AHEAD_RECORDS", 4)
    made: list[str] = []
    real = pipeline.BatchSource.__init__

    def noting_init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        tensor_list = self._tensor_list

        def wrap(*a):
            made.append(threading.current_thread().name)
            return tensor_list(*a)

        self._tensor_list = wrap

    monkeypatch.setattr(pipeline.BatchSource, "__init__", noting_init)
    items = [jpeg_bytes(20, 16)] * 12
    plan = [np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([6, 7, 8]), np.array([9, 10, 11])]
    views = ThreadNoting(IndexReader(items))
    source = pipeline.BatchSource(views, plan, "raise", SkipLog())
    got = _drain(source)
    assert [f.kept for f in (source.consume() for _ in got)] == [p.tolist() for p in plan]
    assert set(views.threads) == set(made) == {"dali_fast-read-ahead"} and len(made) == 4
    assert views.calls == [6, 6]  # runs of at least 4 records
    assert not _read_ahead_threads()  # the plan is done: the helper has ended
    made.clear()
    plain = ThreadNoting(IndexReader(items))
    plain.reads_views = False
    _drain(pipeline.BatchSource(plain, plan, "raise", SkipLog()))
    assert set(plain.threads) == set(made) == {threading.current_thread().name}


def test_an_error_of_the_helper_is_raised_by_the_call_of_its_batch_and_nothing_hangs(monkeypatch):
    """A read that raises on the helper thread is raised, as it was, by the source's call for the first
    batch of that read; the batches read before it come first, and the helper is gone."""
    import dali_fast.loaders.dali_pipeline as pipeline

    monkeypatch.setattr(pipeline, "READ_AHEAD_RECORDS", 2)
    plan = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
    source = pipeline.BatchSource(
        ThreadNoting(IndexReader([jpeg_bytes(20, 16)] * 6), fail=[3]), plan, "skip", SkipLog()
    )
    source()
    with pytest.raises(OSError, match=r"^cannot read records \[3\]$"):
        within(10, source)
    assert [f.kept for f in source.fed] == [[0, 1]]
    source.stop()
    assert not _read_ahead_threads()


def test_stop_rearm_and_a_dropped_source_end_the_helper_and_a_new_plan_gets_no_stale_batch(monkeypatch):
    import gc

    import dali_fast.loaders.dali_pipeline as pipeline

    monkeypatch.setattr(pipeline, "READ_AHEAD_RECORDS", 1)
    reader = ViewsReader(IndexReader([jpeg_bytes(20, 16)] * 40))
    plan = [np.array([i, i + 1]) for i in range(0, 40, 2)]
    source = pipeline.BatchSource(reader, plan, "raise", SkipLog())
    source()
    assert len(_read_ahead_threads()) == 1  # reading ahead of the caller, a bounded number of batches
    source.rearm([np.array([7, 3]), np.array([5])])  # mid-plan, as a kept pipeline's next epoch is
    assert not _read_ahead_threads()
    got = _drain(source)
    assert [f.kept for f in source.fed] == [[7, 3], [5]] and len(got) == 2
    source.rearm(plan)
    source()
    source.stop()
    assert not _read_ahead_threads()
    with pytest.raises(StopIteration):
        source()  # stopped: nothing more, and no helper started again
    assert not _read_ahead_threads()
    source.rearm(plan)
    source()
    assert len(_read_ahead_threads()) == 1
    del source
    gc.collect()
    assert not _read_ahead_threads()  # a source dropped mid-plan stops its helper


def test_only_the_images_and_erasing_boxes_go_through_the_pipeline(monkeypatch):
    """The labels stay with the source (the iterator takes them from it): the external source has one
    output, or two with erasing boxes; the iterator still yields each batch's labels."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn as fn

    from dali_fast import DALIIterator
    from dali_fast.transforms.recipe import Recipe

    real = fn.external_source
    items = [jpeg_bytes(20 + i, 16) for i in range(7)]
    for recipe, outputs in ((Recipe(image_size=8), [None]), (Recipe(image_size=8, random_erasing=0.5), [2])):
        seen: list[dict] = []

        def external_source(*args, seen=seen, **kwargs):
            seen.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(fn, "external_source", external_source)
        reader = ViewsReader(IndexReader(items, reversed_labels=True))  # read ahead on the helper thread
        loader = DALIIterator(reader, 3, recipe=recipe, device="cpu", num_threads=1, seed=2)
        labels = [(y.tolist(), loader.last_indices.tolist()) for _, y in loader]
        loader.close()
        assert [kw.get("num_outputs") for kw in seen] == outputs
        assert sorted(i for _, idx in labels for i in idx) == list(range(7))
        assert all(y == [6 - i for i in idx] for y, idx in labels)  # record i has label 6 - i


def read_aheads_made(monkeypatch) -> list:
    """Read-aheads of one record a run, each listed as it is made (before its thread starts)."""
    import dali_fast.loaders.dali_pipeline as pipeline

    monkeypatch.setattr(pipeline, "READ_AHEAD_RECORDS", 1)
    made: list = []
    real_init = pipeline._ReadAhead.__init__

    def init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(pipeline._ReadAhead, "__init__", init)
    return made


def test_a_source_finalized_on_its_own_helper_thread_ends_it_without_waiting_for_itself(monkeypatch):
    """The cycle collector may finalize a source on any thread, its helper's too: stopping from there must
    not join the running thread (which raises), the helper then ends, and a caller still asking for a
    batch is told so instead of waiting forever."""
    import threading

    import dali_fast.loaders.dali_pipeline as pipeline

    made = read_aheads_made(monkeypatch)
    errors: list[BaseException] = []
    first_taken = threading.Event()

    class StopsOnTheHelper(ViewsReader):
        def read_batch_checked(self, indices):
            if int(indices[0]) == 4 and threading.current_thread().name == "dali_fast-read-ahead":
                first_taken.wait(10)
                try:
                    made[0].stop()  # as BatchSource.__del__ would, run here by a collection
                except BaseException as e:  # noqa: BLE001 - what the test looks for
                    errors.append(e)
            return super().read_batch_checked(indices)

    plan = [np.array([i, i + 1]) for i in range(0, 12, 2)]
    source = pipeline.BatchSource(StopsOnTheHelper(IndexReader([jpeg_bytes(20, 16)] * 12)), plan, "raise", SkipLog())
    source()
    first_taken.set()
    made[0]._thread.join(timeout=10)
    assert errors == [] and not made[0]._thread.is_alive() and not _read_ahead_threads()
    with pytest.raises(pipeline.ReadAheadError, match=r"^the source's read-ahead was stopped; start a new pass"):
        within(10, source)


def test_a_caller_is_never_left_waiting_on_a_helper_that_ended_without_a_batch(monkeypatch):
    import dali_fast.loaders.dali_pipeline as pipeline

    ahead = pipeline._ReadAhead(lambda indices: ([], np.zeros(0, np.int64), {}), [], None, 2)  # nothing to read
    ahead._thread.join(timeout=10)
    with pytest.raises(
        pipeline.ReadAheadError, match=r"^the source's read-ahead ended without a batch; start a new pass$"
    ):
        within(10, ahead.take)
    from dali_fast.loaders.dali_iterator import from_dali

    assert not from_dali(pipeline.ReadAheadError("x"))  # the source's own failure, not DALI's


def test_a_stop_run_on_the_helper_while_it_holds_the_queue_s_lock_does_not_deadlock(monkeypatch):
    """A collection can run a finalizer on the helper thread inside the queue's put, which holds the queue's
    lock: stopping there must not take that lock again (a thread cannot), so the helper still ends."""
    import queue
    import threading

    import dali_fast.loaders.dali_pipeline as pipeline

    made = read_aheads_made(monkeypatch)
    real_put, stopped = queue.Queue._put, []

    def put(self, item):  # runs with the queue's lock held, as a finalizer inside put would
        if threading.current_thread().name == "dali_fast-read-ahead" and not stopped and len(made):
            stopped.append(True)
            made[0].stop()
        real_put(self, item)

    monkeypatch.setattr(queue.Queue, "_put", put)
    plan = [np.array([i, i + 1]) for i in range(0, 12, 2)]
    source = pipeline.BatchSource(ViewsReader(IndexReader([jpeg_bytes(20, 16)] * 12)), plan, "raise", SkipLog())
    try:  # the batch whose put ran the stop, or the stop itself: the two threads race, both are right
        within(10, source)
    except pipeline.ReadAheadError:
        pass
    made[0]._thread.join(timeout=10)
    assert stopped and not made[0]._thread.is_alive()
    with pytest.raises(pipeline.ReadAheadError, match=r"^the source's read-ahead was stopped"):
        within(10, source)  # nothing more comes from a stopped helper, and nothing waits for it
