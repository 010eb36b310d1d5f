"""How DALI decodes training images: the whole image on a GPU's JPEG engine then a crop on the GPU, else only
the crop window. The choice (device, engine, override), the GPU graph's decoder arguments caught by recording
DALI's operators (no GPU needed), and on DALI's CPU backend the crop rule's statistics and the pixels of both
ways against each other and against Pillow."""

from __future__ import annotations

import io

import numpy as np
import pytest
from builders import IndexReader, jpeg_bytes, one_line
from PIL import Image
from spies import record_dali_ops

from dali_fast.transforms import mixed_decoder
from dali_fast.transforms.decode_choice import (
    TRAIN_DECODE_ENV,
    choose_train_decode,
    jpeg_engine,
    requested_train_decode,
)
from dali_fast.transforms.mixed_decoder import HW_DECODER_LOAD
from dali_fast.transforms.recipe import Recipe


@pytest.mark.parametrize(
    "gpu, engine, requested, expected",
    [
        (False, None, "auto", "roi"),  # CPU-only mode: libjpeg-turbo decodes only the window's rows and columns
        (True, True, "auto", "whole"),  # the JPEG engine decodes whole images
        (True, False, "auto", "roi"),  # no engine: the CUDA decoder, on the window only
        (True, None, "auto", "whole"),  # NVML cannot tell: the choice whose pixels are Pillow's
        (True, True, "roi", "roi"),
        (True, False, "whole", "whole"),
        (False, None, "whole", "whole"),
    ],
)
def test_training_decode_is_chosen_by_the_device_the_engine_and_the_user(gpu, engine, requested, expected):
    assert choose_train_decode(gpu, engine, requested) == expected


def test_the_override_comes_from_the_argument_or_the_environment_in_one_line(monkeypatch):
    monkeypatch.delenv(TRAIN_DECODE_ENV, raising=False)
    assert requested_train_decode() == "auto" and requested_train_decode("roi") == "roi"
    monkeypatch.setenv(TRAIN_DECODE_ENV, "whole")
    assert requested_train_decode() == "whole" and requested_train_decode("auto") == "auto"  # the argument wins
    monkeypatch.setenv(TRAIN_DECODE_ENV, "fast")
    with pytest.raises(ValueError) as e:
        requested_train_decode()
    assert one_line(e) == (
        "DALI_FAST_TRAIN_DECODE='fast': use 'auto', 'whole' (decode whole images) or 'roi' (the crop window only)"
    )
    with pytest.raises(ValueError, match=r"^train_decode='ROI': use 'auto'"):
        requested_train_decode("ROI")


class _Nvml:
    """NVML at its boundary: device 0 has a JPEG engine, device 1 answers "Not Supported", device 2 errs."""

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetJpgUtilization(self, h):
        if h == 1:
            raise RuntimeError("Not Supported")
        if h == 2:
            raise RuntimeError("Unknown Error")
        return (0, 166666)


def test_the_loader_reads_the_engine_as_doctor_does_and_decides_once(monkeypatch):
    """`jpeg_engine` asks NVML (by the CUDA device's handle) as `doctor` does; a GPU loader decides by it,
    unless told otherwise, and says its choice as ``loader.train_decode``."""
    pytest.importorskip("nvidia.dali")
    import sys

    import dali_fast.loaders.base as base
    import dali_fast.loaders.dali_iterator as dali_iterator
    import dali_fast.transforms.decode_choice as decode_choice
    import dali_fast.transforms.decode_probe as decode_probe
    from dali_fast import DALIIterator

    monkeypatch.setitem(sys.modules, "pynvml", _Nvml())
    monkeypatch.setattr("dali_fast.machine.cuda_device_uuid", lambda i: None)
    jpeg_engine.cache_clear()
    try:
        assert [jpeg_engine(i) for i in (0, 1, 2)] == [True, False, None]
    finally:
        jpeg_engine.cache_clear()
    monkeypatch.delenv(TRAIN_DECODE_ENV, raising=False)
    reader = IndexReader([jpeg_bytes(40, 30)] * 4)
    assert DALIIterator(reader, 2, device="cpu").train_decode == "roi"
    assert DALIIterator(reader, 2, device="cpu", train_decode="whole").train_decode == "whole"
    monkeypatch.setattr(base, "cuda_usable", lambda: True)  # a GPU loader, built but never run here
    monkeypatch.setattr(dali_iterator, "local_device_index", lambda: 1)
    monkeypatch.setattr(decode_probe, "probe_once", lambda i: decode_probe.DecoderProbe(str(i), crop_window="ok"))
    asked = []
    for engine, expected in ((True, "whole"), (False, "roi"), (None, "whole")):
        monkeypatch.setattr(decode_choice, "jpeg_engine", lambda i, e=engine: asked.append(i) or e)
        assert DALIIterator(reader, 2, device="cuda").train_decode == expected
    assert asked == [1, 1, 1]  # the loader's own device
    assert DALIIterator(reader, 2, device="cuda", train_decode="roi").train_decode == "roi" and len(asked) == 3
    monkeypatch.setenv(TRAIN_DECODE_ENV, "roi")
    assert DALIIterator(reader, 2, device="cuda").train_decode == "roi"
    monkeypatch.setenv(TRAIN_DECODE_ENV, "gpu")
    with pytest.raises(ValueError, match="^DALI_FAST_TRAIN_DECODE='gpu': use"):
        DALIIterator(reader, 2, device="cuda")


class _Boxes:
    def __getitem__(self, key):
        return ("boxes", key.start, key.stop)


RECIPES = {
    "default": Recipe(),
    "deit": Recipe(interpolation="bicubic", auto_augment="randaugment", random_erasing=0.25),
    "float16 + erasing": Recipe(dtype=__import__("torch").float16, random_erasing=1.0, scale=(0.25, 1.0)),
    "progressive epoch": Recipe(image_size=192).at_epoch(0),
    "uint8": Recipe(mean=None, std=None, ratio=(0.5, 2.0)),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_gpu_training_decodes_whole_images_on_the_engine_then_crops_by_the_recipe(monkeypatch, name):
    """On a GPU, training decodes the whole image with `mixed` (fancy chroma upsampling, most of the work on
    the hardware JPEG engine, the bounded paddings), then `fn.random_resized_crop` crops and resizes it on the
    GPU by the recipe's rule; evaluation decodes alike. No decoder of a crop window with fancy upsampling runs
    on `mixed` in any graph: nvImageCodec keeps such a window off the JPEG engine."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.types as types

    graph, seen = record_dali_ops(monkeypatch)
    recipe = RECIPES[name]
    S = recipe.image_size
    erase = _Boxes() if recipe.random_erasing else None
    graph.augment("jpegs", train=True, recipe=recipe, gpu=True, num_threads=8, erase=erase)
    (decode_name, decode_args, decode), (crop_name, crop_args, crop) = seen[:2]
    assert (decode_name, decode_args, crop_name, crop_args) == (
        "decode",
        ("jpegs",),
        "random_resized_crop",
        ("decode",),
    )
    assert (
        decode["device"] == "mixed" and decode["jpeg_fancy_upsampling"] is True and decode["output_type"] == types.RGB
    )
    assert decode["hw_decoder_load"] == HW_DECODER_LOAD >= 0.9
    assert decode["device_memory_padding"] * 8 <= mixed_decoder.DECODER_DEVICE_BUDGET
    assert decode["host_memory_padding"] * 2 * 8 <= mixed_decoder.DECODER_PINNED_BUDGET
    assert crop == {
        "size": [S, S],
        "random_area": list(recipe.scale),
        "random_aspect_ratio": list(recipe.ratio),
        "num_attempts": 10,
        "interp_type": getattr(types, graph.DALI_INTERP[recipe.interpolation]),
    }
    assert [n for n, _, _ in seen].count("resize") == 0  # the crop resizes: no second resampling
    for train in (True, False):
        for decode_choice in (None, "auto", "whole", "roi"):
            seen.clear()
            graph.augment(
                "jpegs", train=train, recipe=recipe, gpu=True, num_threads=8, erase=erase, decode=decode_choice
            )
            for op, _, kw in seen:
                assert not (op == "decode_roi" and kw.get("jpeg_fancy_upsampling")), (train, decode_choice)
                if op == "decode":  # every whole-image decode on the GPU: fancy, on the engine
                    assert kw["jpeg_fancy_upsampling"] is True and kw["hw_decoder_load"] == HW_DECODER_LOAD
    seen.clear()
    graph.augment("jpegs", train=True, recipe=recipe, gpu=True, num_threads=8, erase=erase, decode="roi")
    window = seen[0]
    assert window[0] == "decode_roi" and window[2]["device"] == "mixed"
    assert window[2]["random_area"] == list(recipe.scale) and window[2]["num_attempts"] == 10


# ------------------------------------------------------------------ on DALI's CPU backend
W_H = ((200, 150), (250, 60))  # a photo's shape, and one so wide that the crop rule often falls back


def _coordinate_png(w: int, h: int) -> bytes:
    """A PNG whose red channel is the column and green the row: any crop and resize of it tells its window."""
    y, x = np.mgrid[0:h, 0:w]
    buf = io.BytesIO()
    Image.fromarray(np.stack([x, y, np.zeros_like(x)], -1).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _run_graph(datas: list[bytes], recipe: Recipe, decode: str, batches: int, seed: int = 7) -> list[np.ndarray]:
    """``batches`` batches of `augment`'s training output (uint8 HWC) over ``datas``, on DALI's CPU backend."""
    import nvidia.dali.fn as fn
    from nvidia.dali import pipeline_def

    from dali_fast.loaders.dali_pipeline import shutdown_pipeline
    from dali_fast.transforms.dali import augment

    arrays = [np.frombuffer(d, np.uint8) for d in datas]

    @pipeline_def(batch_size=len(arrays), num_threads=2, device_id=None, seed=seed, prefetch_queue_depth=1)
    def pipe():
        jpegs = fn.external_source(source=lambda: arrays, batch=True)
        return augment(jpegs, train=True, recipe=recipe, gpu=False, num_threads=2, layout="HWC", decode=decode)

    p = pipe()
    p.build()
    try:
        return [np.array(out.at(i)) for _ in range(batches) for out in p.run() for i in range(len(arrays))]
    finally:
        shutdown_pipeline(p)


def _window(out: np.ndarray) -> tuple[float, float]:
    """(width, height) of the window a coordinate image was cropped to: the slopes of the column and row
    ramps over the output's inner pixels (a linear filter keeps a ramp a ramp), times the output size."""
    S, m = out.shape[0], 3
    inner = out[m:-m, m:-m].astype(np.float64)
    k = np.arange(m, S - m)
    return np.polyfit(k, inner[:, :, 0].mean(0), 1)[0] * S, np.polyfit(k, inner[:, :, 1].mean(1), 1)[0] * S


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical distributions."""
    grid = np.sort(np.concatenate([a, b]))
    return float(
        np.abs(
            np.searchsorted(np.sort(a), grid, "right") / len(a) - np.searchsorted(np.sort(b), grid, "right") / len(b)
        ).max()
    )


def test_whole_image_decode_draws_crop_windows_by_the_window_decoder_s_rule():
    """Over 2,000 windows each, on DALI's CPU backend, the whole-image path (`decoders.image` then
    `random_resized_crop`) draws windows whose area fractions and aspect ratios are distributed as the crop-
    window decoder's (`decoders.image_random_crop`) for a non-default scale and ratio, fallback included (the
    wide image's window often falls back to its full height at the largest ratio). The windows are read off
    the output of coordinate images; the measure itself is checked on a known window first."""
    pytest.importorskip("nvidia.dali")
    datas = [_coordinate_png(w, h) for w, h in W_H] * 10
    whole = Recipe(image_size=32, mean=None, std=None, hflip=0.0, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    for out in _run_graph(datas[:1], whole, "whole", 1) + _run_graph(datas[:1], whole, "roi", 1):
        assert np.allclose(_window(out), (200, 150), atol=1.0)  # the whole 200 x 150 image
    recipe = Recipe(image_size=32, mean=None, std=None, hflip=0.0, scale=(0.2, 0.9), ratio=(0.6, 1.6))
    stats = {}
    for decode in ("whole", "roi"):
        outs = _run_graph(datas, recipe, decode, 100)  # 20 images x 100 batches
        wh = np.array([_window(o) for o in outs])
        area = wh[:, 0] * wh[:, 1] / np.array([w * h for w, h in W_H] * 10 * 100)
        ratio = wh[:, 0] / wh[:, 1]
        wide = np.arange(len(outs)) % 2 == 1
        fallback = wide & (np.abs(wh[:, 1] - 60) < 1.5) & (np.abs(ratio - 1.6) < 0.05)
        stats[decode] = (area, ratio, fallback.sum() / wide.sum())
    (a1, r1, f1), (a2, r2, f2) = stats["whole"], stats["roi"]
    assert 0.2 - 0.02 < a1.min() and a1.max() < 0.9 + 0.02 and 0.6 - 0.03 < r1.min() and r1.max() < 1.6 + 0.05
    limit = 1.36 * np.sqrt(2 / len(a1))  # the KS test's critical gap at 5 % (the seeds are fixed: no flakes)
    assert _ks(a1, a2) < limit and _ks(r1, r2) < limit, (_ks(a1, a2), _ks(r1, r2), limit)
    assert 0.05 < f2 and abs(f1 - f2) < 4 * np.sqrt(f2 * (1 - f2) / 1000), (f1, f2)  # the fallback, as often


def test_both_decodes_give_pillow_s_pixels_on_the_cpu():
    """With a window that is the whole image, the whole-image path and the crop-window path give the same
    pixels (libjpeg-turbo, fancy upsampling), and both are Pillow's decode resized by Pillow's bilinear
    filter within half a level on average (0.18 measured), on photo-like JPEGs (noise, 4:2:0 chroma)."""
    pytest.importorskip("nvidia.dali")
    datas = [jpeg_bytes(120, 90, color) for color in ((200, 30, 60), (40, 160, 220), (90, 90, 90))]
    recipe = Recipe(image_size=64, mean=None, std=None, hflip=0.0, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    whole = _run_graph(datas, recipe, "whole", 1)
    roi = _run_graph(datas, recipe, "roi", 1)
    for data, a, b in zip(datas, whole, roi, strict=True):
        pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((64, 64), Image.BILINEAR)).astype(int)
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
        for got in (a, b):
            diff = np.abs(got.astype(int) - pillow)
            assert diff.mean() < 0.5 and diff.max() <= 3, (diff.mean(), diff.max())


def test_make_loader_takes_the_decode_choice_for_dali_and_ignores_it_for_torch():
    """``train_decode`` is how DALI decodes: `make_loader` hands it to DALIIterator, and a TorchIterator
    (asked for, or the fallback without DALI) decodes whole images anyway, so it is not refused there."""
    from dali_fast.loaders.factory import make_loader
    from dali_fast.loaders.torch_iterator import TorchIterator

    reader = IndexReader([jpeg_bytes(40, 30)] * 4)
    torch_loader = make_loader(reader, 2, backend="torch", train_decode="whole", device="cpu", num_workers=0)
    assert isinstance(torch_loader, TorchIterator)
    pytest.importorskip("nvidia.dali")
    assert make_loader(reader, 2, backend="dali", train_decode="whole", device="cpu").train_decode == "whole"
