"""The loader contract (`LoaderBase`, the epoch driver), run against every backend (DALI in CPU-only mode
here; GPU tests marked `gpu`), and what the base asks of a backend."""

from __future__ import annotations

import io
import logging

import numpy as np
import odd_images
import pytest
import torch
from conftest import IndexReader, first_batch, jpeg_bytes, one_line, png_bytes
from contract import each_once, run_close_mid_pass, run_save_load_state
from PIL import Image

from dali_fast.loaders.base import LoaderBase
from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD

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
        each_once(labels, range(37))
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
        each_once(labels, range(37))
        assert sizes == [6] * 6 + [1]
    labels, _ = epoch_labels(loader, 2, limit=2)  # leave with batches in flight
    assert len(labels) == 12
    each_once(epoch_labels(loader, 3)[0], range(37))


def test_save_load_state_contract(make, index_reader):
    """The contract checker: every epoch exactly once, and a state from anywhere resumes exactly there (in
    TorchIterator's case through worker processes, which work ahead of what was delivered)."""
    extra = {"num_workers": 2} if make.backend == "torch" else {"prefetch": 3}
    run_save_load_state(lambda: make(index_reader, 5, seed=9, **extra), midpoint=3)


def test_close_mid_pass_contract(make, index_reader):
    """close() between two batches: one rule for every backend (the pass raises that it was closed, nothing
    more is yielded), checked by the shared contract, with worker processes working ahead (TorchIterator)
    and a deep DALI prefetch."""
    extra = {"num_workers": 2} if make.backend == "torch" else {"prefetch": 3}
    run_close_mid_pass(lambda: make(index_reader, 5, seed=9, **extra), midpoint=3)


def test_close_mid_pass_releases_what_the_pass_holds_at_once(make, index_reader, monkeypatch):
    """close() mid-pass releases the pass's own pipeline or worker processes now, not when the pass is
    dropped: DALI's pipeline is shut down, TorchIterator's workers have exited."""
    import multiprocessing

    shut = []
    if make.backend == "dali":
        import dali_fast.loaders.dali_iterator as di

        real = di.shutdown_pipeline
        monkeypatch.setattr(di, "shutdown_pipeline", lambda pipe: (shut.append(pipe), real(pipe)))
    loader = make(index_reader, 4, **({"num_workers": 2} if make.backend == "torch" else {}))
    it = iter(loader)
    next(it)
    before = set(multiprocessing.active_children())
    loader.close()
    if make.backend == "dali":
        assert len(shut) == 1  # the pipeline the pass was running
    else:
        assert len(before) == 2 and not set(multiprocessing.active_children()) & before
    with pytest.raises(RuntimeError, match=r"^this pass over the loader ended when the loader was closed"):
        next(it)


def test_batch_size_changes_between_epochs(make, index_reader):
    ctrl = ScriptedController([8, 16, 5, 32, 3, 11])
    loader = make(index_reader, 8, controller=ctrl)
    for epoch, bs in enumerate(ctrl.sizes):
        assert loader.batch_size == bs
        expected_len = len(loader)
        labels, sizes = epoch_labels(loader, epoch)
        each_once(labels, range(37), what=f"epoch {epoch} at batch size {bs}")
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
        each_once(labels, range(37))


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
    assert len(seen) == 15
    each_once(seen + rest, range(37))
    reference, _ = epoch_labels(make(index_reader, 5, seed=9), 4)
    assert seen + rest == reference  # the same order as an uninterrupted epoch
    # the epoch after the resumed one is complete again
    each_once(epoch_labels(resumed, 5)[0], range(37))


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
    each_once((x for labels, _ in per_rank for x in labels), range(37), padding=world - 1)  # only the wrap-around


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
    images, labels = first_batch(loader)
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
    images, labels = first_batch(loader)
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
        each_once(labels, range(37))
    rgb = (200, 30, 60)
    flat = make(IndexReader([flat_png(rgb)] * 4), 4, device="cuda", train=False)
    images, _ = first_batch(flat)
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
    images, labels = first_batch(loader)  # look at the shapes first
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
    each_once(seen + rest, range(37))
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


def auto_device() -> str:
    """Where device="auto" puts a loader's output on this host: a test that leaves the device to the
    loader asserts this, not "cpu" (the same suite runs on GPU hosts)."""
    from dali_fast.machine import cuda_usable

    return "cuda" if cuda_usable() else "cpu"


def test_defaults_are_the_documented_ones(index_reader):
    from dali_fast import TorchIterator

    loader = TorchIterator(index_reader, 8, num_workers=0)  # everything else default
    assert (loader.image_size, loader.seed, loader.train, loader.drop_last) == (224, 0, True, False)
    assert (loader.prefetch, loader.on_error) == (2, "raise")  # docs/loaders.md's signature
    assert loader.gpu is (auto_device() == "cuda") and loader.cache_stats() is None  # the GPU when usable; no cache
    images, labels = first_batch(loader)
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
    images, labels = first_batch(loader)
    assert images.shape == (1, 3, 1, 1) and labels.shape == (1,)
    assert len(make(IndexReader([jpeg_bytes()]), 1).sampler) == 1  # a data set of one record
    with pytest.raises(ValueError) as e:
        make(IndexReader([]), 1)
    assert str(e.value) == "the data set is empty; nothing to load"


def test_device_choice(monkeypatch, index_reader):
    import dali_fast.loaders.base as base
    import dali_fast.loaders.torch_iterator as torch_iterator
    from dali_fast import TorchIterator

    monkeypatch.setattr(base, "cuda_usable", lambda: True)  # what LoaderBase asks
    monkeypatch.setattr(torch_iterator, "local_device_index", lambda: 0)  # no CUDA runtime to ask here
    gpu = {d: TorchIterator(index_reader, 4, device=d, num_workers=0).gpu for d in ("auto", "cuda", "gpu", "cpu")}
    assert gpu == {"auto": True, "cuda": True, "gpu": True, "cpu": False}
    monkeypatch.setattr(base, "cuda_usable", lambda: False)
    assert TorchIterator(index_reader, 4, device="auto", num_workers=0).gpu is False


def test_state_dict_is_exact_and_round_trips_everything(make, index_reader):
    ctrl = ScriptedController([8, 16])
    loader = make(index_reader, 8, seed=4, controller=ctrl)
    loader.set_epoch(2)
    epoch_labels(loader, limit=1)
    state = loader.state_dict()
    assert state == {
        "sampler": _fresh_sampler_state(epoch=2, position=8),
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


def test_tests_that_leave_the_device_to_the_loader_assume_no_cpu():
    """The suite runs on GPU hosts too (gpu_check/gpu_check.sh --full): a loader built without a device
    takes the GPU there, so a test that builds one must not assert CPU output or a CPU loader."""
    import ast
    import re
    from pathlib import Path

    loaders = {"TorchIterator", "DALIIterator", "make_loader", "cls"}
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


# ----------------------------------------------------------------------------- what the base asks of a backend


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
    for module in (base, sampler):  # read when the loader is made (base) and when it follows (sampler)
        monkeypatch.setattr(module, "dist_rank_world", lambda r, w: (group["rank"], group["world"]))
    loader = ListBackend(index_reader, 4, device="cpu", seed=3, drop_last=True)
    loader.set_epoch(2)
    group.update(rank=1, world=2)
    with caplog.at_level(logging.INFO, logger="dali_fast.loaders.sampler"):
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
    for module in (base, sampler):  # read when the loader is made (base) and when it follows (sampler)
        monkeypatch.setattr(module, "dist_rank_world", lambda r, w: (group["rank"], group["world"]))
    loader = ListBackend(index_reader, 4, device="cpu")
    group.update(rank=0, world=1)
    assert len(listed(loader)) == 37 and (loader.rank, loader.world_size) == (0, 1)


def test_a_process_group_that_changes_the_rank_mid_epoch_is_refused_in_one_line(index_reader, monkeypatch):
    import dali_fast.loaders.base as base
    import dali_fast.loaders.sampler as sampler

    group = {"rank": 0, "world": 1}
    for module in (base, sampler):  # read when the loader is made (base) and when it follows (sampler)
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


def _fresh_sampler_state(**kw):
    return {
        "epoch": 0,
        "position": 0,
        "seed": 4,
        "n": 37,
        "rank": 0,
        "world_size": 1,
        "shuffle": True,
        "drop_last": False,
        **kw,
    }


def test_close_before_any_pass_is_harmless_and_a_new_loader_s_state_is_exact(index_reader):
    loader = ListBackend(index_reader, 8, device="cpu", seed=4)
    expected = {"sampler": _fresh_sampler_state(), "finished": False, "batch_size": 8, "backend": "list"}
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
        "sampler": _fresh_sampler_state(epoch=1, position=8),
        "finished": False,
        "batch_size": 8,
        "backend": "list",
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


# ----------------------------------------------------------------------------- progressive resizing
def _builds(loader):
    """Pipelines (DALI) or batch rings with their worker pools (torch) made so far."""
    return loader.pipelines_built if hasattr(loader, "pipelines_built") else loader.pools_started


def test_progressive_size_follows_the_schedule_exactly_once_one_build_per_size(make, index_reader):
    from dali_fast import Progressive, Recipe

    ramp = Progressive(16, 32, start_epoch=1, end_epoch=3, step=8)
    loader = make(index_reader, 8, recipe=Recipe(image_size=40, resolution=ramp), image_size=None)
    sizes, builds = [], []
    for epoch in range(6):
        loader.set_epoch(epoch)
        assert loader.image_size == ramp(epoch)
        shapes, labels = set(), []
        for images, y in loader:
            shapes.add(tuple(images.shape[1:]))
            labels += y.tolist()
        each_once(labels, range(37), what=f"epoch {epoch} at {ramp(epoch)} px")
        assert len(shapes) == 1
        sizes.append(shapes.pop()[-1])
        builds.append(_builds(loader))
    assert sizes == [16, 16, 24, 32, 32, 32]
    # one build per distinct size, none in an epoch whose size did not change
    assert builds == [1, 1, 2, 3, 3, 3]
    # evaluation keeps its own size (image_size), whatever the epoch
    val = make(index_reader, 8, recipe=Recipe(image_size=40, resolution=ramp), image_size=None, train=False)
    val.set_epoch(4)
    assert {tuple(x.shape[1:]) for x, _ in val} == {(3, 40, 40)}


def test_progressive_any_function_of_the_epoch(make, index_reader):
    from dali_fast import Recipe

    def steps(epoch):
        return 16 if epoch < 2 else 24

    loader = make(index_reader, 16, recipe=Recipe(image_size=24, resolution=steps), image_size=None)
    seen = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        seen.append({x.shape[-1] for x, _ in loader})
    assert seen == [{16}, {16}, {24}, {24}] and _builds(loader) == 2
    with pytest.raises(ValueError, match=r"gave 0.5 for epoch 0: it must give a positive integer"):
        make(index_reader, 16, recipe=Recipe(resolution=lambda e: 0.5), image_size=None)


def test_progressive_resume_inside_the_ramp(make, index_reader):
    """A state taken mid-epoch inside the ramp resumes at the same size, each sample once; a loader with
    another schedule (or none) refuses it in one line."""
    from dali_fast import Progressive, Recipe

    recipe = Recipe(image_size=32, resolution=Progressive(16, 32, 1, 3, step=8))
    loader = make(index_reader, 5, seed=3, recipe=recipe, image_size=None)
    loader.set_epoch(2)
    seen, state = take_then_save(loader, 3)
    assert state["image_size"] == 24
    resumed = make(index_reader, 5, seed=3, recipe=recipe, image_size=None)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert resumed.image_size == 24
    rest, shapes = [], set()
    for images, labels in resumed:
        rest += labels.tolist()
        shapes.add(images.shape[-1])
    each_once(seen + rest, range(37), what="the resumed epoch")
    assert shapes == {24}
    reference = make(index_reader, 5, seed=3, recipe=recipe, image_size=None)
    assert seen + rest == epoch_labels(reference, 2)[0]
    # the next epoch is at the next size
    resumed.set_epoch(3)
    assert {x.shape[-1] for x, _ in resumed} == {32}
    other = make(
        index_reader, 5, seed=3, recipe=recipe.with_(resolution=Progressive(16, 32, 1, 4, step=8)), image_size=None
    )
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    assert one_line(e) == (
        "cannot resume: the state was saved with resolution schedule 16:32:1:3:8, this loader has "
        "16:32:1:4:8; resume with the recipe it was saved with"
    )
    fixed = make(index_reader, 5, seed=3, image_size=32)
    with pytest.raises(ValueError, match=r"saved with resolution schedule 16:32:1:3:8, this loader has none"):
        fixed.load_state_dict(state)


class PixelProbe:
    """A fake device whose need grows with the pixels of a batch, as a caching allocator's does: the
    epoch's peak is ``fixed`` plus ``per_pixel`` times the batch size the loader was built for times the
    pixels per image of the largest batch delivered."""

    def __init__(self, loader_ref, fixed, per_pixel):
        self.loader_ref, self.fixed, self.per_pixel = loader_ref, fixed, per_pixel
        self.pixels = 0
        self.readings = []

    def saw(self, images):
        self.pixels = max(self.pixels, images.shape[-1] * images.shape[-2])

    def reset_peak(self):
        self.pixels = 0

    def peak_fraction(self):
        need = self.fixed + self.per_pixel * self.loader_ref[0].batch_size * self.pixels
        self.readings.append((self.loader_ref[0].batch_size, self.pixels, need))
        return need


def test_progressive_controller_never_passes_the_target(make, index_reader):
    """The ramp 160 → 224 at batch 512: a batch size fine at 160 px would need 128% at 224 px; the
    controller scales its prediction by the pixel ratio and cuts the batch before each larger size."""
    from dali_fast import BatchSizeController, Progressive, Recipe

    ref = [None]
    probe = PixelProbe(ref, fixed=0.10, per_pixel=0.60 / (512 * 160 * 160))  # 70% at batch 512, 160 px
    ctrl = BatchSizeController(64, 512, target_fraction=0.85, probe=probe, release=None)
    recipe = Recipe(image_size=224, resolution=Progressive(160, 224, start_epoch=1, end_epoch=3))
    loader = ref[0] = make(index_reader, 512, recipe=recipe, image_size=None, controller=ctrl)
    for epoch in range(5):
        loader.set_epoch(epoch)
        labels = []
        for images, y in loader:
            probe.saw(images)
            labels += y.tolist()
        each_once(labels, range(37), what=f"epoch {epoch}")
    sides = [round(p**0.5) for _, p, _ in probe.readings]
    assert sides == [160, 160, 192, 224, 224]
    needs = [need for _, _, need in probe.readings]
    assert max(needs) <= 0.85, probe.readings
    assert probe.readings[0][0] == 512 and probe.readings[-1][0] < 512  # it did cut, and only as needed
    assert needs[-1] > 0.6  # not starved: the last size still uses most of the target
