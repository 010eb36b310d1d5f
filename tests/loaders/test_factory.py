"""`make_loader`, the one factory: the backend chosen (and said once), each backend's arguments."""

from __future__ import annotations

import builtins
import logging

import pytest

from dali_fast.loaders.factory import make_loader
from dali_fast.loaders.torch_iterator import TorchIterator


def test_make_loader_falls_back_without_dali(monkeypatch, caplog, index_reader):
    real_import = builtins.__import__

    def no_dali(name, *args, **kwargs):
        if name.startswith("nvidia.dali") or name == "nvidia":
            raise ImportError("No module named 'nvidia.dali'")
        return real_import(name, *args, **kwargs)

    import dali_fast.loaders.factory as factory

    monkeypatch.setattr(factory, "_said", set())
    monkeypatch.setattr(builtins, "__import__", no_dali)
    with caplog.at_level(logging.INFO):
        loader = make_loader(index_reader, 4, backend="auto", image_size=16, num_workers=0, device="cpu")
        make_loader(index_reader, 4, backend="auto", image_size=16, num_workers=0, device="cpu", train=False)
    assert isinstance(loader, TorchIterator)
    said = [r.getMessage() for r in caplog.records if "falling back to TorchIterator" in r.getMessage()]
    assert len(said) == 1 and "nvidia.dali" in said[0]  # a training and an evaluation loader: said once
    with pytest.raises(ImportError, match="backend='dali'"):
        make_loader(index_reader, 4, backend="dali")


def test_make_loader_picks_dali_when_it_works(index_reader):
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator

    assert isinstance(make_loader(index_reader, 4, image_size=16, device="cpu", num_workers=3), DALIIterator)
    with pytest.raises(ValueError, match="backend"):
        make_loader(index_reader, 4, backend="jax")


def test_make_loader_makes_the_plain_dataloader_too(index_reader):
    """``backend="baseline"``: the plain DataLoader, with what it takes; what it cannot honour is refused."""
    from torch.utils.data import DataLoader

    loader = make_loader(
        index_reader, 8, backend="baseline", image_size=16, num_workers=0, train=False, drop_last=True, controller=None
    )
    assert isinstance(loader, DataLoader) and loader.batch_size == 8 and loader.drop_last
    labels = [y for _, ys in loader for y in ys.tolist()]
    assert labels == list(range(32))  # eval keeps the data set's order; the last 5 dropped
    with pytest.raises(ValueError) as e:
        make_loader(index_reader, 8, backend="baseline", cache_bytes=1024, device="cuda")
    assert str(e.value) == (
        "backend='baseline' (a plain DataLoader) has no cache_bytes=1024, device='cuda'; drop it or use backend='torch'"
    )
    with pytest.raises(ValueError, match=r"^on_error='ignore': use 'raise' or 'skip'$"):
        make_loader(index_reader, 8, backend="baseline", on_error="ignore")
    with pytest.raises(ValueError, match=r"^backend='jax': use 'auto', 'dali', 'torch' or 'baseline'$"):
        make_loader(index_reader, 8, backend="jax")


@pytest.mark.parametrize("workers", [0, 2])
def test_baseline_follows_a_resolution_schedule(index_reader, workers):
    """The plain DataLoader with a ramp: ``loader.sampler.set_epoch(e)`` (what a DDP script calls) sets the
    epoch's size, in worker processes that persist across epochs too; each sample once per epoch."""
    from collections import Counter

    from dali_fast import Progressive, Recipe

    ramp = Progressive(16, 32, start_epoch=0, end_epoch=2, step=8)
    recipe = Recipe(image_size=40, resolution=ramp)
    loader = make_loader(index_reader, 8, backend="baseline", recipe=recipe, num_workers=workers)
    for epoch in range(4):
        loader.sampler.set_epoch(epoch)
        sides, labels = set(), Counter()
        for images, y in loader:
            sides.add(images.shape[-1])
            labels.update(y.tolist())
        assert sides == {ramp(epoch)} and labels == Counter(range(37))
    val = make_loader(index_reader, 8, backend="baseline", recipe=recipe, num_workers=0, train=False)
    assert {x.shape[-1] for x, _ in val} == {40}
