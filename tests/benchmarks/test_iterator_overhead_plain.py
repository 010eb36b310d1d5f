"""benchmarks/iterator_overhead.py's reference row (p), run small on the CPU: the pipeline a DALI user would
write (DALI's own operators with their defaults, none of this project's graph), over every image once."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
from builders import jpeg_bytes, make_folder

ROOT = Path(__file__).resolve().parents[2]


def test_the_plain_row_is_the_pipeline_a_dali_user_writes(tmp_path, monkeypatch):
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn as fn

    spec = importlib.util.spec_from_file_location("iterator_overhead", ROOT / "benchmarks" / "iterator_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert list(bench.ROWS)[0] == "p"
    ops = []

    def spy(module, name):
        real = getattr(module, name)

        def op(*args, **kwargs):
            ops.append((name, {k: v for k, v in kwargs.items() if k not in ("name",)}))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, op)

    for name in ("resize", "crop_mirror_normalize"):
        spy(fn, name)
    spy(fn.readers, "file")
    spy(fn.decoders, "image_random_crop")
    monkeypatch.setattr(bench, "augment", lambda *a, **k: pytest.fail("the plain row ran this project's graph"))
    root = make_folder(tmp_path / "imgs", {"a": [jpeg_bytes(40, 30)] * 5, "b": [jpeg_bytes(30, 40)] * 4})
    args = argparse.Namespace(batch_size=4, image_size=16, epochs=1)
    epoch = bench.plain_epochs(root, args, 2)
    assert epoch() == 9 and epoch() == 9  # every image once per epoch, the partial last batch included
    names = [name for name, _ in ops]
    assert names == ["file", "image_random_crop", "resize", "crop_mirror_normalize"]
    kw = dict(ops)
    assert kw["image_random_crop"]["device"] == "cpu" and "random_area" not in kw["image_random_crop"]  # DALI's rule
    assert kw["resize"] == {"resize_x": 16, "resize_y": 16}  # DALI's default filter
    assert kw["crop_mirror_normalize"]["crop"] == (16, 16) and len(kw["crop_mirror_normalize"]["mean"]) == 3
