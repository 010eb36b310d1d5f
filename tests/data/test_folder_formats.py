"""ImageFolder by torchvision's rule: the same classes and (file, label) list as torchvision's
`find_classes` and `make_dataset` on one tree (dot-folders, linked folders, upper-case extensions,
torchvision's extensions), the differences named; and torchvision's image formats decoded by both loaders
as Pillow decodes them."""

from __future__ import annotations

import io
import logging
import os

import numpy as np
import pytest
from builders import jpeg_bytes
from PIL import Image

from dali_fast.data.folder import ImageFolderReader, scan_image_folder
from dali_fast.loaders.factory import make_loader
from dali_fast.transforms.recipe import Recipe

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's


def torchvision_rule(root: str) -> tuple[list[str], list[tuple[str, int]]]:
    """torchvision.datasets.folder's find_classes and make_dataset (extensions=IMG_EXTENSIONS), as written
    there: torchvision does not import beside this project's CPU torch, so its rule is restated here."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    instances = []
    for target_class in sorted(class_to_idx.keys()):
        target_dir = os.path.join(root, target_class)
        for folder, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(folder, fname)
                if path.lower().endswith(IMG_EXTENSIONS):
                    instances.append((path, class_to_idx[target_class]))
    return classes, instances


def _tree(root):
    image = jpeg_bytes(8, 8)
    files = [
        "cat/a.jpg", "cat/B.JPG", "cat/x/y/deep.png", "cat/x-1/side.jpeg", "cat/x/z.webp", "cat/notes.txt",
        "dog/1.bmp", "dog/2.tif", "dog/3.tiff", "dog/4.ppm", "dog/5.pgm", "dog/.hidden.jpg",
        ".ipynb_checkpoints/a-checkpoint.jpg", "zebra/z.jpg", "elsewhere/far.jpg",
    ]  # fmt: skip
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(image)
    outside = root.parent / "outside"
    (outside / "more").mkdir(parents=True)
    (outside / "more" / "o.jpg").write_bytes(image)
    (root / "linked").symlink_to(outside, target_is_directory=True)  # a class folder that is a link
    (root / "zebra" / "sub").symlink_to(outside / "more", target_is_directory=True)  # a linked sub-folder
    return root


def test_the_same_classes_and_files_as_torchvision_on_one_tree(tmp_path, caplog):
    root = _tree(tmp_path / "root")
    classes, theirs = torchvision_rule(str(root))
    assert classes == [".ipynb_checkpoints", "cat", "dog", "elsewhere", "linked", "zebra"]
    with caplog.at_level(logging.WARNING):
        reader = ImageFolderReader(root)
    assert reader.classes == classes
    assert [(reader.source(i), int(reader.labels[i])) for i in range(len(reader))] == theirs
    assert any("'.ipynb_checkpoints' (label 0)" in m and "as torchvision counts" in m for m in caplog.messages)


def test_a_link_loop_is_named_not_followed_and_the_rest_is_torchvision_s(tmp_path, caplog):
    root = _tree(tmp_path / "root")
    (root / "cat" / "x" / "back").symlink_to(root / "cat", target_is_directory=True)  # a loop
    classes, items, _, unlisted = scan_image_folder(root)
    assert unlisted == [(str(root / "cat" / "x" / "back"), "a link back to a folder above it (a loop): not followed")]
    _, theirs = torchvision_rule(str(root))  # follows the loop: the same files again under cat/x/back/...
    looped = [(p, label) for p, label in theirs if "/back/" in p]
    assert looped and [(str(p), label) for p, label in items] == [x for x in theirs if "/back/" not in x[0]]


def _encoded(arr: np.ndarray, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(arr).save(out, fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_torchvision_s_formats_decode_as_pillow_decodes_them_in_both_loaders(tmp_path, backend):
    y, x = np.mgrid[0:32, 0:32]
    rgb = np.stack([x * 8, y * 8, (x + y) * 4], -1).astype(np.uint8)
    files = {
        "webp.webp": _encoded(rgb, "WEBP", lossless=True),
        "bmp.bmp": _encoded(rgb, "BMP"),
        "tif.tif": _encoded(rgb, "TIFF"),
        "tiff.tiff": _encoded(rgb, "TIFF", compression="tiff_lzw"),
        "ppm.ppm": _encoded(rgb, "PPM"),
        "pgm.pgm": _encoded(rgb[..., 0], "PPM"),
        "png.png": _encoded(rgb, "PNG"),
    }
    for name, data in files.items():
        (tmp_path / "d" / name.split(".")[0]).mkdir(parents=True)
        (tmp_path / "d" / name.split(".")[0] / name).write_bytes(data)
    reader = ImageFolderReader(tmp_path / "d")
    recipe = Recipe(image_size=32, eval_crop_fraction=1.0, mean=None, std=None)
    kw = {"num_workers": 0} if backend == "torch" else {"device": "cpu", "num_threads": 1}
    loader = make_loader(reader, 4, backend=backend, train=False, image_size=32, recipe=recipe, **kw)
    got = {}
    for images, labels in loader:
        for image, label in zip(images, labels.tolist(), strict=True):
            got[reader.classes[label]] = image.permute(1, 2, 0).numpy().astype(int)
    assert sorted(got) == sorted(n.split(".")[0] for n in files) and loader.skipped == 0
    for name, data in files.items():
        pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
        assert np.abs(got[name.split(".")[0]] - pillow).max() == 0, name


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_a_cut_file_of_another_format_is_a_named_bad_record(tmp_path, backend):
    rgb = np.full((32, 32, 3), 90, np.uint8)
    for name, data in {"bmp.bmp": _encoded(rgb, "BMP"), "webp.webp": _encoded(rgb, "WEBP", lossless=True)}.items():
        (tmp_path / "d" / "c").mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / "c" / name).write_bytes(data[: len(data) // 2])
    (tmp_path / "d" / "c" / "ok.jpg").write_bytes(jpeg_bytes(32, 32))
    reader = ImageFolderReader(tmp_path / "d")
    kw = {"num_workers": 0} if backend == "torch" else {"device": "cpu", "num_threads": 1}
    loader = make_loader(reader, 4, backend=backend, train=False, image_size=16, on_error="skip", **kw)
    assert sum(len(labels) for _, labels in loader) == 1 and loader.skipped == 2
