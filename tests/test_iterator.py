"""The loader contract, run against every backend (DALI in CPU-only mode here; GPU tests marked `gpu`)."""

from __future__ import annotations

import gc
import io
import logging
from collections import Counter

import numpy as np
import odd_images
import pytest
import torch
from conftest import IndexReader, jpeg_bytes, png_bytes
from PIL import Image

from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD, Recipe

BACKENDS = ["dali", "torch"]


def loader_class(backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast import DALIIterator

        return DALIIterator
    from dali_fast import TorchIterator

    return TorchIterator


@pytest.fixture(params=BACKENDS)
def make(request):
    cls = loader_class(request.param)

    def factory(reader, batch_size, **kw):
        kw.setdefault("image_size", 16)
        kw.setdefault("device", "cpu")
        kw.setdefault("num_threads", 2)
        if cls.__name__ == "TorchIterator":
            kw.setdefault("num_workers", 0)
        return cls(reader, batch_size, **kw)

    factory.backend = request.param
    return factory


def epoch_labels(loader, epoch=None, limit=None):
    if epoch is not None:
        loader.set_epoch(epoch)
    out, sizes = [], []
    for k, (images, labels) in enumerate(loader):
        assert images.shape[0] == labels.shape[0]
        out += labels.tolist()
        sizes.append(len(labels))
        if limit is not None and k + 1 >= limit:
            break
    return out, sizes


def take_then_save(loader, batches):
    """Labels of the first ``batches`` batches of the current epoch, then the loader's state."""
    seen = []
    for k, (_, labels) in enumerate(loader):
        seen += labels.tolist()
        if k + 1 == batches:
            return seen, loader.state_dict()
    raise AssertionError(f"the epoch had fewer than {batches} batches")


class ScriptedController:
    """A test double for BatchSizeController: plays a fixed list of batch sizes, one per epoch."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.max_batch = max(sizes)
        self.epochs_ended = 0
        self.batch_size = self.sizes[0]

    def attach(self, batch_size):
        pass

    def begin_epoch(self):
        pass

    def end_epoch(self, epoch):
        self.epochs_ended += 1
        self.batch_size = self.sizes[min(self.epochs_ended, len(self.sizes) - 1)]

    def state_dict(self):
        return {"epochs_ended": self.epochs_ended}

    def load_state_dict(self, sd):
        self.epochs_ended = sd["epochs_ended"]


def test_exactly_once_per_epoch_shuffled(make, index_reader):
    loader = make(index_reader, 8, seed=3)
    orders = []
    for epoch in range(3):
        labels, sizes = epoch_labels(loader, epoch)
        assert sorted(labels) == list(range(37))
        assert sizes == [8, 8, 8, 8, 5] and len(loader) == 5
        orders.append(labels)
    assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_exactly_once_any_prefetch_depth(make, index_reader, prefetch):
    # TorchIterator: worker processes, where prefetch_factor decides how far ahead batches are made
    extra = {"num_workers": 2} if make.backend == "torch" else {}
    loader = make(index_reader, 6, prefetch=prefetch, **extra)
    for epoch in range(2):
        labels, sizes = epoch_labels(loader, epoch)
        assert sorted(labels) == list(range(37)) and sizes == [6] * 6 + [1]
    labels, _ = epoch_labels(loader, 2, limit=2)  # leave with batches in flight
    assert len(labels) == 12
    assert sorted(epoch_labels(loader, 3)[0]) == list(range(37))


def test_batch_size_changes_between_epochs(make, index_reader):
    ctrl = ScriptedController([8, 16, 5, 32, 3, 11])
    loader = make(index_reader, 8, controller=ctrl)
    for epoch, bs in enumerate(ctrl.sizes):
        assert loader.batch_size == bs
        expected_len = len(loader)
        labels, sizes = epoch_labels(loader, epoch)
        assert sorted(labels) == list(range(37)), f"epoch {epoch} bs {bs}"
        assert max(sizes) == bs and len(sizes) == expected_len


def test_batch_size_setter_between_epochs_only(make, index_reader):
    loader = make(index_reader, 8)
    loader.batch_size = 10
    labels, sizes = epoch_labels(loader, 0)
    assert sorted(labels) == list(range(37)) and sizes == [10, 10, 10, 7]
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="between epochs"):
        loader.batch_size = 4
    it.close()


def test_break_then_next_epoch_exactly_once(make, index_reader):
    loader = make(index_reader, 4, prefetch=3)
    first, _ = epoch_labels(loader, 0, limit=2)
    assert len(first) == 8
    for epoch in (1, 2):
        labels, _ = epoch_labels(loader, epoch)
        assert sorted(labels) == list(range(37))


def test_drop_last_drops_only_the_tail(make, index_reader):
    loader = make(index_reader, 8, drop_last=True)
    assert len(loader) == 4
    labels, sizes = epoch_labels(loader, 0)
    assert sizes == [8, 8, 8, 8] and len(set(labels)) == 32
    full = make(index_reader, 8)
    full_labels, _ = epoch_labels(full, 0)
    assert labels == full_labels[:32]  # the same order, only the tail is missing


def test_resume_mid_epoch_yields_exactly_the_rest(make, index_reader):
    loader = make(index_reader, 5, seed=9)
    loader.set_epoch(4)
    seen, state = take_then_save(loader, 3)
    resumed = make(index_reader, 5, seed=9)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the usual loop calls set_epoch; it keeps the resumed position
    rest, _ = epoch_labels(resumed)
    assert len(seen) == 15 and sorted(seen + rest) == list(range(37))
    reference, _ = epoch_labels(make(index_reader, 5, seed=9), 4)
    assert seen + rest == reference  # the same order as an uninterrupted epoch
    # the epoch after the resumed one is complete again
    assert sorted(epoch_labels(resumed, 5)[0]) == list(range(37))


def test_looping_again_without_set_epoch_moves_to_next_epoch(make, index_reader):
    loader = make(index_reader, 8)
    a, _ = epoch_labels(loader)
    b, _ = epoch_labels(loader)
    assert sorted(a) == sorted(b) == list(range(37)) and a != b and loader.epoch == 1


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_disjoint_cover_equal_batches(make, index_reader, world):
    per_rank = []
    for rank in range(world):
        loader = make(index_reader, 4, rank=rank, world_size=world, drop_last=False)
        labels, sizes = epoch_labels(loader, 1)
        per_rank.append((labels, len(sizes)))
    assert len({n for _, n in per_rank}) == 1  # same number of batches on every rank
    everything = Counter(x for labels, _ in per_rank for x in labels)
    assert set(everything) == set(range(37))
    assert sum(everything.values()) - 37 < world  # only the wrap-around padding repeats


def test_same_seed_epoch_same_batches(make, index_reader):
    a, b = make(index_reader, 8, seed=5), make(index_reader, 8, seed=5)
    a.set_epoch(2)
    b.set_epoch(2)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb)
        assert torch.equal(xa, xb)


def normalized(rgb):
    return [(c - m) / s for c, m, s in zip(rgb, IMAGENET_MEAN, IMAGENET_STD, strict=True)]


def flat_png(rgb, w=48, h=40):
    out = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), rgb, np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shape_dtype_and_normalization(make, train, dtype):
    rgb = (200, 30, 60)
    reader = IndexReader([flat_png(rgb)] * 3)
    loader = make(reader, 3, train=train, dtype=dtype, image_size=24)
    images, labels = next(iter(loader))
    assert images.shape == (3, 3, 24, 24) and images.dtype == dtype
    assert labels.dtype == torch.int64 and labels.shape == (3,)
    got = images.float().mean(dim=(0, 2, 3)).tolist()
    std = images.float().std(dim=(0, 2, 3)).tolist()
    assert np.allclose(got, normalized(rgb), atol=1e-2)
    assert max(std) < 1e-2


def gradient_jpeg():
    arr = np.tile(np.linspace(0, 255, 64, dtype=np.float32)[None, :, None], (48, 1, 3)).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "JPEG", quality=95)
    return out.getvalue()


def flipped_fraction(loader, epochs):
    flips = total = 0
    for e in range(epochs):
        loader.set_epoch(e)
        for images, _ in loader:
            left = images[:, :, :, :4].float().mean(dim=(1, 2, 3))
            right = images[:, :, :, -4:].float().mean(dim=(1, 2, 3))
            flips += int((left > right).sum())
            total += len(images)
    return flips / total


def test_train_flips_about_half_eval_never(make):
    reader = IndexReader([gradient_jpeg()] * 50)
    assert 0.3 < flipped_fraction(make(reader, 10, train=True), epochs=4) < 0.7
    assert flipped_fraction(make(reader, 10, train=False), epochs=1) == 0.0


def test_eval_is_deterministic(make, index_reader):
    loader = make(index_reader, 8, train=False)
    first = [x.clone() for x, _ in loader]
    second = [x.clone() for x, _ in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    labels, _ = epoch_labels(loader, 7)
    assert labels == list(range(37))  # eval keeps the data set's order


def special_images():
    gray = io.BytesIO()
    Image.fromarray(np.full((30, 40), 128, np.uint8), mode="L").save(gray, "JPEG", quality=95)
    cmyk = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(cmyk, "JPEG", quality=95)  # red in CMYK
    progressive = jpeg_bytes(48, 40, (10, 200, 10), progressive=True)
    return [gray.getvalue(), cmyk.getvalue(), png_bytes(40, 30, "RGBA"), progressive]


def test_grayscale_cmyk_png_alpha_progressive_decode_to_rgb(make):
    reader = IndexReader(special_images())
    loader = make(reader, 4, train=False, image_size=16)
    images, labels = next(iter(loader))
    assert images.shape == (4, 3, 16, 16)
    means = images.float().mean(dim=(2, 3)).numpy()
    rgb = means * np.array(IMAGENET_STD)[None] / 1 + np.array(IMAGENET_MEAN)[None]
    by_label = dict(zip(labels.tolist(), rgb, strict=True))
    assert np.allclose(by_label[0], 128, atol=3)  # gray: three equal channels
    assert by_label[1][0] > 200 and by_label[1][1] < 60  # CMYK red came out red
    assert np.allclose(by_label[2], 120, atol=3)  # PNG with alpha: RGB of the pixels
    assert by_label[3][1] > 150 and by_label[3][0] < 60  # progressive green


def bad_reader():
    good = [jpeg_bytes(32, 24, (i * 20, 100, 50)) for i in range(10)]
    items = list(good)
    items[2] = good[2][: len(good[2]) // 2]  # truncated JPEG
    items[5] = bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8))  # random bytes
    items[7] = b""  # empty record
    return IndexReader(items)


def test_bad_record_raise_names_it(make):
    loader = make(bad_reader(), 4, train=False)
    with pytest.raises(ValueError) as e:
        epoch_labels(loader, 0)
    msg = str(e.value)
    assert "record 2 (mem://2.jpg)" in msg and "truncated JPEG" in msg and "on_error='skip'" in msg


def test_bad_records_skip_counts_and_logs_once(make, caplog):
    loader = make(bad_reader(), 4, train=True, on_error="skip")
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            labels, _ = epoch_labels(loader, epoch)
            assert sorted(labels) == [0, 1, 3, 4, 6, 8, 9]
    assert loader.skipped == 6  # 3 per epoch
    for i in (2, 5, 7):
        assert sum(f"record {i} " in r.getMessage() for r in caplog.records) == 1


def test_all_bad_batch_is_skipped_whole(make):
    reader = bad_reader()
    loader = make(reader, 1, train=False, on_error="skip")
    labels, sizes = epoch_labels(loader, 0)
    assert labels == [0, 1, 3, 4, 6, 8, 9] and set(sizes) == {1}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"device": "tpu"}, "device"),
        ({"on_error": "ignore"}, "on_error"),
        ({"dtype": torch.int8}, "dtype"),
        ({"cache_bytes": -1}, "cache_bytes"),
        ({"rank": 3, "world_size": 2}, "rank=3"),
    ],
)
def test_bad_arguments_one_line(make, index_reader, kw, match):
    kw = {"batch_size": 4, **kw}
    bs = kw.pop("batch_size")
    with pytest.raises(ValueError, match=match) as e:
        make(index_reader, bs, **kw)
    assert "\n" not in str(e.value)


def test_cache_serves_second_epoch(make, index_reader):
    loader = make(index_reader, 8, cache_bytes=10**7)
    epoch_labels(loader, 0)
    epoch_labels(loader, 1)
    s = loader.cache_stats()
    assert s["misses"] == 37 and s["hits"] == 37 and s["hit_rate"] == 0.5


@pytest.mark.gpu
def test_gpu_mode_outputs_on_cuda_exactly_once(make, index_reader):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    loader = make(index_reader, 8, device="cuda")
    for epoch in range(2):
        loader.set_epoch(epoch)
        labels = []
        for images, lab in loader:
            assert images.is_cuda and images.shape[1:] == (3, 16, 16)
            labels += lab.tolist()
        assert sorted(labels) == list(range(37))
    rgb = (200, 30, 60)
    flat = make(IndexReader([flat_png(rgb)] * 4), 4, device="cuda", train=False)
    images, _ = next(iter(flat))
    assert np.allclose(images.float().mean(dim=(0, 2, 3)).cpu().numpy(), normalized(rgb), atol=1e-2)


def test_record_that_passes_the_check_but_fails_to_decode_is_named(make):
    good = odd_images.good_jpeg()
    sneaky = odd_images.corrupt()["bogus_huffman_table_jpeg"]
    reader = IndexReader([good, sneaky, good, good, good])
    loader = make(reader, 2, train=False)
    with pytest.raises((RuntimeError, ValueError)) as e:
        epoch_labels(loader, 0)
    msg = str(e.value)
    assert "record 1 (mem://1.jpg)" in msg and "\n" not in msg
    assert "mem://0.jpg" not in msg  # the good record decoded with it is not a suspect
    assert "on_error='skip'" in msg
    skipping = make(reader, 2, train=False, on_error="skip")  # the same records in skip mode go through
    assert epoch_labels(skipping, 0)[0] == [0, 2, 3, 4] and skipping.skipped == 1


@pytest.mark.parametrize("train", [True, False])
def test_skip_mode_over_every_corrupt_kind(make, train, caplog):
    """Every good image exactly once, every bad one counted and named once, in both loaders."""
    bad = odd_images.corrupt()
    items, good_ids, names = [], [], {}
    for k, (name, data) in enumerate(bad.items()):
        items += [odd_images.good_jpeg(), data]
        good_ids.append(2 * k)
        names[2 * k + 1] = name
    items.append(odd_images.good_jpeg())
    good_ids.append(len(items) - 1)
    reader = IndexReader(items)
    loader = make(reader, 4, train=train, on_error="skip")
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            labels, _ = epoch_labels(loader, epoch)
            assert sorted(labels) == good_ids, f"epoch {epoch}"
    assert loader.skipped == 2 * len(bad)
    assert not any("BytesIO" in r.getMessage() for r in caplog.records)  # the record is named, not a buffer
    for index in names:
        assert sum(f"record {index} " in r.getMessage() for r in caplog.records) == 1, names[index]


def test_local_rank_picks_the_gpu(monkeypatch):
    import dali_fast.iterator as it

    monkeypatch.setattr(it, "cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert it.local_device_index() == 3  # torchrun's process on the node's fourth GPU → DALI device_id 3


def test_one_visible_gpu_per_process_is_device_0_whatever_the_local_rank(monkeypatch, caplog):
    """SLURM's --gpus-per-task=1 (and other launchers) show each process only its own GPU through
    CUDA_VISIBLE_DEVICES: device LOCAL_RANK does not exist there ("invalid device ordinal")."""
    import dali_fast.iterator as it

    monkeypatch.setattr(it, "cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(it, "_SAID", set())
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level(logging.INFO, logger="dali_fast.iterator"):
        assert it.local_device_index() == 0
        assert it.local_device_index() == 0
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "LOCAL_RANK=3 of 4 local ranks sees 1 CUDA device(s) (the launcher set CUDA_VISIBLE_DEVICES per process): "
        "using CUDA device 0 (LOCAL_RANK % 1)"
    ]  # once, not per loader
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with caplog.at_level(logging.INFO, logger="dali_fast.iterator"):
        assert it.local_device_index() == 1  # 4 ranks on 2 visible GPUs: they share, and the log warns
    assert (
        caplog.records[-1].levelno == logging.WARNING and "several ranks share a GPU" in caplog.records[-1].getMessage()
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert it.local_device_index() == 0  # no LOCAL_WORLD_SIZE: rank 3 still cannot be device 3 of 1


def running_dali_pipelines() -> int:
    from nvidia.dali.pipeline import Pipeline

    return sum(1 for ref in Pipeline._pipes if ref() is not None and ref()._pipe is not None)  # noqa: SLF001


def test_no_dali_pipeline_outlives_its_epoch():
    """Abandoned or failed, an epoch's pipeline is shut down at once, not at garbage collection (a live one
    inherited by forked DataLoader workers crashed them); a finished one is kept for the next epoch."""
    cls = loader_class("dali")
    gc.collect()
    others = running_dali_pipelines()  # loaders of earlier tests not yet collected
    good = jpeg_bytes(32, 24)
    reader = IndexReader([good, odd_images.corrupt()["undefined_table_jpeg"], good, good])
    loader = cls(IndexReader([good] * 6), 2, image_size=16, device="cpu", num_threads=2)
    epoch_labels(loader, 0)  # finished: kept for the next epoch
    epoch_labels(loader, 1, limit=1)  # abandoned: shut down
    assert running_dali_pipelines() == others
    failing = cls(reader, 2, train=False, image_size=16, device="cpu", num_threads=2)
    with pytest.raises(RuntimeError) as failure:
        epoch_labels(failing, 0)
    assert failure.value.__traceback__ is not None  # the traceback (and its frames) are still held here
    assert running_dali_pipelines() == others


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


def test_peek_then_train_loses_nothing(make, index_reader):
    loader = make(index_reader, 8, seed=1)
    images, labels = next(iter(loader))  # look at the shapes first
    assert images.shape[0] == 8
    labels0, sizes = epoch_labels(loader, 0)
    assert sorted(labels0) == list(range(37)) and sizes == [8, 8, 8, 8, 5]
    assert labels0[:8] == labels.tolist()  # the peeked batch comes again, in its place


def test_break_then_iter_again_restarts_the_epoch(make, index_reader):
    loader = make(index_reader, 8, seed=1)
    loader.set_epoch(2)
    first, _ = epoch_labels(loader, limit=2)
    again, _ = epoch_labels(loader)
    assert sorted(again) == list(range(37)) and again[:16] == first and loader.epoch == 2


def test_load_state_dict_makes_the_next_iter_continue(make, index_reader):
    loader = make(index_reader, 8, seed=1)
    loader.set_epoch(1)
    seen, _ = epoch_labels(loader, limit=2)
    state = loader.state_dict()
    loader.load_state_dict(state)  # on the same loader
    rest, _ = epoch_labels(loader)
    assert sorted(seen + rest) == list(range(37))
    again, _ = epoch_labels(loader, 1)  # no load_state_dict since: the whole epoch
    assert sorted(again) == list(range(37))


def test_a_new_pass_abandons_the_running_one_which_then_refuses_in_one_line(make, index_reader):
    """As with a DataLoader, iter() (or set_epoch, load_state_dict) starts over; the old pass, if used
    again, raises instead of silently sharing or losing batches."""
    loader = make(index_reader, 8)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="between epochs"):
        loader.batch_size = 4
    for start_over in (
        lambda: iter(loader),
        lambda: loader.set_epoch(0),
        lambda: loader.load_state_dict(loader.state_dict()),
    ):
        new = start_over()
        with pytest.raises(RuntimeError) as e:
            next(it)
        assert str(e.value) == (
            "this pass over the loader was abandoned when another started (iter(), set_epoch() or "
            "load_state_dict()); iterate one pass at a time"
        )
        it = iter(loader) if new is None else new
        next(it)
    rest = [x for _, lab in it for x in lab.tolist()]
    assert len(rest) == 37 - 16  # the last pass (resumed at 8, one batch taken) runs on undisturbed
    assert sorted(epoch_labels(loader, 5)[0]) == list(range(37))


def test_iter_then_set_epoch_then_next_as_lightning_calls_them(make, index_reader):
    loader = make(index_reader, 8, seed=3)
    epoch_labels(loader, 0)
    it = iter(loader)
    loader.set_epoch(4)  # between iter() and the first next(): the pass covers epoch 4
    labels = [x for _, lab in it for x in lab.tolist()]
    assert labels == epoch_labels(make(index_reader, 8, seed=3), 4)[0]


def test_not_a_state_dict_is_one_line(make, index_reader):
    loader = make(index_reader, 8)
    for bad in ({}, {"sampler": {}}, {"sampler": {"epoch": 1}}, []):
        with pytest.raises(ValueError) as e:
            loader.load_state_dict(bad)
        assert str(e.value).startswith("not a loader state_dict") and "\n" not in str(e.value)


def dali_error(text, op="nvidia.dali.fn.decoders.image_random_crop", device="MIXED", kind=RuntimeError):
    """An error as DALI 2.4 raises it from a running pipeline (the layout of
    dali/pipeline/operator/error_reporting.cc under the executor's "Critical error in pipeline:")."""
    return kind(
        "Critical error in pipeline:\nCritical error in pipeline:\n"
        f"Error in {device} operator `{op}`,\nwhich was used in the pipeline definition with the following "
        'traceback:\n\n  File "train.py", line 12, in pipe\n    images = fn.decoders.image_random_crop(jpegs)\n\n'
        f"encountered:\n\n{text}\nCurrent pipeline object is no longer valid.\nCurrent pipeline object is no longer valid."
    )


# What DALI 2.4 says when an allocation fails (dali/core/cuda_error.h: CUDABadAlloc's two constructors, also
# thrown for cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY and by NvmlBadAlloc; std::bad_alloc;
# CUDAError's layout; nvImageCodec's CHECK_NVIMGCODEC with NVIMGCODEC_STATUS_ALLOCATOR_FAILURE = 5).
DALI_MEMORY_TEXTS = [
    "CUDA allocation failed",
    "Can't allocate 2147483648 bytes on device 0.",
    "Can't allocate 1073741824 bytes on host.",
    "std::bad_alloc",
    "CUDA runtime API error cudaErrorMemoryAllocation (2):\nout of memory",
    "CUDA driver API error CUDA_ERROR_OUT_OF_MEMORY (2):\nout of memory",
    "nvImageCodec failure: '#5'",
]


DALI_OTHER_TEXTS = [
    "Failed to decode sample #1 : ",  # the decoder's per-sample failure (image_decoder.h)
    "nvImageCodec failure: '#3'",  # NVIMGCODEC_STATUS_BAD_CODESTREAM
    'Assert on "roi_anchor.size() == roi_shape.size()" failed\nC++ context: [/opt/dali/dali/operators/generic/erase/erase_utils.h:123] ',
]


@pytest.mark.parametrize("text", DALI_MEMORY_TEXTS)
def test_every_allocation_failure_dali_raises_is_a_memory_error(text):
    pytest.importorskip("nvidia.dali")
    from dali_fast.iterator import is_memory_error

    assert is_memory_error(dali_error(text))
    assert is_memory_error(
        RuntimeError(f"Critical error in pipeline:\n{text}\nCurrent pipeline object is no longer valid.")
    )


@pytest.mark.parametrize("text", DALI_OTHER_TEXTS)
def test_other_dali_failures_are_not_memory_errors(text):
    pytest.importorskip("nvidia.dali")
    from dali_fast.iterator import is_memory_error

    assert not is_memory_error(dali_error(text))


def test_the_memory_texts_are_the_installed_dali_s():
    """The texts above are in the installed DALI's own libraries, word for word."""
    pytest.importorskip("nvidia.dali")
    from pathlib import Path

    import nvidia.dali

    core = (Path(nvidia.dali.__file__).parent / "libdali_core.so").read_bytes()
    for text in (
        b"CUDA allocation failed",
        b"Can't allocate %zu bytes on device %d.",
        b"Can't allocate %zu bytes on host.",
    ):
        assert text in core, text
    ops = (Path(nvidia.dali.__file__).parent / "libdali_operators.so").read_bytes()
    assert b"Failed to decode sample #" in ops and b"nvImageCodec failure: '#" in ops


def test_a_dali_error_names_its_operator_and_keeps_dali_s_text():
    pytest.importorskip("nvidia.dali")
    from dali_fast.iterator import dali_message, parse_dali_error

    oom = parse_dali_error(dali_error("CUDA allocation failed"))
    assert (oom.operator, oom.device, oom.reason) == (
        "nvidia.dali.fn.decoders.image_random_crop",
        "MIXED",
        "CUDA allocation failed",
    )
    assert oom.is_decoder
    erase = parse_dali_error(dali_error(DALI_OTHER_TEXTS[2], op="nvidia.dali.fn.erase", device="GPU"))
    assert not erase.is_decoder
    assert (
        erase.describe()
        == 'GPU operator `nvidia.dali.fn.erase`: Assert on "roi_anchor.size() == roi_shape.size()" failed'
    )
    for op in (
        "nvidia.dali.fn.decoders.image",
        "nvidia.dali.fn.experimental.decoders.image",
        "nvidia.dali.fn.image_decoder_crop",
    ):
        assert parse_dali_error(dali_error("x", op=op)).is_decoder, op
    for op in ("nvidia.dali.fn.resize", "nvidia.dali.fn.crop_mirror_normalize", "nvidia.dali.fn.external_source"):
        assert not parse_dali_error(dali_error("x", op=op)).is_decoder, op
    bare = RuntimeError(
        "Critical error in pipeline:\nCUDA allocation failed\nCurrent pipeline object is no longer valid."
    )
    assert dali_message(bare) == "CUDA allocation failed" and parse_dali_error(bare).operator is None
    assert dali_message(RuntimeError("")) == "RuntimeError"


def _no_pillow_recheck(monkeypatch):
    import dali_fast.pipeline as pl

    def undecodable(*_a, **_k):
        raise AssertionError("the records were re-decoded with Pillow: DALI's failure was blamed on the data")

    monkeypatch.setattr(pl, "undecodable", undecodable)


def test_dali_cuda_allocation_failure_is_memory_never_a_bad_record(index_reader, monkeypatch):
    """DALI's real out-of-memory text ("CUDA allocation failed", from the `mixed` decoder) raises
    DALIMemoryError and tells the controller; no record is blamed or re-decoded."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    from dali_fast import DALIIterator
    from dali_fast.iterator import DALIMemoryError

    class Ctrl(ScriptedController):
        def __init__(self, sizes):
            super().__init__(sizes)
            self.ooms = []

        def report_oom(self, batch_size):
            self.ooms.append(batch_size)

    calls = {"n": 0}
    real_next = DALIGenericIterator.__next__

    def failing_next(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise dali_error("CUDA allocation failed")
        return real_next(self)

    monkeypatch.setattr(DALIGenericIterator, "__next__", failing_next)
    _no_pillow_recheck(monkeypatch)
    ctrl = Ctrl([8])
    loader = DALIIterator(index_reader, 8, image_size=16, device="cpu", num_threads=2, controller=ctrl)
    with pytest.raises(DALIMemoryError) as e:
        epoch_labels(loader, 0)
    assert str(e.value).startswith(
        "DALI ran out of memory at batch size 8: MIXED operator `nvidia.dali.fn.decoders.image_random_crop`: "
        "CUDA allocation failed; use a smaller batch size"
    )
    assert "\n" not in str(e.value) and "record" not in str(e.value) and ctrl.ooms == [8]


def test_a_decoder_failure_on_records_pillow_decodes_names_them_without_blaming_them(index_reader, monkeypatch):
    pytest.importorskip("nvidia.dali")
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    from dali_fast import DALIIterator

    calls = {"n": 0}
    real_next = DALIGenericIterator.__next__

    def failing_next(self):
        calls["n"] += 1
        if calls["n"] == 2:  # the second batch (records 4-7) and the one prefetched after it are in flight
            raise dali_error("Failed to decode sample #1 : ", op="nvidia.dali.fn.decoders.image", device="CPU")
        return real_next(self)

    monkeypatch.setattr(DALIGenericIterator, "__next__", failing_next)
    loader = DALIIterator(index_reader, 4, image_size=16, device="cpu", num_threads=2, train=False, prefetch=1)
    with pytest.raises(RuntimeError) as e:
        epoch_labels(loader, 0)
    msg = str(e.value)
    assert msg.startswith("DALI failed decoding one of records 4 (mem://4.jpg), 5 (mem://5.jpg)") and "\n" not in msg
    assert "CPU operator `nvidia.dali.fn.decoders.image`: Failed to decode sample #1 :" in msg
    assert msg.endswith(
        "each of them decodes with Pillow, so they may not be at fault (DALI's decoder fails so too when it runs "
        "short of memory): check them with `dali-fast inspect --verify`, or try a smaller batch size"
    )


def test_dali_out_of_memory_while_building_the_pipeline_is_memory_too(index_reader, monkeypatch):
    """The decoder preallocates when the pipeline is built: an allocation failure there is the same story."""
    pytest.importorskip("nvidia.dali")
    import dali_fast.pipeline as pl
    from dali_fast import DALIIterator
    from dali_fast.iterator import DALIMemoryError

    def build_fails(*_a, **_k):
        raise RuntimeError(
            "Critical error when building pipeline:\nError in MIXED operator `nvidia.dali.fn.decoders.image`,\n"
            'which was used in the pipeline definition with the following traceback:\n\n  File "x.py", line 1\n\n'
            "encountered:\n\nCan't allocate 211025920 bytes on device 0.\nCurrent pipeline object is no longer valid."
        )

    monkeypatch.setattr(pl, "build_pipeline", build_fails)
    with pytest.raises(DALIMemoryError, match="Can't allocate 211025920 bytes on device 0"):
        epoch_labels(DALIIterator(index_reader, 8, image_size=16, device="cpu", num_threads=2), 0)


def test_a_failing_operator_other_than_the_decoder_is_named_not_blamed_on_records(index_reader, monkeypatch):
    """A real DALI failure in `fn.erase` (malformed boxes): DALI's message with the operator named, no
    record accused, no Pillow re-decode."""
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator
    from dali_fast.iterator import DALIOperatorError

    _no_pillow_recheck(monkeypatch)
    monkeypatch.setattr(DALIIterator, "_boxes", lambda self: lambda idx: np.zeros((len(idx), 2), np.float32))  # no shape part
    recipe = Recipe(image_size=16, random_erasing=1.0)
    for on_error in ("raise", "skip"):
        loader = DALIIterator(index_reader, 8, device="cpu", num_threads=2, recipe=recipe, on_error=on_error)
        with pytest.raises(DALIOperatorError) as e:
            epoch_labels(loader, 0)
        assert str(e.value) == (
            'DALI failed: CPU operator `nvidia.dali.fn.erase`: Assert on "roi_anchor.size() == roi_shape.size()" failed'
        )
        assert loader.skipped == 0


def test_injected_dali_out_of_memory_is_reported_as_memory(index_reader, monkeypatch):
    pytest.importorskip("nvidia.dali")
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    from dali_fast import DALIIterator
    from dali_fast.iterator import DALIMemoryError

    class Ctrl(ScriptedController):
        ooms: list[int] = []

        def report_oom(self, batch_size):
            self.ooms.append(batch_size)

    calls = {"n": 0}
    real_next = DALIGenericIterator.__next__

    def failing_next(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("Critical error in pipeline:\nCan't allocate 1073741824 bytes on device 0.")
        return real_next(self)

    monkeypatch.setattr(DALIGenericIterator, "__next__", failing_next)
    ctrl = Ctrl([8])
    loader = DALIIterator(index_reader, 8, image_size=16, device="cpu", num_threads=2, controller=ctrl, on_error="skip")
    with pytest.raises(DALIMemoryError) as e:
        epoch_labels(loader, 0)
    assert str(e.value).startswith("DALI ran out of memory at batch size 8: Can't allocate 1073741824 bytes")
    assert "failed decoding" not in str(e.value) and ctrl.ooms == [8] and loader.skipped == 0


def auto_device() -> str:
    """Where device="auto" puts a loader's output on this host: a test that leaves the device to the
    loader asserts this, not "cpu" (the same suite runs on GPU hosts)."""
    from dali_fast.iterator import cuda_usable

    return "cuda" if cuda_usable() else "cpu"


def test_defaults_are_the_documented_ones(index_reader):
    from dali_fast import TorchIterator

    loader = TorchIterator(index_reader, 8, num_workers=0)  # everything else default
    assert (loader.image_size, loader.seed, loader.train, loader.drop_last) == (224, 0, True, False)
    assert loader.gpu is (auto_device() == "cuda") and loader.cache_stats() is None  # the GPU when usable; no cache
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, 224, 224) and images.device.type == auto_device() and images.dtype == torch.float32
    same = TorchIterator(index_reader, 8, num_workers=0, seed=0, image_size=224)
    assert epoch_labels(loader, 3)[0] == epoch_labels(same, 3)[0]
    assert loader.last_indices.dtype == np.int64
    fresh = TorchIterator(index_reader, 8, num_workers=0)
    assert fresh.last_indices.tolist() == [] and fresh.last_indices.dtype == np.int64


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"batch_size": 0}, "batch_size=0: must be a positive integer"),
        ({"batch_size": 2.5}, "batch_size=2.5: must be a positive integer"),
        ({"image_size": 0}, "image_size=0: must be a positive integer"),
        ({"image_size": 32.0}, "image_size=32.0: must be a positive integer"),
        ({"device": "tpu"}, "device='tpu': use 'auto' (GPU when CUDA is usable), 'cuda' or 'cpu'"),
        ({"device": "cuda"}, "device='cuda' but CUDA is not usable here; use device='auto' or 'cpu'"),
        ({"device": "gpu"}, "device='gpu' but CUDA is not usable here; use device='auto' or 'cpu'"),
        ({"on_error": "ignore"}, "on_error='ignore': use 'raise' or 'skip'"),
        ({"dtype": torch.int8}, "dtype=torch.int8: use torch.float32, torch.float16 or torch.uint8"),
        ({"cache_bytes": -1}, "cache_bytes=-1: must be >= 0 (0 disables the cache)"),
        ({"num_threads": 0}, "num_threads=0: must be >= 1"),
        ({"prefetch": 0}, "prefetch=0: must be >= 1"),
        ({"rank": 3, "world_size": 2}, "rank=3: must be in [0, 2) for world_size=2"),
    ],
)
def test_bad_arguments_exact_message(make, index_reader, kw, message):
    if kw.get("device") in ("cuda", "gpu") and auto_device() == "cuda":
        pytest.skip("CUDA is usable on this host: device='cuda' is valid here")
    kw = {"batch_size": 4, **kw}
    bs = kw.pop("batch_size")
    with pytest.raises(ValueError) as e:
        make(index_reader, bs, **kw)
    assert str(e.value) == message


def test_smallest_valid_arguments(make, index_reader):
    loader = make(index_reader, 1, image_size=1, num_threads=1, prefetch=1, cache_bytes=1)
    images, labels = next(iter(loader))
    assert images.shape == (1, 3, 1, 1) and labels.shape == (1,)
    assert len(make(IndexReader([jpeg_bytes()]), 1).sampler) == 1  # a data set of one record
    with pytest.raises(ValueError) as e:
        make(IndexReader([]), 1)
    assert str(e.value) == "the data set is empty; nothing to load"


def test_device_choice(monkeypatch, index_reader):
    import dali_fast.fallback as fb
    import dali_fast.iterator as it
    from dali_fast import TorchIterator

    monkeypatch.setattr(it, "cuda_usable", lambda: True)
    monkeypatch.setattr(fb, "local_device_index", lambda: 0)  # no CUDA runtime to ask here
    gpu = {d: TorchIterator(index_reader, 4, device=d, num_workers=0).gpu for d in ("auto", "cuda", "gpu", "cpu")}
    assert gpu == {"auto": True, "cuda": True, "gpu": True, "cpu": False}
    monkeypatch.setattr(it, "cuda_usable", lambda: False)
    assert TorchIterator(index_reader, 4, device="auto", num_workers=0).gpu is False


def test_state_dict_is_exact_and_round_trips_everything(make, index_reader):
    ctrl = ScriptedController([8, 16])
    loader = make(index_reader, 8, seed=4, controller=ctrl)
    loader.set_epoch(2)
    epoch_labels(loader, limit=1)
    state = loader.state_dict()
    assert state == {
        "sampler": {
            "epoch": 2,
            "position": 8,
            "seed": 4,
            "n": 37,
            "rank": 0,
            "world_size": 1,
            "shuffle": True,
            "drop_last": False,
        },
        "finished": False,
        "batch_size": 8,
        "backend": make.backend,
        "controller": {"epochs_ended": 0},
    }
    other = ScriptedController([8, 16])
    resumed = make(index_reader, 5, seed=4, controller=other)
    resumed.load_state_dict({**state, "controller": {"epochs_ended": 1}})
    assert other.epochs_ended == 1 and resumed.epoch == 2
    assert make(index_reader, 8).state_dict().keys() == {"sampler", "finished", "batch_size", "backend"}
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


def test_last_indices_name_the_records_of_the_last_batch(make, index_reader):
    loader = make(index_reader, 8, seed=2)
    loader.set_epoch(1)
    for _, labels in loader:
        assert loader.last_indices.tolist() == labels.tolist()  # labels are the record indices here


class CountingController(ScriptedController):
    def __init__(self, sizes):
        super().__init__(sizes)
        self.begins = 0

    def begin_epoch(self):
        self.begins += 1


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


def test_unreadable_files_in_a_folder_are_bad_records(make, tmp_path):
    from dali_fast.data.folder import ImageFolderReader

    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    for k in range(6):
        (root / "a" / f"{k}.jpg").write_bytes(jpeg_bytes(32, 24))
    (root / "a" / "1.jpg").unlink()
    (root / "a" / "1.jpg").symlink_to(root / "gone.jpg")  # a broken symlink
    reader = ImageFolderReader(root)
    assert len(reader) == 6
    (root / "a" / "3.jpg").unlink()  # a file that vanished after the listing
    with pytest.raises(ValueError) as e:
        epoch_labels(make(reader, 3, train=False), 0)
    assert f"record 1 ({root / 'a' / '1.jpg'}): unreadable: No such file or directory" in str(e.value)
    loader = make(reader, 3, train=False, on_error="skip")
    labels, sizes = epoch_labels(loader, 0)
    assert sizes == [2, 2] and loader.skipped == 2


def test_channels_last_output_same_values_no_copy_needed(make, index_reader):
    plain = make(index_reader, 8, train=False)
    last = make(index_reader, 8, train=False, memory_format=torch.channels_last)
    for (a, ya), (b, yb) in zip(plain, last, strict=True):
        assert torch.equal(ya, yb) and a.shape == b.shape
        assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError) as e:
        make(index_reader, 8, memory_format=torch.preserve_format)
    assert str(e.value) == "memory_format=torch.preserve_format: use torch.contiguous_format or torch.channels_last"


def test_dali_keeps_one_pipeline_across_epochs_of_one_batch_size():
    cls = loader_class("dali")
    gc.collect()
    others = running_dali_pipelines()  # loaders of earlier tests not yet collected
    reader = IndexReader([jpeg_bytes(32 + i % 5, 24 + i % 3) for i in range(37)])
    train = cls(reader, 8, image_size=16, device="cpu", num_threads=2)
    val = cls(reader, 8, train=False, image_size=16, device="cpu", num_threads=2)
    for epoch in range(5):
        assert sorted(epoch_labels(train, epoch)[0]) == list(range(37))
        assert epoch_labels(val, epoch)[0] == list(range(37))
    assert (train.pipelines_built, val.pipelines_built) == (1, 1)
    assert running_dali_pipelines() == others + 2  # kept between epochs
    train.batch_size = 16  # a new batch size: a new pipeline, sized for it
    assert sorted(epoch_labels(train, 5)[0]) == list(range(37)) and train.pipelines_built == 2
    epoch_labels(train, 6, limit=1)  # a break: the pipeline is shut down, the next pass builds one
    assert sorted(epoch_labels(train, 7)[0]) == list(range(37)) and train.pipelines_built == 3
    train.close()
    val.close()
    assert running_dali_pipelines() == others


@pytest.mark.gpu
def test_gpu_one_pipeline_channels_last_and_bounded_decoder_memory(index_reader):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import pynvml

    from dali_fast.system import nvml_handle
    from dali_fast.transforms.dali import DECODER_DEVICE_BUDGET

    pynvml.nvmlInit()
    handle = nvml_handle(pynvml, torch.cuda.current_device())
    before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    cls = loader_class("dali")
    loader = cls(index_reader, 8, device="cuda", memory_format=torch.channels_last)
    for epoch in range(3):
        loader.set_epoch(epoch)
        labels = []
        for images, lab in loader:
            assert images.is_cuda and images.is_contiguous(memory_format=torch.channels_last)
            labels += lab.tolist()
        assert sorted(labels) == list(range(37))
    assert loader.pipelines_built == 1
    grown = pynvml.nvmlDeviceGetMemoryInfo(handle).used - before
    assert grown < DECODER_DEVICE_BUDGET + 2 * 2**30, f"{grown / 2**30:.1f} GiB for one small pipeline"
    loader.close()


def test_dataloader_attributes_tell_the_truth(make, index_reader):
    from torch.utils.data import Sampler

    loader = make(index_reader, 8, drop_last=False)
    assert len(loader) == 5 and loader.batch_size == 8 and loader.drop_last is False
    assert loader.batch_sampler is None and loader.dataset is index_reader and len(loader.dataset) == 37
    assert isinstance(loader.sampler, Sampler) and len(loader.sampler) == 37
    loader.batch_size = 16
    assert len(loader) == 3  # len() follows the batch size
    loader.sampler.set_epoch(3)  # what Lightning calls: the loader's own set_epoch
    labels, sizes = epoch_labels(loader)
    assert loader.epoch == 3 and sizes == [16, 16, 5] and labels == list(loader.sampler)
    assert make(index_reader, 8, rank=1, world_size=2).sampler.__len__() == 19


@pytest.mark.gpu
def test_gpu_float16_output_with_random_erasing(index_reader):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dali_fast.transforms.draws import sample_erasing_box

    cls = loader_class("dali")
    recipe = Recipe(image_size=16, dtype=torch.float16, random_erasing=1.0, erasing_scale=(0.1, 0.3))
    loader = cls(index_reader, 8, device="cuda", seed=5, recipe=recipe)
    loader.set_epoch(0)
    for images, labels in loader:
        assert images.is_cuda and images.dtype == torch.float16
        for img, i in zip(images.cpu(), labels.tolist(), strict=True):
            top, left, h, w = sample_erasing_box(recipe, 5, 0, i)
            if h:
                assert bool((img[:, top : top + h, left : left + w] == 0).all())
    loader.close()


@pytest.mark.gpu
def test_gpu_and_cpu_loaders_give_the_same_pixels():
    """With the mixed decoder upsampling chroma as the CPU decoder does, the eval transform on the GPU and
    on the CPU gives the same pixels within a level or two (photo-like JPEGs: noise, 4:2:0 chroma)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cls = loader_class("dali")
    reader = IndexReader([jpeg_bytes(96 + 8 * (i % 4), 72 + 8 * (i % 3), (40 * i % 250, 90, 200)) for i in range(16)])
    out = {}
    for device in ("cuda", "cpu"):
        loader = cls(reader, 8, train=False, image_size=64, device=device)
        out[device] = torch.cat([x.float().cpu() for x, _ in loader])
        loader.close()
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    levels = (out["cuda"] - out["cpu"]).abs() * std
    assert float(levels.mean()) < 1.5, float(levels.mean())


def test_a_new_batch_size_shuts_the_old_pipeline_before_memory_is_released_and_measured(index_reader, monkeypatch):
    """After a batch-size change the old pipeline goes first: its buffers return to DALI's pool, the
    controller's release frees the pool, then the probe starts the new epoch's reading. In the other
    order the first reading holds the old pipeline too (and can cause a second, needless shrink)."""
    cls = loader_class("dali")
    import dali_fast.pipeline as pl
    from dali_fast import BatchSizeController

    calls = []
    real_shutdown = pl.shutdown_pipeline

    def shutdown(pipe):
        calls.append("shutdown")
        real_shutdown(pipe)

    class Probe:
        def reset_peak(self):
            calls.append("reset")

        def peak_fraction(self):
            return 0.1

    monkeypatch.setattr(pl, "shutdown_pipeline", shutdown)
    ctrl = BatchSizeController(8, 64, probe=Probe(), release=lambda: calls.append("release"), sync_ranks=False)
    loader = cls(index_reader, 8, image_size=16, device="cpu", num_threads=2, controller=ctrl)
    assert sorted(epoch_labels(loader, 0)[0]) == list(range(37))
    assert ctrl.batch_size == 16 and calls == ["release", "reset"]  # the kept pipeline is still up
    calls.clear()
    assert sorted(epoch_labels(loader, 1)[0]) == list(range(37))
    assert calls == ["shutdown", "release", "reset"]
    loader.close()


def test_tests_that_leave_the_device_to_the_loader_assume_no_cpu():
    """The suite runs on GPU hosts too (benchmarks/gpu_check.sh --full): a loader built without a device
    takes the GPU there, so a test that builds one must not assert CPU output or a CPU loader."""
    import ast
    import re
    from pathlib import Path

    loaders = {"TorchIterator", "DALIIterator", "make_loader", "make_loader_for", "cls"}
    claims = re.compile(r'\.gpu is False|device(\.type)? == "cpu"|is_cuda is False|not [\w.\[\]]+\.is_cuda')
    offenders = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        text = path.read_text()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test_"):
                continue
            if any("gpu" in ast.unparse(d) for d in fn.decorator_list):
                continue
            unpinned = [
                c
                for c in ast.walk(fn)
                if isinstance(c, ast.Call)
                and getattr(c.func, "id", getattr(c.func, "attr", None)) in loaders
                and not any(k.arg in ("device", None) for k in c.keywords)  # device=... or **kwargs
            ]
            if unpinned and claims.search(ast.get_source_segment(text, fn) or ""):
                offenders.append(f"{path.name}::{fn.name}")
    assert offenders == []


def test_source_hands_out_the_plan_read_in_batches_with_each_batch_s_boxes():
    """The DALI source without DALI: good records in plan order, bad ones skipped and accounted for (or the
    first named in raise mode), known decoder failures excluded, and erasing boxes drawn for the kept ones."""
    from dali_fast.pipeline import BadRecordError, BatchSource, SkipLog
    from dali_fast.transforms.draws import erasing_boxes

    reader = bad_reader()  # records 2, 5 and 7 are bad
    recipe = Recipe(image_size=16, random_erasing=0.5)
    plan = [np.array([0, 1, 2]), np.array([5, 7]), np.array([9, 8, 3]), np.array([4, 6])]

    def boxes(indices):
        return erasing_boxes(recipe, 3, 1, indices).astype(np.float32)

    source = BatchSource(reader, plan, "skip", SkipLog(), exclude={8: "breaks the decoder"}, boxes=boxes)
    outputs = []
    with pytest.raises(StopIteration):
        while True:
            outputs.append(source())
    assert [out[1].tolist() for out in outputs] == [[0, 1], [9, 3], [4, 6]]
    for datas, labels, rows in outputs:
        assert [bytes(d) for d in datas] == [bytes(reader.items[i]) for i in labels.tolist()]
        assert labels.dtype == np.int64 and rows.dtype == np.float32 and np.array_equal(rows, boxes(labels))
    fed = [source.consume() for _ in outputs]
    assert [(f.consumed, f.kept, f.batches) for f in fed] == [(3, [0, 1], 1), (5, [9, 3], 2), (2, [4, 6], 1)]
    assert [i for f in fed for i, _ in f.skipped] == [2, 5, 7, 8]
    assert dict(fed[1].skipped)[8] == "breaks the decoder" and source.skips.count == 4
    raising = BatchSource(reader, plan[2:] + plan[:1], "raise", SkipLog())
    first = raising()
    assert first[1].tolist() == [9, 8, 3] and len(first) == 2
    raising()
    with pytest.raises(BadRecordError) as e:
        raising()
    assert str(e.value).startswith("record 2 (mem://2.jpg): truncated JPEG")


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_dali_finds_a_packed_record_damaged_inside_after_packing_by_decoding(on_error, tmp_path):
    """Read time checks a packed record's ends only (pack walked its headers): damage in between reaches
    DALI, and the failed batch's records are then checked one by one, which names it."""
    from conftest import make_folder

    from dali_fast.data.format import DATA_FILE
    from dali_fast.data.packed import MemmapReader
    from dali_fast.data.writer import pack

    cls = loader_class("dali")
    images = [jpeg_bytes(40 + k, 30, (40 * k, 90, 200)) for k in range(6)]
    pack(make_folder(tmp_path / "src", {"a": images[:3], "b": images[3:]}), tmp_path / "p", progress=False)
    r = MemmapReader(tmp_path / "p")
    record = bytes(r[4][0])
    second = 4 + int.from_bytes(record[4:6], "big")  # the marker after SOI and APP0
    at, source = int(r.records["offset"][4]) + second, r.source(4)
    del r
    with open(tmp_path / "p" / DATA_FILE, "r+b") as f:
        f.seek(at)
        f.write(b"\x00")
    reader = MemmapReader(tmp_path / "p")
    assert reader.read_batch_checked(range(6))[2] == {}  # its ends are whole
    loader = cls(reader, 3, train=False, image_size=16, device="cpu", num_threads=2, on_error=on_error)
    if on_error == "raise":
        with pytest.raises((RuntimeError, ValueError)) as e:
            epoch_labels(loader, 0)
        msg = str(e.value)
        assert f"record 4 ({source}): corrupt JPEG (no marker at byte {second})" in msg and "\n" not in msg
        return
    labels, _ = epoch_labels(loader, 0)
    assert sorted(labels) == [0, 0, 0, 1, 1] and loader.skipped == 1


def test_dali_over_a_folder_keeps_its_threads_over_epochs(tmp_path):
    """The read pool is made once per process: epochs over a folder add no threads (nor memory for them)."""
    import threading

    from conftest import make_folder

    from dali_fast.data.folder import ImageFolderReader

    cls = loader_class("dali")
    root = make_folder(tmp_path / "imgs", {f"c{k:02d}": [jpeg_bytes(30 + k, 24)] for k in range(13)})
    loader = cls(ImageFolderReader(root), 4, image_size=16, device="cpu", num_threads=2)
    epoch_labels(loader, 0)
    before = threading.active_count()
    for epoch in range(1, 6):  # one image per class: the labels name the records, each exactly once
        labels, sizes = epoch_labels(loader, epoch)
        assert sorted(labels) == list(range(13)) and sizes == [4, 4, 4, 1]
    assert threading.active_count() == before
    loader.close()
