"""DALIIterator's external source: the plan handed out in order, read in batches, each with its boxes; and the
labels' way to the images' device (through page-locked memory)."""

from __future__ import annotations

import numpy as np
import pytest
from loader_cases import bad_reader

from dali_fast.transforms.recipe import Recipe


def test_source_hands_out_the_plan_read_in_batches_with_each_batch_s_boxes():
    """The DALI source without DALI: good records in plan order, bad ones skipped and accounted for (or the
    first named in raise mode), known decoder failures excluded, and erasing boxes drawn for the kept ones."""
    from dali_fast.loaders.bad_records import BadRecordError, SkipLog
    from dali_fast.loaders.dali_pipeline import BatchSource
    from dali_fast.transforms.draws import erasing_boxes

    reader = bad_reader(reversed_labels=True)  # records 2, 5 and 7 are bad; record i has label 9 - i
    recipe = Recipe(image_size=16, random_erasing=0.5)
    plan = [np.array([0, 1, 2]), np.array([5, 7]), np.array([9, 8, 3]), np.array([4, 6])]

    def boxes(indices):
        return erasing_boxes(recipe, 3, 1, indices).astype(np.float32)

    source = BatchSource(reader, plan, "skip", SkipLog(), exclude={8: "breaks the decoder"}, boxes=boxes)
    outputs = []
    with pytest.raises(StopIteration):
        while True:
            outputs.append(source())
    fed = [source.consume() for _ in outputs]
    assert [f.kept for f in fed] == [[0, 1], [9, 3], [4, 6]]
    assert [f.labels.tolist() for f in fed] == [[9, 8], [0, 6], [5, 3]]  # the kept records' own labels
    for out, f in zip(outputs, fed, strict=True):
        datas, rows = out  # the images and their boxes; the labels stay with the source
        assert [bytes(np.asarray(d)) for d in datas] == [bytes(reader.items[i]) for i in f.kept]
        assert f.labels.dtype == np.int64 and rows.dtype == np.float32 and np.array_equal(rows, boxes(np.array(f.kept)))
        assert f.arrays[1] is out  # kept, with the records, until the batch is delivered
    assert [(f.consumed, f.kept, f.batches) for f in fed] == [(3, [0, 1], 1), (5, [9, 3], 2), (2, [4, 6], 1)]
    assert [i for f in fed for i, _ in f.skipped] == [2, 5, 7, 8]
    assert dict(fed[1].skipped)[8] == "breaks the decoder" and source.skips.count == 4
    raising = BatchSource(reader, plan[2:] + plan[:1], "raise", SkipLog())
    first = raising()
    assert type(first).__name__ == "TensorListCPU" and len(first) == 3  # no boxes: the images alone
    assert raising.fed[-1].labels.tolist() == [0, 1, 6]
    raising()
    with pytest.raises(BadRecordError) as e:
        raising()
    assert str(e.value).startswith("record 2 (mem://2.jpg): truncated JPEG")


def test_labels_and_target_rows_reach_a_gpu_through_page_locked_memory(monkeypatch):
    """From pageable memory a ``non_blocking`` copy to the GPU is staged by the host and waits: the rows are
    pinned first, then copied asynchronously (recorded here at torch's boundary; on the CPU, a plain copy)."""
    import torch

    from dali_fast.transforms.batch import to_device

    rows = torch.arange(6, dtype=torch.float32).view(3, 2)
    assert to_device(rows, torch.device("cpu")) is rows
    calls = []

    class Pinned:
        def to(self, device, non_blocking=False):
            calls.append(("to", str(device), non_blocking))
            return "on the GPU"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin", self.tolist())) or Pinned())
    assert to_device(rows, torch.device("cuda", 1)) == "on the GPU"
    assert calls == [("pin", [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]), ("to", "cuda:1", True)]


@pytest.mark.gpu
def test_gpu_rows_reach_the_device_intact_through_pinned_memory():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dali_fast.transforms.batch import to_device

    rows = torch.randn(256, 1000)
    out = to_device(rows, torch.device("cuda"))
    torch.cuda.synchronize()
    assert out.is_cuda and torch.equal(out.cpu(), rows)
