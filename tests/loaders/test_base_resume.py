"""The epoch driver (`LoaderBase`) on every backend: its state, saved anywhere and loaded, resumes exactly
there; a state that is not one is refused in one line."""

from __future__ import annotations

import pytest
from contract import each_once, run_save_load_state
from fakes import CountingController, ScriptedController
from loader_cases import bad_reader, epoch_labels, fresh_sampler_state, take_then_save

from dali_fast.data.classes import classes_key


def test_save_load_state_contract(make, index_reader):
    """The contract checker: every epoch exactly once, and a state from anywhere resumes exactly there (in
    TorchIterator's case through worker processes, which work ahead of what was delivered)."""
    extra = {"num_workers": 2} if make.backend == "torch" else {"prefetch": 3}
    run_save_load_state(lambda: make(index_reader, 5, seed=9, **extra), midpoint=3)


def test_resume_mid_epoch_yields_exactly_the_rest(make, index_reader):
    loader = make(index_reader, 5, seed=9)
    loader.set_epoch(4)
    seen, state = take_then_save(loader, 3)
    resumed = make(index_reader, 5, seed=9)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the usual loop calls set_epoch; it keeps the resumed position
    rest, _ = epoch_labels(resumed)
    assert len(seen) == 15
    each_once(seen + rest, range(37))
    reference, _ = epoch_labels(make(index_reader, 5, seed=9), 4)
    assert seen + rest == reference  # the same order as an uninterrupted epoch
    # the epoch after the resumed one is complete again
    each_once(epoch_labels(resumed, 5)[0], range(37))


def test_resume_in_skip_mode_neither_replays_nor_loses(make):
    """The position counts planned samples consumed (skipped ones included), not labels delivered."""
    reader = bad_reader()  # records 2, 5 and 7 are bad
    good = [0, 1, 3, 4, 6, 8, 9]
    reference, _ = epoch_labels(make(reader, 3, train=False, on_error="skip"), 0)
    assert reference == good
    loader = make(reader, 3, train=False, on_error="skip")
    loader.set_epoch(0)
    seen, state = take_then_save(loader, 2)  # batches [0 1 2] and [3 4 5]: two bad records already skipped
    assert seen == [0, 1, 3, 4] and state["sampler"]["position"] == 6
    resumed = make(reader, 3, train=False, on_error="skip")
    resumed.load_state_dict(state)
    rest, _ = epoch_labels(resumed)
    assert seen + rest == good  # each good record once, in order: nothing replayed, nothing lost
    assert resumed.skipped == 1  # only record 7 is met again


def test_resume_with_new_batch_size_and_drop_last_keeps_full_batches(make, index_reader):
    loader = make(index_reader, 5, seed=2, drop_last=True)
    loader.set_epoch(1)
    seen, state = take_then_save(loader, 3)
    assert len(seen) == 15
    resumed = make(index_reader, 5, seed=2, drop_last=True)
    resumed.load_state_dict(state)
    resumed.batch_size = 8  # e.g. after an out-of-memory: positions count samples, so this resumes exactly
    rest, sizes = epoch_labels(resumed)
    assert sizes == [8, 8]  # 22 samples left: two full batches, the 6-sample tail dropped (never a 1-sample batch)
    reference, _ = epoch_labels(make(index_reader, 5, seed=2), 1)
    assert seen + rest == reference[:31]


def test_load_state_dict_makes_the_next_iter_continue(make, index_reader):
    loader = make(index_reader, 8, seed=1)
    loader.set_epoch(1)
    seen, _ = epoch_labels(loader, limit=2)
    state = loader.state_dict()
    loader.load_state_dict(state)  # on the same loader
    rest, _ = epoch_labels(loader)
    each_once(seen + rest, range(37))
    again, _ = epoch_labels(loader, 1)  # no load_state_dict since: the whole epoch
    assert sorted(again) == list(range(37))


def test_not_a_state_dict_is_one_line(make, index_reader):
    loader = make(index_reader, 8)
    for bad in ({}, {"sampler": {}}, {"sampler": {"epoch": 1}}, []):
        with pytest.raises(ValueError) as e:
            loader.load_state_dict(bad)
        assert str(e.value).startswith("not a loader state_dict") and "\n" not in str(e.value)


# What a backend adds to its state: how DALI decoded the training images (in its CPU-only mode: the window).
DECODED = {"dali": {"train_decode": "roi"}, "torch": {}}


def test_state_dict_is_exact_and_round_trips_everything(make, index_reader):
    ctrl = ScriptedController([8, 16])
    loader = make(index_reader, 8, seed=4, controller=ctrl)
    loader.set_epoch(2)
    epoch_labels(loader, limit=1)
    state = loader.state_dict()
    assert state == {
        "sampler": fresh_sampler_state(epoch=2, position=8),
        "finished": False,
        "batch_size": 8,
        "backend": make.backend,
        "classes": classes_key(index_reader.classes),
        "controller": {"epochs_ended": 0},
        **DECODED[make.backend],
    }
    other = ScriptedController([8, 16])
    resumed = make(index_reader, 5, seed=4, controller=other)
    resumed.load_state_dict({**state, "controller": {"epochs_ended": 1}})
    assert other.epochs_ended == 1 and resumed.epoch == 2
    assert make(index_reader, 8).state_dict().keys() == {
        "sampler",
        "finished",
        "batch_size",
        "backend",
        "classes",
        *DECODED[make.backend],
    }
    plain = make(index_reader, 5, seed=4)
    plain.load_state_dict(state)  # a controller's state is ignored by a loader without one
    assert plain.batch_size == 8  # the saved batch size is restored
    plain.load_state_dict({"sampler": state["sampler"]})  # minimal: the batch size is kept
    assert plain.batch_size == 8


def test_resume_of_a_finished_epoch_moves_to_the_next(make, index_reader):
    loader = make(index_reader, 8, seed=4)
    epoch_labels(loader, 3)
    state = loader.state_dict()
    assert state["finished"] is True and state["sampler"]["position"] == 37
    resumed = make(index_reader, 8, seed=4)
    resumed.load_state_dict(state)
    labels, _ = epoch_labels(resumed)
    assert resumed.epoch == 4 and labels == epoch_labels(make(index_reader, 8, seed=4), 4)[0]
    not_finished = make(index_reader, 8, seed=4)
    not_finished.load_state_dict({**state, "sampler": {**state["sampler"], "position": 0}, "finished": False})
    assert epoch_labels(not_finished)[0] == epoch_labels(make(index_reader, 8, seed=4), 3)[0]
    without_flag = make(index_reader, 8, seed=4)
    without_flag.load_state_dict({"sampler": {"epoch": 3, "position": 0}})  # "finished" defaults to False
    assert epoch_labels(without_flag)[0] == epoch_labels(make(index_reader, 8, seed=4), 3)[0]


def test_controller_measures_each_epoch_once_also_after_a_resume(make, index_reader):
    ctrl = CountingController([8, 8, 8])
    loader = make(index_reader, 8, controller=ctrl)
    epoch_labels(loader, 0)
    assert (ctrl.begins, ctrl.epochs_ended) == (1, 1)
    loader.set_epoch(1)
    epoch_labels(loader, limit=2)
    state = loader.state_dict()
    assert ctrl.begins == 2
    loader.load_state_dict(state)
    epoch_labels(loader)  # the rest of epoch 1 in the same process: still the same measurement
    assert (ctrl.begins, ctrl.epochs_ended) == (2, 2)
    fresh_ctrl = CountingController([8, 8, 8])
    fresh = make(index_reader, 8, controller=fresh_ctrl)
    fresh.load_state_dict(state)  # a new process resuming mid-epoch measures from there
    epoch_labels(fresh)
    assert (fresh_ctrl.begins, fresh_ctrl.epochs_ended) == (1, 2)  # its state came with the loader's


def test_a_state_saved_on_another_class_map_is_refused(tmp_path):
    """The loader's state keeps a key of the class map: resumed on the same records numbered by another
    map, it is refused in one line (a state saved before maps were kept resumes as it did)."""
    from builders import jpeg_bytes, make_folder

    from dali_fast import TorchIterator, open_dataset

    make_folder(tmp_path / "d", {c: [jpeg_bytes(20 + i, 18) for i in range(3)] for c in ("a", "b")})
    loader = TorchIterator(open_dataset(tmp_path / "d"), 2, image_size=16, num_workers=0)
    next(iter(loader))
    state = loader.state_dict()
    assert state["classes"].startswith("2:")
    other = TorchIterator(open_dataset(tmp_path / "d", classes=["b", "a"]), 2, image_size=16, num_workers=0)
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    assert str(e.value) == (
        "cannot resume: the state was saved with another class map (2 classes, this data set has 2, or other "
        "names); open the data set with the classes it was saved with (classes=, --classes FILE)"
    )
    old = {k: v for k, v in state.items() if k != "classes"}
    other.load_state_dict(old)  # no key: nothing to compare
