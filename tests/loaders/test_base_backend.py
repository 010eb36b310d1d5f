"""What `LoaderBase` asks of a backend, and the rules a backend gets from it: checked on the smallest
backend (`ListBackend`, no decoding)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from contract import each_once, run_save_load_state
from fakes import CountingController, ScriptedController
from loader_cases import fresh_sampler_state

from dali_fast.data.classes import classes_key
from dali_fast.loaders.base import LoaderBase


class ListBackend(LoaderBase):
    """The smallest backend: a batch is its records' labels (no decoding), written to the base's contract."""

    backend = "list"

    def _run(self, plan, start):
        for batch in plan:
            labels = torch.as_tensor([self.dataset[i][1] for i in batch.tolist()], dtype=torch.int64)
            yield torch.zeros(len(batch), 1), labels, len(batch)

    def close(self):
        pass


def test_a_backend_written_to_the_contract_gets_every_rule_from_the_base(index_reader):
    run_save_load_state(lambda: ListBackend(index_reader, 5, seed=9, device="cpu"), midpoint=3)
    ranks = [ListBackend(index_reader, 4, rank=r, world_size=3, device="cpu") for r in range(3)]
    each_once((i for loader in ranks for _ in loader for i in loader.last_indices.tolist()), range(37), padding=2)


def test_a_backend_that_does_not_write_its_part_is_told_which(index_reader):
    class NoRun(LoaderBase):
        def close(self):
            pass

    class Neither(LoaderBase):
        pass

    with pytest.raises(NotImplementedError) as e:
        NoRun(index_reader, 4)
    assert str(e.value) == (
        "NoRun does not write _run: a LoaderBase backend writes _run(plan, start), which yields each planned "
        "batch, and close(), which releases what it holds"
    )
    with pytest.raises(NotImplementedError, match=r"^Neither does not write _run and close: "):
        Neither(index_reader, 4)


def test_the_base_s_own_run_and_close_name_the_backend_that_lacks_them(index_reader):
    loader = ListBackend(index_reader, 4, device="cpu")
    with pytest.raises(NotImplementedError) as e:
        LoaderBase._run(loader, [], 0)
    assert str(e.value) == "ListBackend does not write _run(plan, start)"
    with pytest.raises(NotImplementedError) as e:
        LoaderBase.close(loader)
    assert str(e.value) == "ListBackend does not write close()"


def test_a_backend_that_skips_the_base_s_init_is_asked_about_super(index_reader):
    class NoInit(ListBackend):
        def __init__(self, dataset, batch_size):
            self.dataset = dataset  # super().__init__ forgotten

    loader = NoInit(index_reader, 4)
    said = r"^NoInit was not set up by LoaderBase.__init__: did you call super\(\).__init__\(dataset, batch_size, \*\*kwargs\)\?$"
    for call in (
        lambda: iter(loader),
        lambda: len(loader),
        loader.state_dict,
        lambda: loader.load_state_dict({}),
        lambda: loader.set_epoch(1),
    ):
        with pytest.raises(NotImplementedError, match=said):
            call()


ABANDONED = (
    "this pass over the loader was abandoned when another started (iter(), set_epoch() or load_state_dict()); "
    "iterate one pass at a time"
)


def listed(loader):
    return [x for _, labels in loader for x in labels.tolist()]


def test_the_arguments_are_kept(index_reader):
    loader = ListBackend(index_reader, 4, device="cpu", num_threads=3, drop_last=True, seed=7, train=False)
    assert (loader.num_threads, loader.drop_last, loader.seed, loader.train) == (3, True, 7, False)


def test_a_process_group_started_after_the_loader_is_followed_between_epochs(index_reader, monkeypatch, caplog):
    import dali_fast.loaders.base as base
    import dali_fast.loaders.sampler as sampler

    group = {"rank": 0, "world": 1}
    for module in (base, sampler):  # the loader reads its rank in base; sampler has the function itself
        monkeypatch.setattr(module, "dist_rank_world", lambda r, w: (group["rank"], group["world"]))
    loader = ListBackend(index_reader, 4, device="cpu", seed=3, drop_last=True)
    loader.set_epoch(2)
    group.update(rank=1, world=2)
    with caplog.at_level(logging.INFO, logger="dali_fast.loaders.base"):
        assert len(loader) == 18 // 4
    assert [r.getMessage() for r in caplog.records] == [
        "loader: now rank 1 of 2 (the process group started after the loader was made)"
    ]
    assert (loader.rank, loader.world_size, loader.epoch, len(loader.order)) == (1, 2, 2, 18)
    same = ListBackend(index_reader, 4, device="cpu", seed=3, drop_last=True)  # made in the group (rank 1 of 2)
    same.set_epoch(2)
    assert listed(loader) == listed(same)
    assert len(listed(loader)) == 16  # drop_last: whole batches of this rank's 18


def test_rank_and_world_size_without_a_process_group_shard_and_say_so_once(index_reader, monkeypatch, caplog):
    """torchrun's RANK/WORLD_SIZE with no process group at the first pass: the loader shards by them (a
    script may start the group later), and says once, in one line, that nothing synchronises the ranks."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = ListBackend(index_reader, 4, device="cpu")
    with caplog.at_level(logging.WARNING, logger="dali_fast.loaders.base"):
        first, second = listed(loader), listed(loader)
    assert len(first) == len(second) == 19  # rank 1's half of 37, padded
    assert [r.getMessage() for r in caplog.records] == [
        "loader: RANK/WORLD_SIZE say rank 1 of 2, but no torch.distributed process group is initialised: "
        "sharding by them, so this process reads 1/2 of the data and nothing synchronises the processes; start "
        "the process group before the first pass, or pass rank=0, world_size=1 to read all of it"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dali_fast.loaders.base"):
        assert len(listed(ListBackend(index_reader, 4, device="cpu", rank=0, world_size=1))) == 37
    assert caplog.records == []  # explicit rank and world size: nothing to say


def test_a_loader_made_before_the_group_follows_it_when_iterated_first(index_reader, monkeypatch):
    """Iterated without a len() first (a plain loop), a loader made before the process group still follows it."""
    import dali_fast.loaders.base as base
    import dali_fast.loaders.sampler as sampler

    group = {"rank": 1, "world": 2}
    for module in (base, sampler):  # the loader reads its rank in base; sampler has the function itself
        monkeypatch.setattr(module, "dist_rank_world", lambda r, w: (group["rank"], group["world"]))
    loader = ListBackend(index_reader, 4, device="cpu")
    group.update(rank=0, world=1)
    assert len(listed(loader)) == 37 and (loader.rank, loader.world_size) == (0, 1)


def test_a_process_group_that_changes_the_rank_mid_epoch_is_refused_in_one_line(index_reader, monkeypatch):
    import dali_fast.loaders.base as base
    import dali_fast.loaders.sampler as sampler

    group = {"rank": 0, "world": 1}
    for module in (base, sampler):  # the loader reads its rank in base; sampler has the function itself
        monkeypatch.setattr(module, "dist_rank_world", lambda r, w: (group["rank"], group["world"]))
    said = (
        "the process group says rank 1 of 2, but this loader is mid-epoch as rank 0 of 1; "
        "make the loader after the process group starts"
    )
    loader = ListBackend(index_reader, 37, device="cpu")
    it = iter(loader)
    next(it)  # the whole epoch yielded, the pass not yet ended
    assert loader.order.position == len(loader.order)
    group.update(rank=1, world=2)
    with pytest.raises(RuntimeError) as e:
        len(loader)
    assert str(e.value) == said
    it.close()
    group.update(rank=0, world=1)
    resumed = ListBackend(index_reader, 4, device="cpu")
    resumed.load_state_dict({"sampler": {"epoch": 1, "position": 8}})  # mid-epoch, no pass running
    group.update(rank=1, world=2)
    with pytest.raises(RuntimeError) as e:
        iter(resumed).__next__()
    assert str(e.value) == said


def test_a_pass_abandoned_before_its_first_batch_says_so(index_reader):
    loader = ListBackend(index_reader, 4, device="cpu")
    first = iter(loader)
    second = iter(loader)
    with pytest.raises(RuntimeError) as e:
        next(first)
    assert str(e.value) == ABANDONED
    assert len(listed(second)) == 37


def test_what_abandons_a_pass_is_named_in_the_debug_log(index_reader, caplog):
    loader = ListBackend(index_reader, 4, device="cpu")
    with caplog.at_level(logging.DEBUG, logger="dali_fast.loaders.base"):
        for start_over in (
            lambda: iter(loader),
            lambda: loader.set_epoch(1),
            lambda: loader.load_state_dict(loader.state_dict()),
        ):
            it = iter(loader)
            next(it)
            start_over()
            it.close()
    assert [r.getMessage() for r in caplog.records] == [
        "iter() abandons the pass in progress",
        "set_epoch() abandons the pass in progress",
        "load_state_dict() abandons the pass in progress",
    ]


def test_close_before_any_pass_is_harmless_and_a_new_loader_s_state_is_exact(index_reader):
    loader = ListBackend(index_reader, 8, device="cpu", seed=4)
    expected = {"sampler": fresh_sampler_state(), "finished": False, "batch_size": 8, "backend": "list"}
    expected["classes"] = classes_key(index_reader.classes)
    assert loader.state_dict() == expected and loader.state_dict()["finished"] is False
    loader.close()  # no pass yet: nothing to end
    assert loader.state_dict() == expected
    assert sorted(listed(loader)) == list(range(37))


def test_looping_again_without_set_epoch_saves_the_next_epoch_as_not_finished(index_reader):
    loader = ListBackend(index_reader, 8, device="cpu", seed=4)
    listed(loader)
    assert loader.state_dict()["finished"] is True
    it = iter(loader)
    next(it)  # the next epoch's first batch
    state = loader.state_dict()
    assert state == {
        "sampler": fresh_sampler_state(epoch=1, position=8),
        "finished": False,
        "batch_size": 8,
        "backend": "list",
        "classes": classes_key(index_reader.classes),
    }
    assert state["finished"] is False
    it.close()


def test_close_mid_pass_closes_the_backend_s_run_before_its_close_runs(index_reader):
    """The run of the pass in progress is closed first (its finally blocks release what it holds), then the
    backend's close() runs: a backend never releases what its own run still uses."""

    class Releasing(LoaderBase):
        backend = "releasing"

        def __init__(self, *args, **kw):
            self.events = []
            super().__init__(*args, **kw)

        def _run(self, plan, start):
            try:
                for batch in plan:
                    yield torch.zeros(len(batch), 1), torch.as_tensor(batch, dtype=torch.int64), len(batch)
            finally:
                self.events.append("run released")

        def close(self):
            self.events.append("backend close")

    loader = Releasing(index_reader, 8, device="cpu")
    it = iter(loader)
    next(it)
    loader.close()
    assert loader.events == ["run released", "backend close"]
    with pytest.raises(RuntimeError, match=r"^this pass over the loader ended when the loader was closed"):
        next(it)


def test_a_backend_whose_run_returns_a_plain_iterator_works(index_reader):
    """_run may return any iterator of (images, labels, consumed), not only a generator."""

    class Eager(LoaderBase):
        backend = "eager"

        def _run(self, plan, start):
            return iter([(torch.zeros(len(b), 1), torch.as_tensor(b, dtype=torch.int64), len(b)) for b in plan])

        def close(self):
            pass

    loader = Eager(index_reader, 8, device="cpu", seed=4)
    first = listed(loader)
    assert sorted(first) == list(range(37)) and loader.state_dict()["finished"] is True
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match=r"^this pass over the loader ended when the loader was closed"):
        next(it)
    assert sorted(listed(loader)) == list(range(37))


def test_the_batch_size_can_change_once_the_running_pass_is_abandoned(index_reader):
    loader = ListBackend(index_reader, 4, device="cpu")
    it = iter(loader)
    next(it)
    loader.set_epoch(1)  # the running pass is abandoned: no pass is running now
    loader.batch_size = 5
    assert [len(labels) for _, labels in loader] == [5] * 7 + [2]


def test_the_epoch_keeps_its_batch_size_when_the_controller_changes_mid_epoch(index_reader):
    ctrl = ScriptedController([8, 8])
    loader = ListBackend(index_reader, 8, device="cpu", controller=ctrl)
    sizes = []
    for _, labels in loader:
        ctrl.batch_size = 3  # e.g. a controller reacting to memory inside the epoch
        sizes.append(len(labels))
        assert (loader.batch_size, len(loader)) == (8, 5)
    assert sizes == [8, 8, 8, 8, 5]
    assert loader.batch_size == 8  # the controller picked 8 again at the epoch's end


def test_a_backend_frees_what_the_coming_pass_will_not_use_at_its_batch_size(index_reader):
    class Releasing(ListBackend):
        released = []

        def _release_stale(self, batch_size):
            self.released.append(batch_size)

    loader = Releasing(index_reader, 6, device="cpu")
    listed(loader)
    loader.batch_size = 9
    listed(loader)
    assert Releasing.released == [6, 9]


def test_an_epoch_started_again_after_a_break_is_measured_again(index_reader):
    ctrl = CountingController([8, 8])
    loader = ListBackend(index_reader, 8, device="cpu", controller=ctrl)
    it = iter(loader)
    next(it)
    next(it)
    it.close()
    assert ctrl.begins == 1
    listed(loader)  # the epoch from its start again
    assert (ctrl.begins, ctrl.epochs_ended) == (2, 1)


class StreamedIndexReader:
    """An `IndexReader` streamed in four shards, recording what the loader schedules and delivers."""

    streaming = True
    shuffle_window = 2

    def __init__(self, reader):
        self.reader = reader
        self.shard_bounds = np.array([0, 10, 20, 30, 37])
        self.scheduled, self.advanced = [], []

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        return self.reader[i]

    def source(self, i):
        return self.reader.source(i)

    def schedule(self, order, then=None):
        self.scheduled.append((order.tolist(), then.tolist(), order.dtype))

    def advance(self, count):
        self.advanced.append(count)


def test_a_streaming_reader_is_told_each_pass_and_the_next_epoch(index_reader):
    data = StreamedIndexReader(index_reader)
    loader = ListBackend(data, 8, device="cpu", seed=4)
    loader.set_epoch(1)
    first = listed(loader)
    assert data.scheduled == [(first, loader.order.indices(2).tolist(), np.int64)]
    assert data.advanced == [8, 8, 8, 8, 5]
    state = loader.state_dict()
    assert (state["sampler"]["order"], state["finished"]) == ("stream", True)
    data.scheduled.clear()
    at_end = ListBackend(data, 8, device="cpu", seed=4)
    at_end.load_state_dict({**state, "finished": False})  # the whole epoch delivered, its end not recorded
    assert listed(at_end) == []
    assert data.scheduled == [([], loader.order.indices(2).tolist(), np.int64)]


def test_a_state_of_the_other_order_is_refused_in_one_line(index_reader):
    streamed = ListBackend(StreamedIndexReader(index_reader), 8, device="cpu")
    random_access = ListBackend(index_reader, 8, device="cpu")
    with pytest.raises(ValueError) as e:
        random_access.load_state_dict(streamed.state_dict())
    assert str(e.value) == (
        "cannot resume: the state was saved with the stream order, this data set uses the random order; "
        "resume with the data set it was saved with"
    )
    with pytest.raises(ValueError) as e:
        streamed.load_state_dict(random_access.state_dict())
    assert str(e.value).startswith(
        "cannot resume: the state was saved with the random order, this data set uses the stream"
    )
