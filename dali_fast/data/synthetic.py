"""The embedded default data set: ImageNet-like JPEGs made on demand, deterministic for a seed
(`make_synthetic`), kept packed in the cache folder for ``bench`` and ``train`` (`default_dataset`).

Each image is a smooth random field (upsampled low-resolution noise) with fine noise on top,
so it compresses like a photo. Each class has its own tint and stripe orientation, so a
small network can learn the classes: a falling loss proves images and labels arrive intact.
A multi-label set (``multi_label=True``) gives each image a random subset of the classes instead, each
present class a patch of its colour, listed in ``labels.csv`` (multi-hot targets a network can learn).
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import numpy as np

from ..files import atomic_dir, cache_folder, default_cache_dir
from ..text import progress_bar
from .pack.packed import pack

log = logging.getLogger(__name__)


def class_style(label: int, classes: int) -> tuple[np.ndarray, float]:
    """(RGB tint in [0, 1], stripe angle in radians) for a class."""
    rng = np.random.default_rng([12345, label])
    hue = label / max(classes, 1)
    tint = 0.5 + 0.45 * np.cos(2 * np.pi * (hue + np.array([0.0, 1 / 3, 2 / 3])))
    return tint * rng.uniform(0.85, 1.0), np.pi * label / max(classes, 1)


def make_image(rng: np.random.Generator, label: int, classes: int) -> tuple[bytes, tuple[int, int]]:
    """One JPEG: (encoded bytes, (width, height))."""
    from PIL import Image

    area = rng.normal(500 * 375, 60_000)
    aspect = np.exp(rng.uniform(np.log(0.6), np.log(1.8)))
    w = int(np.clip(np.sqrt(max(area, 40_000) * aspect), 160, 1000))
    h = int(np.clip(w / aspect, 120, 1000))
    tint, angle = class_style(label, classes)
    tint = tint.astype(np.float32)
    low = rng.uniform(0, 1, size=(rng.integers(4, 9), rng.integers(4, 9), 3)).astype(np.float32)
    field = np.asarray(Image.fromarray((low * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC), np.float32)
    period = rng.uniform(12, 24)
    # stripes = 0.5 + 0.5 sin(2 pi (x cos a + y sin a) / period), as an outer sum: float32, one pass
    k = np.float32(2 * np.pi / period)
    phase = np.arange(w, dtype=np.float32)[None, :] * (k * np.float32(np.cos(angle)))
    phase = phase + np.arange(h, dtype=np.float32)[:, None] * (k * np.float32(np.sin(angle)))
    stripes = np.sin(phase, out=phase)
    stripes *= 60.0
    stripes += 60.0  # 120 x (0.5 + 0.5 sin)
    img = rng.standard_normal(size=(h, w, 3), dtype=np.float32)
    img *= 6.0
    img += 0.45 * field
    img += stripes[..., None] * tint
    img *= 0.6 + 0.6 * tint
    img = np.clip(img, 0, 255, out=img).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(img).save(out, "JPEG", quality=int(rng.integers(75, 96)))
    return out.getvalue(), (w, h)


def make_multilabel_image(rng: np.random.Generator, present: list[int], classes: int) -> bytes:
    """One JPEG of about 160 x 120 px: a smooth random field, and a patch of its class's colour (a quarter to
    a third of each side, anywhere) for each class in ``present``."""
    from PIL import Image

    w, h = int(rng.integers(140, 200)), int(rng.integers(105, 150))
    low = rng.uniform(0, 1, size=(4, 4, 3)).astype(np.float32)
    img = np.asarray(Image.fromarray((low * 160).astype(np.uint8)).resize((w, h), Image.BICUBIC), np.float32)
    img += rng.standard_normal(size=(h, w, 3), dtype=np.float32) * 6.0
    for k in present:
        tint, _ = class_style(k, classes)
        pw, ph = int(w * rng.uniform(0.25, 0.35)), int(h * rng.uniform(0.25, 0.35))
        x, y = int(rng.integers(0, w - pw)), int(rng.integers(0, h - ph))
        img[y : y + ph, x : x + pw] = tint * 255
    out = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def make_synthetic(
    out: str | os.PathLike,
    images: int = 1000,
    classes: int = 10,
    seed: int = 0,
    progress: bool = True,
    multi_label: bool = False,
) -> Path:
    """Write an ImageFolder of ``images`` JPEGs in ``classes`` classes at ``out``; returns ``out``.

    Image ``i`` is of class ``i % classes``, so ``images`` must be at least ``classes`` (no empty class).
    The same (images, classes, seed) always gives the same bytes. ``out`` must not exist (or be an
    empty folder): the set is written into a temporary folder beside it and renamed into place when
    complete, so two runs never mix and an interrupted run leaves nothing at ``out``.

    ``multi_label``: each image holds each class with probability 0.4 (a patch of its colour,
    `make_multilabel_image`); the images are ``out/images/img_0000000.jpg`` ... and ``out/labels.csv``
    lists each one's classes (``images/img_0000000.jpg,0 3``): open it with
    ``open_dataset(out, target="multihot", num_classes=classes)``.

    Args:
        out: the folder to write (new, or empty).
        images: the number of images.
        classes: the number of classes (at most ``images``).
        seed: the seed of the images' content.
        progress: show a progress bar.
        multi_label: write a multi-label set with ``labels.csv`` (above) instead of class folders.
    """
    if images < 1 or classes < 1:
        raise ValueError(f"images={images}, classes={classes}: both must be >= 1")
    if images < classes:  # image i goes to class i % classes: the last classes would stay empty
        raise ValueError(
            f"images={images} is fewer than classes={classes}: {classes - images} classes would have no image; "
            f"make at least as many images as classes (--images {classes}) or fewer classes (--classes {images})"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: is a file; make-synthetic writes a new folder, choose another path")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out}: already exists and is not empty; choose a new folder or remove it")
    if multi_label:
        return _make_multilabel(out, images, classes, seed, progress)
    width = len(str(classes - 1))
    names = [f"class_{c:0{width}d}" for c in range(classes)]
    with atomic_dir(out, what="make-synthetic run") as tmp:
        for name in names:
            (tmp / name).mkdir()
        with progress_bar(images, "make-synthetic", "img", enabled=progress) as bar:
            for i in range(images):
                label = i % classes
                data, _ = make_image(np.random.default_rng([seed, i]), label, classes)
                (tmp / names[label] / f"img_{i:07d}.jpg").write_bytes(data)
                bar.update(1)
    log.info("synthetic set: %d images, %d classes in %s", images, classes, out)
    return out


def _make_multilabel(out: Path, images: int, classes: int, seed: int, progress: bool) -> Path:
    lines = ["path,labels"]
    with atomic_dir(out, what="make-synthetic run") as tmp:
        (tmp / "images").mkdir()
        with progress_bar(images, "make-synthetic", "img", enabled=progress) as bar:
            for i in range(images):
                rng = np.random.default_rng([seed, i, 1])
                present = [k for k in range(classes) if rng.random() < 0.4]
                name = f"images/img_{i:07d}.jpg"
                (tmp / name).write_bytes(make_multilabel_image(rng, present, classes))
                lines.append(f"{name},{' '.join(map(str, present))}")
                bar.update(1)
        (tmp / "labels.csv").write_text("\n".join(lines) + "\n")
    log.info("synthetic multi-label set: %d images, %d classes in %s", images, classes, out)
    return out


def default_dataset(images: int, classes: int = 10, progress: bool = True) -> tuple[Path, Path]:
    """(ImageFolder, packed) of the embedded synthetic set, made once into the cache folder (of as many
    classes as images, when there are fewer images than ``classes``)."""
    classes = min(classes, images)
    root = default_cache_dir() / f"synthetic-{images}x{classes}"
    folder, packed = root / "images", root / "packed"
    if packed.exists():
        return folder, packed
    root = cache_folder(root.name)
    # Under torchrun every rank arrives here at once: the first makes the set, the others wait for it.
    with open(root / ".lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no flock (Windows): one process at a time is then the user's affair
            pass
        if not packed.exists():
            if not folder.exists():  # complete if it exists (written atomically)
                make_synthetic(folder, images=images, classes=classes, progress=progress)
            pack(folder, packed, progress=progress, verify=False)
    return folder, packed
