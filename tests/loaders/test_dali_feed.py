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
    reader = bad_reader()  # records 2, 5 and 7 are bad
    plan = [np.array([0, 1, 2]), np.array([5, 7]), np.array([9, 8, 3]), np.array([4, 6])]
    plain = pipeline.BatchSource(reader, plan, "skip", SkipLog(), exclude={8: "breaks the decoder"})
    ahead_reader = ViewsReader(reader)
    ahead = pipeline.BatchSource(ahead_reader, plan, "skip", SkipLog(), exclude={8: "breaks the decoder"})
    want, got = _drain(plain), _drain(ahead)
    assert [out[1].tolist() for out in got] == [out[1].tolist() for out in want] == [[0, 1], [9, 3], [4, 6]]
    assert [[bytes(d) for d in out[0]] for out in got] == [[bytes(d) for d in out[0]] for out in want]
    fed = [(f.consumed, f.kept, f.batches, f.skipped) for f in (ahead.consume() for _ in got)]
    assert fed == [(f.consumed, f.kept, f.batches, f.skipped) for f in (plain.consume() for _ in want)]
    assert ahead_reader.calls == {1: [3, 2, 3, 2], 4: [5, 5], 512: [10]}[run]  # records per read
    raising = pipeline.BatchSource(ViewsReader(reader), plan[2:] + plan[:1], "raise", SkipLog())
    assert raising()[1].tolist() == [9, 8, 3] and raising()[1].tolist() == [4, 6]  # read with record 2 already
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
    records, *handed = source.fed[0].arrays
    assert len(handed) == len(out) and all(a is b for a, b in zip(handed, out, strict=True))
    # one TensorList over the records' own memory: DALI wraps nothing per sample, and nothing is copied
    assert type(out[0]).__name__ == "TensorListCPU" and len(out[0]) == len(records) == 2
    assert [np.asarray(t).ctypes.data for t in out[0]] == [r.ctypes.data for r in records]
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


def test_dali_is_done_with_a_batch_s_arrays_when_it_is_delivered():
    """Each batch's encoded bytes are overwritten with zeros the moment the loader hands the batch over (its
    arrays consumed): the images stay those of an untouched run, batch after batch, over prefetching and two
    epochs. DALI had read them (in place) and its outputs owe nothing to them any more."""
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
    poisoned = epochs(reader, True)
    assert len(reader.handed) == 20 and all(not a.any() for a in reader.handed)  # every record was zeroed after use
    clean = epochs(IndexReader(items), False)
    assert len(poisoned) == len(clean) == 8 and all(torch.equal(a, b) for a, b in zip(poisoned, clean, strict=True))
