"""A set of real photographs for benchmarks: scikit-image's sample photos cut into many crops.

    pip install scikit-image      # its wheel carries the sample photos; nothing is downloaded
    python scripts/photos.py OUT [--images 400] [--classes 10] [--size 470x370] [--quality 90] [--seed 0]

Synthetic images decode faster than photographs (smooth areas compress well), so speed claims are
measured on these. Each image is a random crop (40-100 % of the largest box of the output's aspect
ratio that fits, anywhere in the photo, sometimes mirrored) of one of the colour photos, resized with
Pillow's Lanczos filter to ``--size`` and saved as a baseline JPEG (4:2:0, not progressive) at
``--quality``: about 40 KB at the default 470x370, q90; ``--size 640x480 --quality 95`` gives
ImageNet-like records of about 100 KB. The set is an ImageFolder (``OUT/<class>/<n>.jpg``), written
into a temporary folder and renamed when complete; the same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

# The colour photographs among scikit-image's bundled data (no download needed).
PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "retina.jpg",
    "rocket.jpg",
)


def load_photos() -> list[Image.Image]:
    try:
        import skimage
    except ImportError:
        sys.exit("scripts/photos.py needs scikit-image for its sample photos: pip install scikit-image")
    root = Path(skimage.__file__).parent / "data"
    return [Image.open(root / name).convert("RGB") for name in PHOTOS]


def make_photos(out: Path, images: int, classes: int, size: tuple[int, int], quality: int, seed: int) -> Path:
    if out.exists():
        sys.exit(f"{out} exists; choose a new folder (the set is written whole or not at all)")
    photos = load_photos()
    rng = np.random.default_rng(seed)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    width, height = size
    for c in range(classes):
        (tmp / f"class_{c:03d}").mkdir(parents=True)
    for n in range(images):
        im = photos[int(rng.integers(len(photos)))]
        # the largest box of the output's aspect that fits, then 40-100 % of it, anywhere
        fit = min(im.width / width, im.height / height)
        s = fit * float(rng.uniform(0.4, 1.0))
        w, h = max(1, round(width * s)), max(1, round(height * s))
        x, y = int(rng.integers(im.width - w + 1)), int(rng.integers(im.height - h + 1))
        crop = im.resize((width, height), Image.LANCZOS, box=(x, y, x + w, y + h))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        crop.save(buf, "JPEG", quality=quality, subsampling=2, progressive=False, optimize=False)
        (tmp / f"class_{n % classes:03d}" / f"{n:06d}.jpg").write_bytes(buf.getvalue())
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--size", default="470x370", help="WIDTHxHEIGHT of each image (default: %(default)s)")
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        size = tuple(int(v) for v in a.size.lower().split("x"))
    except ValueError:
        size = ()
    if len(size) != 2 or min(size) < 1:
        sys.exit(f"--size {a.size!r}: use WIDTHxHEIGHT, for example 470x370")
    out = make_photos(a.out, a.images, a.classes, size, a.quality, a.seed)  # type: ignore[arg-type]
    total = sum(f.stat().st_size for f in out.rglob("*.jpg"))
    print(f"{out}: {a.images} photos in {a.classes} classes, {total / a.images / 1024:.0f} KB each on average")


if __name__ == "__main__":
    main()
