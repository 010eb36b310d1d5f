"""The DALI side of the recipe: the operators `augment` builds, checked without a GPU by recording them, and the decoders' memory budgets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spies import record_dali_ops

from dali_fast.transforms import mixed_decoder
from dali_fast.transforms.recipe import Recipe


@pytest.mark.parametrize("threads", [1, 4, 28, 224])
def test_decoder_preallocation_stays_within_its_budget(threads):
    from dali_fast.transforms.mixed_decoder import DECODER_DEVICE_BUDGET, DECODER_PINNED_BUDGET, decoder_preallocation

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
        assert kw["device_memory_padding"] * 224 <= mixed_decoder.DECODER_DEVICE_BUDGET
        assert kw["host_memory_padding"] * 2 * 224 <= mixed_decoder.DECODER_PINNED_BUDGET
    monkeypatch.setattr(mixed_decoder, "cpus_per_local_rank", lambda: 224)
    assert mixed_decoder.default_num_threads(gpu=True) == mixed_decoder.MIXED_MAX_THREADS
    assert mixed_decoder.default_num_threads(gpu=False) == 224


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


def _passthrough_decoders(monkeypatch) -> list[tuple[str, dict]]:
    """DALI's decoders and the operators after them replaced by recorders that hand their input on, so a
    pipeline with a `mixed` decoder builds on a machine without a GPU; returns the recorded (op, kwargs)."""
    import nvidia.dali.fn as fn

    seen: list[tuple[str, dict]] = []

    def record(name):
        def op(data, *args, **kwargs):
            seen.append((name, kwargs))
            return data

        return op

    monkeypatch.setattr(fn.decoders, "image", record("decode"))
    monkeypatch.setattr(fn.decoders, "image_random_crop", record("decode_roi"))
    for name in ("random_resized_crop", "resize", "crop_mirror_normalize"):
        monkeypatch.setattr(fn, name, record(name))
    return seen


def _build_gpu_graph(reader, *, train=True, decode=None, max_batch=64):
    from dali_fast.loaders.bad_records import SkipLog
    from dali_fast.loaders.dali_pipeline import BatchSource, build_pipeline, shutdown_pipeline

    source = BatchSource(reader, [np.arange(min(4, len(reader)))], "raise", SkipLog())
    p = build_pipeline(
        source,
        max_batch=max_batch,
        train=train,
        recipe=Recipe(image_size=32),
        gpu=True,
        device_id=None,  # built without a device: the recorded decoders stand in for `mixed`
        seed=1,
        num_threads=4,
        prefetch=1,
        decode=decode,
    )
    shutdown_pipeline(p)
    return source


def test_the_built_gpu_graph_carries_the_hints_the_load_and_the_affinity_rule(monkeypatch):
    """The pipeline a GPU loader builds: the `mixed` decoder's preallocation hints are the 99th percentile of
    the data set's stored widths and heights (here 4 images in 1,000 are larger, 2 of them in the sample of
    256, and the p99 takes the bulk's sides), its hw_decoder_load the environment's (else ours), and its
    affinity follows the rule."""
    pytest.importorskip("nvidia.dali")
    from builders import IndexReader, jpeg_bytes


    class Packed(IndexReader):
        reads_views = True  # as a packed set: its reads are views, 256 records are sampled

    small, large = jpeg_bytes(120, 90), jpeg_bytes(640, 480)
    reader = Packed([large if i % 250 == 0 else small for i in range(1000)])
    assert mixed_decoder.sample_sizes(reader).count((640, 480)) == 2 and len(mixed_decoder.sample_sizes(reader)) == 256
    seen = _passthrough_decoders(monkeypatch)
    monkeypatch.delenv("DALI_FAST_HW_DECODER_LOAD", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _build_gpu_graph(reader)
    (name, kw), *_ = seen
    assert name == "decode" and kw["device"] == "mixed"
    assert (kw["preallocate_width_hint"], kw["preallocate_height_hint"]) == (120, 90)
    assert kw["hw_decoder_load"] == 0.99 and kw["affine"] is True and kw["jpeg_fancy_upsampling"] is True
    seen.clear()
    reader = IndexReader([large if i % 2 else small for i in range(100)])  # half are large: the p99 is
    monkeypatch.setenv("DALI_FAST_HW_DECODER_LOAD", "0.65")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # remapped devices, on this DALI (>= 1.40): pinned
    _build_gpu_graph(reader, train=False)
    kw = seen[0][1]
    assert (kw["preallocate_width_hint"], kw["preallocate_height_hint"]) == (640, 480)
    assert kw["hw_decoder_load"] == 0.65 and kw["affine"] is True
    seen.clear()
    monkeypatch.setattr("nvidia.dali.__version__", "1.36.0")  # an older DALI reads NVML by CUDA's index
    _build_gpu_graph(reader, decode="roi")
    kw = seen[0][1]
    assert seen[0][0] == "decode_roi" and kw["affine"] is False and "hw_decoder_load" not in kw
    assert kw["preallocate_width_hint"] == 640
    assert mixed_decoder.decoder_affinity("1.36.0") is False and mixed_decoder.decoder_affinity("2.4.0") is True
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the same numbering as NVML's
    assert mixed_decoder.decoder_affinity("1.36.0") is True


def test_preallocation_hints_stay_within_their_budget_and_keep_the_aspect():
    from dali_fast.transforms.mixed_decoder import HW_HINT_BUDGET, preallocation_hints

    assert preallocation_hints([], 256) == (0, 0)  # DALI's "no hint"
    sizes = [(500, 375)] * 99 + [(6000, 4000)]
    assert preallocation_hints(sizes, 256) == (500, 375)  # the p99, not the one giant
    w, h = preallocation_hints([(4000, 3000)] * 10, 256)
    assert 256 * w * h * 3 <= HW_HINT_BUDGET < 256 * (w + 2) * (h + 2) * 3  # as large as the budget allows
    assert abs(w / h - 4 / 3) < 0.01
    assert preallocation_hints([(4000, 3000)], 1) == (4000, 3000)


def test_sizes_are_sampled_from_the_reader_and_never_from_streamed_shards():
    from builders import IndexReader, jpeg_bytes

    from dali_fast.transforms.mixed_decoder import SIZE_SAMPLE_FILES, sample_sizes

    reader = IndexReader([jpeg_bytes(40 + i, 30) for i in range(200)] + [b"not an image"])
    sizes = sample_sizes(reader)
    assert len(sizes) == SIZE_SAMPLE_FILES - 1  # spread over all 201 records; the last, not an image, left out
    assert sizes[0] == (40, 30) and all(h == 30 for _, h in sizes)

    class Streamed(IndexReader):
        streaming, shard_bounds, shuffle_window = True, np.array([0, 201]), 1

        def schedule(self, order, then=None):
            raise AssertionError

        def advance(self, count):
            raise AssertionError

        def __getitem__(self, i):
            raise AssertionError("a streamed shard was read to size the decoder")

    assert sample_sizes(Streamed(reader.items)) == []


def test_the_load_comes_from_the_environment_in_one_line(monkeypatch):
    from builders import one_line

    from dali_fast.transforms.mixed_decoder import HW_DECODER_LOAD, hw_decoder_load

    monkeypatch.delenv("DALI_FAST_HW_DECODER_LOAD", raising=False)
    assert hw_decoder_load() == HW_DECODER_LOAD == 0.99  # today's value, until a GPU run decides
    monkeypatch.setenv("DALI_FAST_HW_DECODER_LOAD", "0.65")
    assert hw_decoder_load() == 0.65 and hw_decoder_load("1") == 1.0
    for bad in ("1.5", "fast"):
        monkeypatch.setenv("DALI_FAST_HW_DECODER_LOAD", bad)
        with pytest.raises(ValueError) as e:
            hw_decoder_load()
        assert one_line(e) == (
            f"DALI_FAST_HW_DECODER_LOAD={bad!r}: use a share from 0 to 1 (0.65 is DALI's default, 0.99 ours)"
        )
