"""TorchIterator specifics (the shared contract runs in the test_base_*.py files for both backends)."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import odd_images
import pytest
import torch
from builders import IndexReader, first_batch

from dali_fast.data.pack.packed import pack
from dali_fast.data.synthetic import make_synthetic
from dali_fast.loaders.torch_iterator import TorchIterator
from dali_fast.transforms.resize import random_resized_crop_box


def collect(loader, epoch):
    loader.set_epoch(epoch)
    return [y for _, labels in loader for y in labels.tolist()]


def test_worker_processes_exactly_once_break_and_resume(index_reader):
    loader = TorchIterator(index_reader, 5, image_size=16, num_workers=2, device="cpu", seed=2)
    assert sorted(collect(loader, 0)) == list(range(37))
    loader.set_epoch(1)
    for k, _ in enumerate(loader):
        if k == 1:
            break  # abandon with batches in flight in the workers
    assert sorted(collect(loader, 2)) == list(range(37))
    # resume mid-epoch with workers
    loader.set_epoch(3)
    seen = []
    for k, (_, labels) in enumerate(loader):
        seen += labels.tolist()
        if k == 3:
            state = loader.state_dict()
            break
    other = TorchIterator(index_reader, 5, image_size=16, num_workers=2, device="cpu", seed=2)
    other.load_state_dict(state)
    rest = [y for _, labels in other for y in labels.tolist()]
    assert sorted(seen + rest) == list(range(37))


def test_same_order_as_dali(index_reader):
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator

    kw = dict(image_size=16, device="cpu", seed=11, rank=1, world_size=2)
    t, d = TorchIterator(index_reader, 4, num_workers=0, **kw), DALIIterator(index_reader, 4, **kw)
    for epoch in (0, 3):
        assert collect(t, epoch) == collect(d, epoch)


def test_augmentation_independent_of_workers_and_batch_size(index_reader):
    a = TorchIterator(index_reader, 8, image_size=16, num_workers=0, device="cpu", seed=4)
    b = TorchIterator(index_reader, 8, image_size=16, num_workers=2, device="cpu", seed=4)
    a.set_epoch(1)
    b.set_epoch(1)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_eval_images_agree_with_dali(tmp_path):
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator, open_dataset
    from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD

    make_synthetic(tmp_path / "s", images=12, classes=3, seed=1, progress=False)
    pack(tmp_path / "s", tmp_path / "p", progress=False)
    reader = open_dataset(tmp_path / "p")
    kw = dict(train=False, image_size=64, device="cpu")
    t = TorchIterator(reader, 6, num_workers=0, **kw)
    d = DALIIterator(reader, 6, **kw)
    mean = np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)
    std = np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    scores = []
    for (xt, yt), (xd, yd) in zip(t, d, strict=True):
        assert torch.equal(yt, yd)
        pt = xt.numpy() * std + mean
        pd = xd.numpy() * std + mean
        scores += [psnr(pt[i], pd[i]) for i in range(len(yt))]
    assert len(scores) == 12 and min(scores) >= 30, scores


def test_cache_shared_across_workers(index_reader):
    loader = TorchIterator(index_reader, 8, image_size=16, num_workers=2, device="cpu", cache_bytes=10**7)
    for epoch in range(3):
        assert sorted(collect(loader, epoch)) == list(range(37))
    s = loader.cache_stats()
    assert s["misses"] == 37 and s["hits"] == 74


def _eval_reference(truth: np.ndarray, size: int) -> np.ndarray:
    """The eval transform of the true image (shorter side to size/0.875, centre crop), CHW float."""
    from PIL import Image

    rgb = Image.fromarray(truth)
    short = round(size / 0.875)
    scale = short / min(rgb.size)
    rw, rh = max(size, round(rgb.width * scale)), max(size, round(rgb.height * scale))
    rgb = rgb.resize((rw, rh), Image.BILINEAR)
    x0, y0 = (rw - size + 1) // 2, (rh - size + 1) // 2
    return np.asarray(rgb.crop((x0, y0, x0 + size, y0 + size)), np.float32).transpose(2, 0, 1)


def _denormalized(x: torch.Tensor) -> np.ndarray:
    from dali_fast.transforms.recipe import IMAGENET_MEAN, IMAGENET_STD

    return x.float().numpy() * np.array(IMAGENET_STD).reshape(3, 1, 1) + np.array(IMAGENET_MEAN).reshape(3, 1, 1)


def test_the_shared_rule_on_16_bit_and_exif():
    from dali_fast.transforms.decode import decode_rgb

    odd = odd_images.odd_valid()
    for name, (data, truth) in odd_images.odd_valid_with_truth().items():
        assert np.abs(decode_rgb(data).astype(int) - truth).mean() < 3, name
    gray16 = decode_rgb(odd["gray16_png"])
    assert gray16.shape == (48, 64, 3) and gray16[0, 0].tolist() == [0, 0, 0] and gray16[-1, -1].tolist() == [255] * 3
    assert 120 < gray16.mean() < 135  # a ramp from black to white, not all white
    shown = decode_rgb(odd["exif_rotated"])
    plain = decode_rgb(odd["plain"])
    assert shown.shape == plain.shape == (48, 64, 3)  # turned back to the scene's landscape shape
    assert np.abs(shown.astype(int) - plain.astype(int)).mean() < 3


def test_odd_images_decode_alike_in_all_three_loaders():
    """16-bit, EXIF-rotated, CMYK, alpha, palette, gray, progressive, trailing data: same pixels everywhere."""
    from dali_fast.loaders.baseline import BaselineDataset

    odd = odd_images.odd_valid_with_truth()
    names = list(odd)
    reader = IndexReader([data for data, _ in odd.values()])
    size = 32
    refs = [_eval_reference(truth, size) for _, truth in odd.values()]
    got = {"baseline": [BaselineDataset(reader, train=False, image_size=size)[i][0] for i in range(len(names))]}
    torch_it = TorchIterator(reader, len(names), train=False, image_size=size, device="cpu", num_workers=0)
    got["torch"] = list(first_batch(torch_it)[0])
    if importlib.util.find_spec("nvidia.dali") is not None:
        from dali_fast import DALIIterator

        dali_it = DALIIterator(reader, len(names), train=False, image_size=size, device="cpu", num_threads=2)
        got["dali"] = list(first_batch(dali_it)[0])
    for loader, images in got.items():
        for name, ref, x in zip(names, refs, images, strict=True):
            diff = np.abs(_denormalized(x) - ref).mean()
            assert diff < 4.0, f"{loader} decodes {name} {diff:.1f} levels away from what a viewer shows"


def test_a_killed_worker_breaks_one_pass_not_every_later_one(index_reader, caplog):
    import os
    import signal

    loader = TorchIterator(index_reader, 4, image_size=16, num_workers=2, device="cpu")
    assert sorted(collect(loader, 0)) == list(range(37))
    loader.set_epoch(1)
    it = iter(loader)
    next(it)
    worker = loader._loader._iterator._workers[0]  # noqa: SLF001 - the test plays the OOM killer
    os.kill(worker.pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="DataLoader worker"):
        for _ in it:
            pass
    assert sum("a new worker pool starts" in r.getMessage() for r in caplog.records) == 1
    for epoch in (1, 2):
        assert sorted(collect(loader, epoch)) == list(range(37))


def test_train_output_is_pillows_within_stated_levels():
    """The default recipe's pixels (uint8 output, before normalization) against Pillow on the same crop box
    and flip, over the fingerprint images (noisy gradients: +-30 levels of noise per pixel).

    Upscales and shrinks by 2x or more are Pillow's filter: the crop then resize (torchvision's rule on a
    PIL image) within 0.05 levels on average and 1 at most; the baseline's ``resize(box=...)``, which also
    reads pixels just outside the box, within 0.3 on average and 1 at most away from the 2-pixel border.
    Shrinks under 2x are plain bilinear (`dali_fast.transforms.resize`: no aliasing there, less time): within
    1 level of bilinear interpolation's definition, and 1.5-2 levels on average from Pillow's filter on
    these images (its triangle widens a little on every shrink; pixel-sized noise is where two filters
    differ most; on real photos under a level, docs/loaders.md), so under 3 here."""
    from bilinear import plain_reference
    from default_output import ListReader, images
    from PIL import Image

    from dali_fast.transforms.decode import decode_rgb
    from dali_fast.transforms.draws import SampleDraws, crop_draws
    from dali_fast.transforms.recipe import Recipe
    from dali_fast.transforms.resize import plain_bilinear

    items = images(16)
    recipe = Recipe(image_size=32, mean=None, std=None)
    loader = TorchIterator(ListReader(items), 16, recipe=recipe, seed=3, num_workers=0, device="cpu")
    crop_diff, box_diff, inner_max, plain_diff, plain_def_max = [], [], 0, [], 0
    for epoch in (0, 1, 2):
        loader.set_epoch(epoch)
        x, _ = first_batch(loader)
        for k, i in enumerate(loader.last_indices.tolist()):
            rgb = decode_rgb(items[i][0])
            im = Image.fromarray(rgb)
            rng = SampleDraws(crop_draws(3, epoch, [i])[0])
            left, top, w, h = random_resized_crop_box(rng, im.width, im.height, recipe.scale, recipe.ratio)
            box = (left, top, left + w, top + h)
            cropped = np.asarray(im.crop(box).resize((32, 32), Image.BILINEAR)).astype(int)
            boxed = np.asarray(im.resize((32, 32), Image.BILINEAR, box=box)).astype(int)
            defined = plain_reference(rgb[top : top + h, left : left + w], 32).astype(int)
            if rng.random() < recipe.hflip:
                cropped, boxed, defined = cropped[:, ::-1], boxed[:, ::-1], defined[:, ::-1]
            got = x[k].permute(1, 2, 0).numpy().astype(int)
            if plain_bilinear((h, w), (32, 32)):
                plain_diff.append(np.abs(got - cropped))
                plain_def_max = max(plain_def_max, int(np.abs(got - defined).max()))
                continue
            crop_diff.append(np.abs(got - cropped))
            box_diff.append(np.abs(got - boxed))
            inner_max = max(inner_max, int(np.abs(got - boxed)[2:-2, 2:-2].max()))
    assert len(crop_diff) + len(plain_diff) == 48 and len(crop_diff) >= 8 and len(plain_diff) >= 8
    assert np.mean(crop_diff) < 0.05 and max(d.max() for d in crop_diff) <= 1
    assert np.mean(box_diff) < 0.3 and inner_max <= 1
    assert plain_def_max <= 1 and np.mean(plain_diff) < 3


def _child_pids() -> set[int]:
    import os

    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            out.update(int(p) for p in f.read().split())
    return out


def _resources() -> tuple[int, set[str], set[int]]:
    """(open fds, /dev/shm entries, child processes) of this process."""
    import gc
    import os
    import time

    # Threads of an earlier loader (queue feeders) may still be closing their pipes: read once the count
    # holds still, so that their cleanup is not counted against the loader measured next.
    gc.collect()
    fds, deadline = len(os.listdir("/proc/self/fd")), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
        now = len(os.listdir("/proc/self/fd"))
        if now == fds:
            break
        fds = now
    return fds, set(os.listdir("/dev/shm")), _child_pids()


def test_close_leaves_no_process_shared_memory_or_fd_behind(index_reader):
    def use(loader):
        assert sorted(collect(loader, 0)) == list(range(37))
        loader.set_epoch(1)
        for k, _ in enumerate(loader):
            if k == 2:
                break  # abandoned with batches in flight
        loader.batch_size = 9  # a larger batch: new slots and a new worker pool
        assert sorted(collect(loader, 2)) == list(range(37))
        loader.close()

    use(TorchIterator(index_reader, 4, image_size=16, num_workers=2, device="cpu"))  # warm-up (lazy imports)
    fds, shm, kids = _resources()
    loader = TorchIterator(index_reader, 4, image_size=16, num_workers=2, device="cpu")
    use(loader)
    after = _resources()
    assert after[2] - kids == set(), "worker processes outlived close()"
    assert after[1] - shm == set(), "shared-memory segments outlived close()"
    assert after[0] == fds, f"{after[0] - fds} file descriptors outlived close()"
    assert sorted(collect(loader, 3)) == list(range(37))  # a later pass starts again
    loader.close()


class _FailingReader(IndexReader):
    """Raises a non-I/O error (a bug, a broken storage driver) for one record while ``flag`` exists (a file:
    worker processes see it change, where they would not see an attribute change)."""

    def __init__(self, items, fail_at, flag):
        super().__init__(items)
        self.fail_at, self.flag = fail_at, flag

    def __getitem__(self, i):
        if i == self.fail_at and self.flag.exists():
            raise RuntimeError(f"reader broke on record {i}")
        return super().__getitem__(i)


def test_a_worker_that_raises_surfaces_the_error_and_the_next_pass_works(index_reader, tmp_path):
    import time

    flag = tmp_path / "broken"
    flag.touch()
    reader = _FailingReader([bytes(x) for x in index_reader.items], fail_at=11, flag=flag)
    loader = TorchIterator(reader, 4, image_size=16, num_workers=2, device="cpu", train=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="reader broke on record 11"):
        collect(loader, 0)
    assert time.monotonic() - t0 < 30  # raised, not hung
    workers = [w.pid for w in loader._loader._iterator._workers]  # noqa: SLF001
    flag.unlink()  # the storage is back: the same workers go on, exactly once
    assert sorted(collect(loader, 1)) == list(range(37))
    assert [w.pid for w in loader._loader._iterator._workers] == workers  # noqa: SLF001
    loader.close()


def test_a_bad_record_in_a_worker_is_named_in_one_line(index_reader):
    items = [bytes(x) for x in index_reader.items]
    items[13] = items[13][:50]
    loader = TorchIterator(IndexReader(items), 4, image_size=16, num_workers=2, device="cpu")
    with pytest.raises(Exception, match=r"record 13 \(mem://13.jpg\)") as e:  # noqa: PT011
        collect(loader, 0)
    assert "\n" not in str(e.value)
    skipping = TorchIterator(IndexReader(items), 4, image_size=16, num_workers=2, device="cpu", on_error="skip")
    assert sorted(collect(skipping, 0)) == sorted(set(range(37)) - {13}) and skipping.skipped == 1
    loader.close()
    skipping.close()


@pytest.mark.parametrize("prefetch", [1, 3])
def test_workers_give_the_same_pixels_as_the_main_process_through_breaks_and_batch_changes(index_reader, prefetch):
    """Slots are reused constantly here (breaks with batches in flight, new batch sizes): any slot
    handed out while still in use would show up as another sample's pixels."""

    def per_index(loader, epoch, limit=None):
        loader.set_epoch(epoch)
        out = {}
        for k, (x, y) in enumerate(loader):
            out.update({int(i): img for i, img in zip(y, x, strict=True)})
            if limit is not None and k + 1 == limit:
                break
        return out

    ref = TorchIterator(index_reader, 37, image_size=16, num_workers=0, device="cpu", seed=9)
    fast = TorchIterator(index_reader, 3, image_size=16, num_workers=2, device="cpu", seed=9, prefetch=prefetch)
    for epoch in range(3):
        per_index(fast, epoch, limit=2)  # abandoned mid-pass
        fast.batch_size = 3 + 2 * epoch
        want, got = per_index(ref, epoch), per_index(fast, epoch)
        assert sorted(got) == list(range(37))
        for i in range(37):
            assert torch.equal(got[i], want[i]), (epoch, i)
    fast.close()


class SlowReader(IndexReader):
    """An `IndexReader` whose records in ``slow`` take ``delay`` seconds to read (a cold file, a busy cpu)."""

    def __init__(self, items, slow, delay=0.1):
        super().__init__([bytes(x) for x in items])
        self.slow, self.delay = set(slow), delay

    def __getitem__(self, i):
        if i in self.slow:
            import time

            time.sleep(self.delay)
        return super().__getitem__(i)


def test_batches_come_in_the_passs_order_whichever_worker_ends_first(index_reader):
    """Workers hand back each result as soon as it is made, so a batch held up in one worker is overtaken
    by the other's: the batches still come in the pass's order, each sample once, with the pixels the
    main process alone makes."""
    from dali_fast.loaders.torch_iterator import _PlanSampler

    made_in_order = []
    reader = SlowReader(index_reader.items, slow=range(0, 37, 6))
    ref = TorchIterator(reader, 4, image_size=16, num_workers=0, device="cpu", seed=2)
    fast = TorchIterator(reader, 4, image_size=16, num_workers=2, device="cpu", seed=2)
    try:
        for epoch in range(2):
            ref.set_epoch(epoch)
            fast.set_epoch(epoch)
            want = [(y.clone(), x.clone()) for x, y in ref]
            got = [(y.clone(), x.clone()) for x, y in fast]
            assert [y.tolist() for y, _ in got] == [y.tolist() for y, _ in want]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
            assert sorted(int(i) for y, _ in got for i in y) == list(range(37))
            made_in_order.append(fast._loader.in_order)  # noqa: SLF001
    finally:
        fast.close()
    assert made_in_order == [False, False]  # results came back as they were made
    assert _PlanSampler().idle_when_full is False


def test_parts_are_joined_into_batches_in_the_passs_order():
    """Parts come back in any order (and idle tasks' results among them): each batch is yielded once all
    its parts are in, in the pass's order."""
    from dali_fast.loaders.torch_iterator import _whole_batches
    from dali_fast.loaders.torch_slots import IDLE

    def part(batch, k, parts, offset, n):
        labels = np.arange(offset, offset + n) + 100 * batch
        return {"slot": batch + 10, "batch": batch, "part": k, "parts": parts, "offset": offset, "n": n,
                "labels": labels, "indices": labels + 1000, "boxes": None, "consumed": n, "bad": []}  # fmt: skip

    arrived = [part(1, 0, 1, 0, 4), {"slot": IDLE}, part(2, 1, 2, 2, 2), part(0, 0, 1, 0, 4), part(2, 0, 2, 0, 2)]
    got = list(_whole_batches(iter(arrived)))
    assert [b["slot"] for b in got] == [10, 11, 12]
    assert [b["labels"].tolist() for b in got] == [[0, 1, 2, 3], [100, 101, 102, 103], [200, 201, 202, 203]]
    assert [b["indices"].tolist() for b in got] == [
        [1000, 1001, 1002, 1003],
        [1100, 1101, 1102, 1103],
        [1200, 1201, 1202, 1203],
    ]
    assert got[2]["ranges"] == [(0, 2), (2, 2)] and got[2]["consumed"] == 4


def test_a_full_ring_sends_idle_tasks_not_an_overbooking():
    """DataLoader sends a task for each result it hands over; while every slot holds a batch (batches done
    early wait for an earlier one), the plan answers with idle tasks until a slot is free."""
    from dali_fast.loaders.torch_iterator import _PlanSampler
    from dali_fast.loaders.torch_slots import IDLE, SlotRing

    plan = _PlanSampler()
    plan.keys = [[(i, 0)] for i in range(3)]
    plan.sizes, plan.workers, plan.ring = [1, 1, 1], 2, SlotRing(2, 1, (3, 2, 2), shared=False)
    plan.idle_when_full = True
    tasks = iter(plan)
    first, second = next(tasks), next(tasks)
    assert (first.batch, second.batch) == (0, 1) and {first.slot, second.slot} == {0, 1}
    assert [next(tasks).slot for _ in range(3)] == [IDLE] * 3  # never a third batch in two slots
    plan.ring.give_back(first.slot)
    third = next(tasks)
    assert (third.slot, third.batch) == (first.slot, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_gpu_batches_come_from_page_locked_slots_and_equal_the_cpu_ones(index_reader, memory_format):
    """On a GPU the slots are page-locked and the copy out of them is asynchronous on a side stream; each
    slot is handed to a worker again only after its copy ended, so every batch equals the CPU one."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kw = dict(image_size=16, num_workers=2, seed=1, prefetch=1, memory_format=memory_format)
    cpu, gpu = TorchIterator(index_reader, 3, device="cpu", **kw), TorchIterator(index_reader, 3, device="cuda", **kw)
    for epoch in range(3):
        cpu.set_epoch(epoch)
        gpu.set_epoch(epoch)
        for (xc, yc), (xg, yg) in zip(cpu, gpu, strict=True):
            assert xg.is_cuda and yg.is_cuda and xg.is_contiguous(memory_format=memory_format)
            torch.cuda.synchronize()
            assert torch.equal(yg.cpu(), yc) and torch.allclose(xg.cpu(), xc, atol=1e-5)
        assert gpu._ring._pinned  # noqa: SLF001
    gpu.close()
    cpu.close()


def test_bad_records_in_split_batches_leave_the_rest_exact(index_reader):
    """A batch is split among the workers; bad records in a part leave a gap in the slot that the batch's
    good images are gathered across, in plan order, the same as when one process makes the batch."""
    items = [bytes(x) for x in index_reader.items]
    for i in (0, 3, 4, 20, 36):
        items[i] = items[i][:60]
    reader = IndexReader(items)
    kw = dict(image_size=16, device="cpu", seed=4, on_error="skip")
    one = TorchIterator(reader, 10, num_workers=0, **kw)
    two = TorchIterator(reader, 10, num_workers=2, **kw)
    for epoch in (0, 1):
        one.set_epoch(epoch)
        two.set_epoch(epoch)
        for (x1, y1), (x2, y2) in zip(one, two, strict=True):
            assert torch.equal(y1, y2) and torch.equal(x1, x2)
    assert two.skipped == one.skipped == 10
    two.close()
