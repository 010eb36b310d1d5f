import io

import numpy as np
from PIL import Image

from dali_fast.data.synthetic import make_synthetic


def test_deterministic_and_imagefolder_shaped(tmp_path):
    a = make_synthetic(tmp_path / "a", images=12, classes=3, seed=5, progress=False)
    b = make_synthetic(tmp_path / "b", images=12, classes=3, seed=5, progress=False)
    c = make_synthetic(tmp_path / "c", images=12, classes=3, seed=6, progress=False)
    fa = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(fa) == 12 and sorted(d.name for d in a.iterdir()) == ["class_0", "class_1", "class_2"]
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in fa)
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in fa)
    sizes = [Image.open(io.BytesIO((a / f).read_bytes())).size for f in fa]
    areas = np.array([w * h for w, h in sizes])
    assert 100_000 < areas.mean() < 300_000  # ImageNet-like, around 500x375
    assert len(set(sizes)) > 6  # varied aspect ratios
    assert all(Image.open(a / f).mode == "RGB" for f in fa)


def test_classes_differ_in_colour(tmp_path):
    root = make_synthetic(tmp_path / "s", images=20, classes=2, seed=0, progress=False)
    means = {}
    for cls in ("class_0", "class_1"):
        arrs = [np.asarray(Image.open(p), np.float32).mean(axis=(0, 1)) for p in (root / cls).glob("*.jpg")]
        means[cls] = np.mean(arrs, axis=0)
    assert np.abs(means["class_0"] - means["class_1"]).max() > 20


def test_default_dataset_made_once_when_ranks_race(tmp_path):
    """Under torchrun all ranks ask for the synthetic set at once: one makes it, the others wait."""
    import os
    import subprocess
    import sys

    code = (
        "from dali_fast.data.synthetic import default_dataset; from dali_fast.data.open import open_dataset;"
        "f, p = default_dataset(24, classes=3, progress=False); print(p, len(open_dataset(p)))"
    )
    env = {**os.environ, "DALI_FAST_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    assert {o.strip() for o, _ in outs} == {f"{tmp_path / 'synthetic-24x3' / 'packed'} 24"}
