"""Every backend's arguments: the documented defaults, each refusal in one exact line, the smallest valid
values, the device it chooses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import IndexReader, first_batch, jpeg_bytes
from loader_cases import epoch_labels


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


def test_tests_that_leave_the_device_to_the_loader_assume_no_cpu():
    """The suite runs on GPU hosts too (gpu_check/gpu_check.sh --full): a loader built without a device
    takes the GPU there, so a test that builds one must not assert CPU output or a CPU loader."""
    import ast
    import re
    from pathlib import Path

    loaders = {"TorchIterator", "DALIIterator", "make_loader", "cls"}
    claims = re.compile(r'\.gpu is False|device(\.type)? == "cpu"|is_cuda is False|not [\w.\[\]]+\.is_cuda')
    tests = Path(__file__).resolve().parents[1]
    paths = sorted(tests.rglob("test_*.py"))
    assert {"loaders", "data", "remote", "transforms", "train", "tools"} <= {p.parent.name for p in paths}  # every wing
    offenders = []
    for path in paths:
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
                offenders.append(f"{path.relative_to(tests)}::{fn.name}")
    assert offenders == []
