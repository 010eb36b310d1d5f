"""gpu_check's unusual JPEGs without a GPU: the data step's re-encoded share (progressive, 4:4:4, gray, 2-6 MP,
EXIF-rotated, each checked with Pillow), and the odd-JPEG corpus step's verdicts per kind on DALI's CPU
decoder: a bound exceeded, an image refused that should decode, one decoded that should be refused."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu_check"))


def _jpeg(path: Path, w: int = 96, h: int = 72, seed: int = 0) -> bytes:
    px = np.clip(np.random.default_rng(seed).normal(128, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def test_make_odd_re_encodes_a_share_of_the_images_each_its_own_way(tmp_path):
    from gpu_corpus import LARGE_MEGAPIXELS, make_odd

    for k in range(20):
        _jpeg(tmp_path / f"c{k % 2}" / f"{k:03d}.jpg", seed=k)
    assert make_odd(tmp_path, 0.25) == {"progressive": 1, "444": 1, "gray": 1, "large": 1, "exif_rotated": 1}
    files = sorted(tmp_path.rglob("*.jpg"))[::4]
    ims = [Image.open(f) for f in files]
    assert ims[0].info.get("progressive") == 1
    assert ims[1].layer == [(1, 1, 1, 0), (2, 1, 1, 1), (3, 1, 1, 1)]  # 4:4:4
    assert ims[2].mode == "L"
    assert LARGE_MEGAPIXELS[0] * 1e6 <= ims[3].width * ims[3].height <= LARGE_MEGAPIXELS[1] * 1e6
    assert ims[4].getexif()[0x0112] == 6 and ims[4].size == (72, 96)  # stored turned; shown 96 x 72
    untouched = sorted(tmp_path.rglob("*.jpg"))[1]
    assert Image.open(untouched).layer == [(1, 2, 2, 0), (2, 1, 1, 1), (3, 1, 1, 1)]  # 4:2:0, as made
    assert make_odd(tmp_path, 0) == dict.fromkeys(("progressive", "444", "gray", "large", "exif_rotated"), 0)


def _corpus(tmp_path: Path, entries: list[dict]) -> Path:
    corpus = tmp_path / "odd"
    good = _jpeg(corpus / "good.jpg")
    (corpus / "cut.jpg").write_bytes(good[:300])
    (corpus / "manifest.json").write_text(json.dumps(entries))
    return corpus


def _run(corpus: Path, monkeypatch=None, shift: int = 0) -> tuple[dict, list[str]]:
    import gpu_corpus

    if shift:
        real = gpu_corpus.decode_one
        monkeypatch.setattr(
            gpu_corpus, "decode_one", lambda *a: np.clip(real(*a).astype(int) + shift, 0, 255).astype(np.uint8)
        )
    figures, failed = {}, []
    gpu_corpus.corpus_step(corpus, False, None, figures.__setitem__, failed)
    return figures, failed


def test_each_kind_is_held_to_its_bound_and_its_expectation(tmp_path, monkeypatch):
    pytest.importorskip("nvidia.dali")
    entry = {"made_by": "test", "max_levels": None}
    corpus = _corpus(
        tmp_path,
        [
            {**entry, "file": "good.jpg", "kind": "baseline", "expect": "decode", "max_levels": 2},
            {**entry, "file": "cut.jpg", "kind": "truncated", "expect": "refuse"},
        ],
    )
    figures, failed = _run(corpus)
    assert failed == [] and figures["odd.baseline.ok"] == figures["odd.truncated.ok"] == "yes"
    assert figures["odd.baseline.max_levels"] <= 2 and figures["odd.decoder"] == "cpu (no GPU)"
    figures, failed = _run(corpus, monkeypatch, shift=5)  # a decoder 5 levels off Pillow everywhere
    assert figures["odd.baseline.ok"] == "NO: good.jpg is 5 levels from Pillow's (bound 2)"
    assert failed == ["odd JPEGs of kind baseline: good.jpg is 5 levels from Pillow's (bound 2)"]
    wrong = _corpus(
        tmp_path / "b",
        [
            {**entry, "file": "good.jpg", "kind": "should_refuse", "expect": "refuse"},
            {**entry, "file": "cut.jpg", "kind": "should_decode", "expect": "decode"},
        ],
    )
    figures, failed = _run(wrong)
    assert figures["odd.should_refuse.ok"] == "NO: good.jpg decoded ((72, 96, 3)) where it should be refused"
    assert figures["odd.should_decode.ok"].startswith("NO: cut.jpg was refused: ")
    assert len(failed) == 2


def test_a_missing_corpus_or_a_bad_manifest_is_one_line(tmp_path):
    from gpu_corpus import read_manifest

    with pytest.raises(FileNotFoundError, match=r"^no odd-JPEG corpus at .* \(no manifest.json\): pass --corpus"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps([{"file": "nope.jpg", "expect": "decode"}]))
    with pytest.raises(ValueError, match="needs an existing 'file' and 'expect' of 'decode' or 'refuse'"):
        read_manifest(tmp_path)
