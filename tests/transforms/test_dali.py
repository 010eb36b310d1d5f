"""The DALI side of the recipe: the operators `augment` builds, checked without a GPU by recording them, and the decoders' memory budgets."""

from __future__ import annotations

import pytest
import torch
from spies import record_dali_ops

from dali_fast.transforms.recipe import Recipe


@pytest.mark.parametrize("threads", [1, 4, 28, 224])
def test_decoder_preallocation_stays_within_its_budget(threads):
    from dali_fast.transforms.dali import DECODER_DEVICE_BUDGET, DECODER_PINNED_BUDGET, decoder_preallocation

    pre = decoder_preallocation(threads)
    assert 0 < pre["device_total"] <= DECODER_DEVICE_BUDGET and 0 < pre["pinned_total"] <= DECODER_PINNED_BUDGET
    assert pre["device_total"] == pre["device_padding"] * threads
    assert pre["pinned_total"] == 2 * pre["host_padding"] * threads  # two pinned buffers per thread
    assert decoder_preallocation(threads, gpu=False)["device_total"] == 0


def test_gpu_pipeline_augments_decoded_gpu_images_and_erases_with_cpu_boxes(monkeypatch):
    """The recipe's operators in GPU mode, without a GPU: automatic augmentation takes the GPU's crop of the
    `mixed` decoder's output, the erasing boxes stay CPU argument inputs (DALI refuses GPU ones), and the
    flip probability, crop scale/ratio, interpolation, eval resize and normalization are the recipe's."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.types as types

    graph, calls = record_dali_ops(
        monkeypatch, auto_augment=lambda images, recipe: ("augmented", images, recipe.auto_augment)
    )
    seen = Seen(calls)

    recipe = Recipe(
        image_size=160,
        scale=(0.35, 1.0),
        ratio=(0.5, 2.0),
        interpolation="bicubic",
        hflip=0.25,
        auto_augment="trivialaugment",
        random_erasing=0.5,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
    )
    out = graph.augment("jpegs", train=True, recipe=recipe, gpu=True, num_threads=4, erase=_Boxes())
    assert out == "erase" and "decode_roi" not in seen and "resize" not in seen
    assert seen["decode"][1]["device"] == "mixed"
    crop_args, crop = seen["random_resized_crop"]
    assert crop_args == ("decode",) and crop["size"] == [160, 160]
    assert crop["random_area"] == [0.35, 1.0] and crop["random_aspect_ratio"] == [0.5, 2.0]
    assert crop["interp_type"] == types.INTERP_CUBIC
    assert seen["flip"][1] == {"probability": 0.25}
    cmn_args, cmn = seen["crop_mirror_normalize"]
    assert cmn_args[0] == ("augmented", "random_resized_crop", "trivialaugment")  # augmentation on the GPU's crop
    assert cmn["mean"] == [127.5] * 3 and cmn["std"] == [63.75] * 3 and cmn["mirror"] == "flip"
    assert seen["erase"][0] == ("crop_mirror_normalize",)
    assert seen["erase"][1]["anchor"] == ("boxes", 0, 2) and seen["erase"][1]["shape"] == ("boxes", 2, 4)
    calls.clear()
    graph.augment("jpegs", train=True, recipe=recipe, gpu=True, num_threads=4, erase=_Boxes(), decode="roi")
    assert seen["decode_roi"][1]["device"] == "mixed" and "random_resized_crop" not in seen
    roi = seen["decode_roi"][1]
    assert roi["random_area"] == [0.35, 1.0] and roi["random_aspect_ratio"] == [0.5, 2.0]
    assert seen["resize"][1]["interp_type"] == types.INTERP_CUBIC and seen["resize"][1]["resize_x"] == 160
    assert seen["crop_mirror_normalize"][0][0] == ("augmented", "resize", "trivialaugment")
    calls.clear()
    plain = Recipe(image_size=160, eval_resize_size=192, mean=None, std=None, hflip=0.0)
    graph.augment("jpegs", train=False, recipe=plain, gpu=True, num_threads=4)
    assert seen["resize"][1]["resize_shorter"] == 192 and "erase" not in seen and "flip" not in seen
    assert seen["crop_mirror_normalize"][1]["dtype"] == types.UINT8 and "mean" not in seen["crop_mirror_normalize"][1]


def test_gpu_pipeline_passes_the_bounded_paddings_and_caps_threads(monkeypatch):
    pytest.importorskip("nvidia.dali")
    graph, calls = record_dali_ops(monkeypatch)
    seen = Seen(calls)
    for decode, op in (("whole", "decode"), ("roi", "decode_roi")):
        graph.augment("jpegs", train=True, recipe=Recipe(), gpu=True, num_threads=224, decode=decode)
        kw = seen[op][1]
        assert kw["device"] == "mixed"
        assert kw["device_memory_padding"] * 224 <= graph.DECODER_DEVICE_BUDGET
        assert kw["host_memory_padding"] * 2 * 224 <= graph.DECODER_PINNED_BUDGET
    monkeypatch.setattr(graph, "cpus_per_local_rank", lambda: 224)
    assert graph.default_num_threads(gpu=True) == graph.MIXED_MAX_THREADS
    assert graph.default_num_threads(gpu=False) == 224


class Seen:
    """The last call of each operator by name: ``seen[name]`` is its (args, kwargs)."""

    def __init__(self, calls) -> None:
        self.calls = calls

    def __getitem__(self, name: str) -> tuple[tuple, dict]:
        return self.calls.last(name)

    def __contains__(self, name: str) -> bool:
        return name in self.calls.names()


class _Boxes:
    def __getitem__(self, key):
        return ("boxes", key.start, key.stop)

    def gpu(self):
        raise AssertionError("erasing boxes moved to the GPU")


def test_gpu_decoders_upsample_chroma_like_the_cpu_decoder(monkeypatch):
    """The `mixed` decoder's default chroma upsampling is not libjpeg-turbo's "fancy" one, which DALI's CPU
    decoder, Pillow and TorchIterator use: training on a GPU would see other pixels than on a CPU. Whole
    images (training's default on a GPU, and evaluation) decode with fancy upsampling."""
    pytest.importorskip("nvidia.dali")
    graph, seen = record_dali_ops(monkeypatch)
    for train in (True, False):
        seen.clear()
        graph.augment("jpegs", train=train, recipe=Recipe(), gpu=True, num_threads=4)
        decode = seen[0]
        assert decode[0] == "decode" and decode[2]["device"] == "mixed"
        assert decode[2]["jpeg_fancy_upsampling"] is True
        seen.clear()
        graph.augment("jpegs", train=train, recipe=Recipe(), gpu=False, num_threads=4)
        assert seen[0][2]["device"] == "cpu" and "jpeg_fancy_upsampling" not in seen[0][2]  # the CPU decoder's own


def test_gpu_float16_with_erasing_erases_in_float32_then_casts(monkeypatch):
    """DALI 2.4's GPU `erase` has no float16 kernel (ERASE_SUPPORTED_TYPES of erase.cu; the CPU one has):
    on the GPU the image is normalized to float32, erased, then cast to float16."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.types as types

    graph, seen = record_dali_ops(monkeypatch)
    recipe = Recipe(dtype=torch.float16, random_erasing=0.5)
    out = graph.augment("jpegs", train=True, recipe=recipe, gpu=True, num_threads=4, erase=_Boxes())
    names = [name for name, _, _ in seen]
    assert names[-3:] == ["crop_mirror_normalize", "erase", "cast"] and out == "cast"
    assert seen[-3][2]["dtype"] == types.FLOAT and seen[-1][2] == {"dtype": types.FLOAT16}
    assert seen[-1][1] == ("erase",)
    for gpu, erase in ((False, _Boxes()), (True, None)):  # the CPU erase has float16; no erase: no cast
        seen.clear()
        out = graph.augment("jpegs", train=True, recipe=recipe, gpu=gpu, num_threads=4, erase=erase)
        assert "cast" not in [name for name, _, _ in seen]
        assert [kw for name, _, kw in seen if name == "crop_mirror_normalize"][0]["dtype"] == types.FLOAT16


def test_randaugment_builds_without_dali_origin_traces_and_leaves_them_on(monkeypatch):
    """auto_aug makes ``num_ops x 14`` operators inside DALI's own code; DALI would walk the Python stack for
    each (its operator-origin traces), most of a RandAugment build. They are off while auto_aug builds (a
    count of stack walks, not a timing: see benchmarks/randaugment_build.py for the time), and on after."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali._utils import dali_trace

    from dali_fast.loaders.dali_pipeline import build_pipeline

    walks = []
    real = dali_trace.extract_stack
    monkeypatch.setattr(dali_trace, "extract_stack", lambda *a, **k: walks.append(1) or real(*a, **k))

    class NoSource:
        boxes = None

        def __call__(self):  # a build does not read
            raise AssertionError

    def build(recipe):
        walks.clear()
        build_pipeline(
            NoSource(),
            max_batch=4,
            train=True,
            recipe=recipe,
            gpu=False,
            device_id=None,
            seed=1,
            num_threads=1,
            prefetch=1,
        )
        return len(walks)

    plain = build(Recipe(image_size=32))
    assert plain > 0  # the operators of the recipe itself keep their origin (errors name the user's line)
    assert build(Recipe(image_size=32, auto_augment="randaugment", num_ops=4)) == plain  # was 1,183 more
    assert dali_trace.is_tracing_enabled()
