"""TorchIterator's worker side: a batch decoded and written into its slot in place, its bad records
listed, the reader's own batch read."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from builders import IndexReader, jpeg_bytes

from dali_fast.loaders.torch_slots import SlotRing, Task, image_shape
from dali_fast.loaders.torch_worker import BatchMaker
from dali_fast.transforms.draws import SampleDraws, crop_draws
from dali_fast.transforms.recipe import Recipe
from dali_fast.transforms.resize import decode_crop


def maker(reader, layout="CHW", train=True, recipe=None, capacity=8, slots=2):
    recipe = recipe or Recipe(image_size=16)
    ring = SlotRing(slots, capacity, image_shape(layout, recipe.image_size), shared=False)
    return BatchMaker(reader, train, recipe, 5, ring.buffer, layout), ring


def test_a_batch_is_written_into_its_slot_with_bad_records_listed_not_raised():
    items = [jpeg_bytes(40 + i, 30, (20 * i, 100, 200)) for i in range(6)]
    items[2] = items[2][:100]  # truncated: fails the structural check
    reader = IndexReader(items)
    m, ring = maker(reader)
    before = ring.buffer[0].clone()
    out = m.make(Task(1, [(i, 0) for i in range(6)]))
    assert out["slot"] == 1 and out["n"] == 5 and out["consumed"] == 6
    assert out["labels"].tolist() == [0, 1, 3, 4, 5] and out["boxes"] is None
    assert [i for i, _ in out["bad"]] == [2] and "mem://2.jpg" not in out["bad"][0][1]  # the reason only
    assert torch.equal(ring.buffer[0], before)  # only the task's slot is written
    assert (ring.buffer[1, :5].float().mean((1, 2, 3)) > 20).all()  # good samples packed at the front
    # each image is exactly what decode_crop draws for its (seed, epoch, index), mirrored as drawn
    for k, i in enumerate([0, 1, 3, 4, 5]):
        rng = SampleDraws(crop_draws(5, 0, [i])[0])
        img = decode_crop(items[i], train=True, recipe=m.recipe, rng=rng)
        if rng.random() < m.recipe.hflip:
            img = img.flip(1)
        assert torch.equal(ring.buffer[1, k], img.permute(2, 0, 1))


def test_both_layouts_hold_the_same_pixels(index_reader):
    keys = [(i, 3) for i in range(8)]
    chw, ring_chw = maker(index_reader, "CHW")
    hwc, ring_hwc = maker(index_reader, "HWC")
    chw.make(Task(0, keys))
    hwc.make(Task(0, keys))
    assert torch.equal(ring_chw.buffer[0], ring_hwc.buffer[0].permute(0, 3, 1, 2))


def test_erasing_boxes_and_policies_come_back_per_sample(index_reader):
    from dali_fast.transforms.draws import sample_erasing_box

    recipe = Recipe(image_size=16, random_erasing=1.0, auto_augment="trivialaugment")
    m, ring = maker(index_reader, recipe=recipe)
    out = m.make(Task(0, [(i, 2) for i in range(8)]))
    assert out["boxes"].tolist() == [list(sample_erasing_box(recipe, 5, 2, i)) for i in range(8)]
    plain, plain_ring = maker(index_reader, recipe=Recipe(image_size=16))
    plain.make(Task(0, [(i, 2) for i in range(8)]))
    assert not torch.equal(ring.buffer[0], plain_ring.buffer[0])  # the policy changed pixels


_HEAP_PROBE = """
import ctypes
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SETUP
libc.free(libc.malloc(16 << 20))  # glibc's own rule: its mmap threshold rises to 16 MiB after this free
before = libc.mallinfo2().hblkhd
p = libc.malloc(6 << 20)
print("mapped" if libc.mallinfo2().hblkhd - before >= 6 << 20 else "heap")
"""


def large_allocation_after_free(setup: str = "") -> str:
    """In a fresh interpreter (malloc's settings are per process): ``setup``, then free 16 MiB and allocate
    6 MiB; "mapped" when the 6 MiB got a mapping of its own, "heap" when it was carved from the heap."""
    import subprocess
    import sys

    code = _HEAP_PROBE.replace("SETUP", setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_tame_malloc_keeps_large_buffers_mapped_after_a_larger_free():
    """glibc alone raises its mmap threshold after a large free, so the next large buffer comes from the
    heap (which then fragments: a decode worker's resident set steps up); `tame_malloc` keeps it mapped."""
    assert large_allocation_after_free() == "heap"
    tamed = "from dali_fast.loaders.torch_worker import tame_malloc\nassert tame_malloc()"
    assert large_allocation_after_free(tamed) == "mapped"


def test_tame_malloc_says_false_off_glibc(monkeypatch):
    import dali_fast.loaders.torch_worker as worker

    monkeypatch.setattr(worker.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert worker.tame_malloc() is False


class BatchReadCounter(IndexReader):
    """An `IndexReader` that reads whole batches, and counts how it was read."""

    def __init__(self, items):
        super().__init__(items)
        self.batches, self.singles = 0, 0

    def __getitem__(self, i):
        self.singles += 1
        return super().__getitem__(i)

    def read_batch_checked(self, indices):
        from dali_fast.data.checks import check_encoded

        self.batches += 1
        datas = [self.items[i] for i in indices]
        return (
            datas,
            np.asarray(indices, dtype=np.int64),
            {p: r for p, d in enumerate(datas) if (r := check_encoded(d))},
        )


def test_a_worker_reads_its_part_in_one_batch_read():
    """The reader's own batch read (a packed set's O(1) checks for all records at once, a folder's parallel
    reads) serves a part, not one read per record."""
    items = [jpeg_bytes(40 + i, 30, (20 * i, 100, 200)) for i in range(6)]
    items[4] = items[4][:100]
    reader = BatchReadCounter(items)
    m, ring = maker(reader)
    out = m.make(Task(0, [(i, 0) for i in range(6)]))
    assert (reader.batches, reader.singles) == (1, 0)
    assert out["labels"].tolist() == [0, 1, 2, 3, 5] and [i for i, _ in out["bad"]] == [4]
