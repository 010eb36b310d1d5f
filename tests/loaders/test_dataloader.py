"""`make_dataloader`: a plain DataLoader with sensible defaults and one-line errors."""

from __future__ import annotations

import pytest
import torch

from dali_fast.loaders.dataloader import default_num_workers, make_dataloader


def test_make_dataloader_defaults_and_errors(monkeypatch):
    ds = list(range(10))
    dl = make_dataloader(ds, 4, num_workers=2)
    assert dl.num_workers == 2 and dl.persistent_workers and dl.prefetch_factor == 2
    assert dl.pin_memory == torch.cuda.is_available()
    dl0 = make_dataloader(ds, 4, num_workers=0)
    assert dl0.num_workers == 0 and not dl0.persistent_workers
    assert [b.tolist() for b in dl0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_num_workers() == 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert default_num_workers() == 2  # a worker per cpu: the main process's share is small
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert default_num_workers() == 0
    for kw, match in [
        ({"num_workers": -1}, "num_workers=-1"),
        ({"num_workers": 0, "prefetch_factor": 4}, "prefetch_factor=4 needs worker"),
        ({"num_workers": 0, "persistent_workers": True}, "persistent_workers=True needs"),
        ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor=0"),
        ({"num_workers": 0, "sampler": [1, 2], "shuffle": True}, "exclude each other"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_dataloader(ds, 4, **kw)


def test_create_optimized_dataloader_is_make_dataloader_by_its_first_class_name():
    import warnings

    from dali_fast import create_optimized_dataloader

    with pytest.raises(ValueError, match="num_workers=-1: must be >= 0"):  # the same checks, the same words
        create_optimized_dataloader(list(range(5)), 2, num_workers=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a first-class name: no DeprecationWarning, no other warning
        dl = create_optimized_dataloader(list(range(5)), 2, num_workers=0)
    assert [b.tolist() for b in dl] == [[0, 1], [2, 3], [4]]
