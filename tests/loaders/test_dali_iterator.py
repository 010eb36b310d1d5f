"""DALIIterator specifics (the shared contract runs in the test_base_*.py files for both backends): its
pipeline kept between epochs, and what its failures say."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import odd_images
import pytest
import torch
from builders import IndexReader, jpeg_bytes
from fakes import ScriptedController
from loader_cases import epoch_labels, loader_class

from dali_fast.transforms.recipe import IMAGENET_STD, Recipe


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
    from dali_fast.loaders.dali_iterator import is_memory_error

    assert is_memory_error(dali_error(text))
    assert is_memory_error(
        RuntimeError(f"Critical error in pipeline:\n{text}\nCurrent pipeline object is no longer valid.")
    )


@pytest.mark.parametrize("text", DALI_OTHER_TEXTS)
def test_other_dali_failures_are_not_memory_errors(text):
    pytest.importorskip("nvidia.dali")
    from dali_fast.loaders.dali_iterator import is_memory_error

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
    from dali_fast.loaders.dali_iterator import dali_message, parse_dali_error

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
    import dali_fast.loaders.dali_iterator as dali_iterator

    def undecodable(*_a, **_k):
        raise AssertionError("the records were re-decoded with Pillow: DALI's failure was blamed on the data")

    monkeypatch.setattr(dali_iterator, "undecodable", undecodable)


def test_dali_cuda_allocation_failure_is_memory_never_a_bad_record(index_reader, monkeypatch):
    """DALI's real out-of-memory text ("CUDA allocation failed", from the `mixed` decoder) raises
    DALIMemoryError and tells the controller; no record is blamed or re-decoded."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    from dali_fast import DALIIterator
    from dali_fast.loaders.dali_iterator import DALIMemoryError

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
    import dali_fast.loaders.dali_iterator as dali_iterator
    from dali_fast import DALIIterator
    from dali_fast.loaders.dali_iterator import DALIMemoryError

    def build_fails(*_a, **_k):
        raise RuntimeError(
            "Critical error when building pipeline:\nError in MIXED operator `nvidia.dali.fn.decoders.image`,\n"
            'which was used in the pipeline definition with the following traceback:\n\n  File "x.py", line 1\n\n'
            "encountered:\n\nCan't allocate 211025920 bytes on device 0.\nCurrent pipeline object is no longer valid."
        )

    monkeypatch.setattr(dali_iterator, "build_pipeline", build_fails)
    with pytest.raises(DALIMemoryError, match="Can't allocate 211025920 bytes on device 0"):
        epoch_labels(DALIIterator(index_reader, 8, image_size=16, device="cpu", num_threads=2), 0)


def test_a_failing_operator_other_than_the_decoder_is_named_not_blamed_on_records(index_reader, monkeypatch):
    """A real DALI failure in `fn.erase` (malformed boxes): DALI's message with the operator named, no
    record accused, no Pillow re-decode."""
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator
    from dali_fast.loaders.dali_iterator import DALIOperatorError

    _no_pillow_recheck(monkeypatch)
    monkeypatch.setattr(
        DALIIterator, "_boxes", lambda self: lambda idx: np.zeros((len(idx), 2), np.float32)
    )  # no shape part
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
    from dali_fast.loaders.dali_iterator import DALIMemoryError

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

    from dali_fast.machine import nvml_handle
    from dali_fast.transforms.mixed_decoder import DECODER_DEVICE_BUDGET

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
    import dali_fast.loaders.dali_iterator as dali_iterator
    from dali_fast import BatchSizeController

    calls = []
    real_shutdown = dali_iterator.shutdown_pipeline

    def shutdown(pipe):
        calls.append("shutdown")
        real_shutdown(pipe)

    class Probe:
        def reset_peak(self):
            calls.append("reset")

        def peak_fraction(self):
            return 0.1

    monkeypatch.setattr(dali_iterator, "shutdown_pipeline", shutdown)
    ctrl = BatchSizeController(8, 64, probe=Probe(), release=lambda: calls.append("release"), sync_ranks=False)
    loader = cls(index_reader, 8, image_size=16, device="cpu", num_threads=2, controller=ctrl)
    assert sorted(epoch_labels(loader, 0)[0]) == list(range(37))
    assert ctrl.batch_size == 16 and calls == ["release", "reset"]  # the kept pipeline is still up
    calls.clear()
    assert sorted(epoch_labels(loader, 1)[0]) == list(range(37))
    assert calls == ["shutdown", "release", "reset"]
    loader.close()


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_dali_finds_a_packed_record_damaged_inside_after_packing_by_decoding(on_error, tmp_path):
    """Read time checks a packed record's ends only (pack walked its headers): damage in between reaches
    DALI, and the failed batch's records are then checked one by one, which names it."""
    from builders import make_folder

    from dali_fast.data.format import DATA_FILE
    from dali_fast.data.pack.packed import pack
    from dali_fast.data.packed import MemmapReader

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

    from builders import make_folder

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


POOL_SETTINGS = ("DALI_MALLOC_POOL_THRESHOLD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")


def test_dali_pools_the_host_buffers_of_2_mib_and_more_unless_the_user_chose(monkeypatch):
    """Host buffers from 2 MiB come from DALI's pool (malloc's moving threshold made the training process's
    RSS step by hundreds of MiB over 30 epochs); a setting of the user's, DALI's or malloc's, is kept."""
    cls = loader_class("dali")
    for name in POOL_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    cls(IndexReader([jpeg_bytes(8, 8)]), 1, device="cpu")
    assert os.environ["DALI_MALLOC_POOL_THRESHOLD"] == "2M"
    monkeypatch.setenv("DALI_MALLOC_POOL_THRESHOLD", "8M")
    cls(IndexReader([jpeg_bytes(8, 8)]), 1, device="cpu")
    assert os.environ["DALI_MALLOC_POOL_THRESHOLD"] == "8M"
    monkeypatch.delenv("DALI_MALLOC_POOL_THRESHOLD")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")  # DALI derives its threshold from it
    cls(IndexReader([jpeg_bytes(8, 8)]), 1, device="cpu")
    assert "DALI_MALLOC_POOL_THRESHOLD" not in os.environ


def test_dali_reads_the_pool_setting_after_the_iterator_is_made(tmp_path):
    """The setting is made early enough: in a fresh process DALI reads it at the first pipeline, after
    DALIIterator() (a value DALI refuses, put in between, is what the first epoch fails on)."""
    pytest.importorskip("nvidia.dali")
    from dali_fast import make_synthetic

    root = make_synthetic(tmp_path / "data", images=4, classes=2, progress=False)
    code = (
        "import os\n"
        "from dali_fast import DALIIterator, open_dataset\n"
        f"loader = DALIIterator(open_dataset({str(root)!r}), 2, device='cpu')\n"
        "print(os.environ['DALI_MALLOC_POOL_THRESHOLD'])\n"
        "os.environ['DALI_MALLOC_POOL_THRESHOLD'] = 'x'\n"
        "try:\n"
        "    next(iter(loader))\n"
        "except Exception as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in POOL_SETTINGS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "2M"
    assert "DALI_MALLOC_POOL_THRESHOLD must be a number" in lines[-1]
