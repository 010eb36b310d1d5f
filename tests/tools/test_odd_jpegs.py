"""The odd-JPEG corpus (tests/fixtures/odd_jpegs, made by scripts/odd_jpegs.py) through both loaders on the CPU
and ``inspect --verify``: every kind is decoded within its stated levels of Pillow's pixels, or skipped or
refused, named and counted; never delivered wrong. The GPU check reads the same manifest."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from dali_fast.data.open import open_dataset
from dali_fast.loaders.factory import make_loader
from dali_fast.tools.inspect import inspect_dataset
from dali_fast.transforms.recipe import Recipe

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "odd_jpegs"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())
SIZE = 64  # every file's side: an evaluation crop of fraction 1 at this size is the whole image
KINDS = (
    ["progressive", "restart markers", "grayscale", "CMYK", "YCCK", "ICC profile", "arithmetic coding", "truncated"]
    + [f"{s} sampling" for s in ("4:4:4", "4:2:2", "4:2:0", "4:4:0", "4:1:1")]
    + [f"EXIF orientation {k}" for k in range(2, 9)]
)


def pillow_pixels(path: Path) -> np.ndarray:
    """Pillow's pixels by the shared rule: EXIF orientation applied, then RGB."""
    with Image.open(path) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB")).astype(int)


def corpus_folder(root: Path) -> Path:
    """The corpus as an ImageFolder, a class per file (the class name is the file's stem)."""
    for entry in MANIFEST:
        (root / Path(entry["file"]).stem).mkdir(parents=True)
        shutil.copy(CORPUS / entry["file"], root / Path(entry["file"]).stem / entry["file"])
    return root


def test_the_manifest_lists_every_kind_in_the_shape_the_gpu_check_reads():
    assert [sorted(e) for e in MANIFEST] == [["expect", "file", "kind", "made_by", "max_levels"]] * len(MANIFEST)
    assert sorted(e["kind"] for e in MANIFEST if e["kind"] != "baseline") == sorted(KINDS)
    for e in MANIFEST:
        assert (CORPUS / e["file"]).stat().st_size < 8192 and e["made_by"]
        assert (e["expect"], type(e["max_levels"])) in (("decode", int), ("refuse", type(None)))
    with pytest.raises(OSError):  # the truncated file is one Pillow itself refuses
        pillow_pixels(CORPUS / "truncated.jpg")
    for e in MANIFEST:  # the rest are what they say: Pillow reads each at 64x64
        if e["expect"] == "decode":
            assert pillow_pixels(CORPUS / e["file"]).shape == (SIZE, SIZE, 3)


def run_loader(backend: str, folder: Path, on_error: str) -> tuple[dict[str, np.ndarray], int]:
    """Every image the loader delivers in evaluation mode (no random crop, uint8, at the image's own size)
    by file name, and how many it skipped."""
    reader = open_dataset(folder)
    recipe = Recipe(image_size=SIZE, eval_crop_fraction=1.0, mean=None, std=None)
    kw = {"num_workers": 1} if backend == "torch" else {"device": "cpu", "num_threads": 1}
    loader = make_loader(
        reader, 8, backend=backend, train=False, image_size=SIZE, recipe=recipe, on_error=on_error, **kw
    )
    got: dict[str, np.ndarray] = {}
    try:
        for images, labels in loader:
            for image, label in zip(images, labels.tolist(), strict=True):
                name = reader.classes[label] + ".jpg"
                assert name not in got
                got[name] = image.permute(1, 2, 0).numpy().astype(int)
        return got, loader.skipped
    finally:
        if hasattr(loader, "close"):
            loader.close()


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_each_kind_is_decoded_within_its_levels_or_skipped_named_and_counted(backend, tmp_path, caplog):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    folder = corpus_folder(tmp_path / "corpus")
    with caplog.at_level(logging.WARNING):
        got, skipped = run_loader(backend, folder, "skip")
    refused = [e["file"] for e in MANIFEST if e["expect"] == "refuse"]
    assert skipped == len(refused) and sorted(set(e["file"] for e in MANIFEST) - set(got)) == refused
    assert all(name in caplog.text for name in refused)  # each skipped record named
    for e in MANIFEST:
        if e["expect"] == "decode":
            diff = np.abs(got[e["file"]] - pillow_pixels(CORPUS / e["file"])).max()
            assert diff <= e["max_levels"], (backend, e["kind"], int(diff))


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_the_truncated_file_stops_a_loader_that_raises_and_names_it(backend, tmp_path):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    folder = corpus_folder(tmp_path / "corpus")
    with pytest.raises((ValueError, RuntimeError), match=r"record 19 \(.*truncated\.jpg\): truncated JPEG"):
        run_loader(backend, folder, "raise")


def test_inspect_verify_names_and_counts_the_refused_file_and_passes_the_rest(tmp_path):
    folder = corpus_folder(tmp_path / "corpus")
    lines: list[str] = []
    assert inspect_dataset(str(folder), verify=True, emit=lines.append, workers=1) == 1
    assert f"verify:   1 bad record of {len(MANIFEST)}; remove or replace them (pack leaves them out)" in lines
    bad = [line for line in lines if line.startswith("bad:")]
    assert len(bad) == 1 and bad[0].endswith("truncated.jpg): truncated JPEG (no end-of-image marker)"), lines


def test_the_script_makes_the_committed_corpus_byte_for_byte(tmp_path):
    """scripts/odd_jpegs.py makes the committed corpus again, byte for byte (where Debian's tools are installed)."""
    import ctypes.util
    import subprocess
    import sys

    if shutil.which("cjpeg") is None or ctypes.util.find_library("turbojpeg") is None:
        pytest.skip("needs Debian's libjpeg-turbo-progs and libturbojpeg0 (apt-get install)")
    subprocess.run([sys.executable, str(CORPUS.parents[2] / "scripts" / "odd_jpegs.py"), str(tmp_path)], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in CORPUS.iterdir())
    for made in tmp_path.iterdir():
        assert made.read_bytes() == (CORPUS / made.name).read_bytes(), made.name
