"""The odd-JPEG corpus: small JPEGs of every kind a decoder may treat differently, made from pip and Debian tools.

    apt-get install libjpeg-turbo-progs libturbojpeg0     # cjpeg and jpegtran 2.1, TurboJPEG's library
    python scripts/odd_jpegs.py [OUT]                     # default: tests/fixtures/odd_jpegs

Each file is one 64x64 picture (smooth gradients, a few edges, and a corner mark that shows any rotation
or mirror), written one odd way: progressive; restart markers; 4:4:4, 4:2:2, 4:2:0, 4:4:0 and 4:1:1
sampling; grayscale; arithmetic coding (cjpeg); CMYK (Pillow) and YCCK (TurboJPEG, which encodes CMYK as
YCCK); an ICC profile (Pillow); EXIF orientations 2-8 (Pillow); and a truncated file. ``manifest.json``
lists them as ``{"file", "kind", "made_by", "expect", "max_levels"}``: ``expect`` is ``"decode"`` (the
pixels must be within ``max_levels`` of Pillow's: `ImageOps.exif_transpose`, then RGB) or ``"refuse"`` (a
loader must skip or refuse it, named and counted; ``max_levels`` null). The CPU test
(tests/tools/test_odd_jpegs.py) and the GPU check read the same files. The same tools give the same bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms

SIZE = 64  # square, so that every EXIF orientation keeps the shape and an evaluation crop is the whole image
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "odd_jpegs"
ORIENTATIONS = {
    2: "mirrored",
    3: "rotated 180",
    4: "flipped",
    5: "transposed",
    6: "rotated 90 clockwise",
    7: "transversed",
    8: "rotated 90 counter-clockwise",
}
SAMPLING = {"444": "1x1", "422": "2x1", "420": "2x2", "440": "1x2", "411": "4x1"}  # cjpeg -sample (luma factors)


def picture() -> np.ndarray:
    """The 64x64 RGB picture every file holds: gradients, a disc, bars, and a white mark in the top-left corner."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    r = 40 + 180 * x / SIZE
    g = 30 + 150 * y / SIZE + 20 * np.sin(x / 5)
    b = 200 - 120 * (x + y) / (2 * SIZE)
    disc = (x - 40) ** 2 + (y - 36) ** 2 < 12**2
    r[disc], g[disc], b[disc] = 230, 60, 40
    bars = (y > 48) & ((x // 4) % 2 == 0)
    r[bars], g[bars], b[bars] = 20, 20, 90
    rgb = np.stack([r, g, b], axis=-1)
    rgb[2:10, 2:14] = 250  # the corner mark: any rotation or mirror moves it
    return np.clip(rgb, 0, 255).astype(np.uint8)


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        sys.exit(f"scripts/odd_jpegs.py needs {name}: apt-get install libjpeg-turbo-progs")
    return found


def cjpeg(ppm: Path, *flags: str) -> bytes:
    return subprocess.run([tool("cjpeg"), "-quality", "90", *flags, str(ppm)], check=True, capture_output=True).stdout


def pillow(image: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def ycck(cmyk: np.ndarray) -> bytes:
    """A YCCK JPEG of ``cmyk`` (H, W, 4) through TurboJPEG, which writes CMYK pixels as YCCK."""
    try:
        tj = ctypes.CDLL("libturbojpeg.so.0")
    except OSError:
        sys.exit("scripts/odd_jpegs.py needs TurboJPEG's library for the YCCK file: apt-get install libturbojpeg0")
    tj.tjInitCompress.restype = ctypes.c_void_p
    handle = ctypes.c_void_p(tj.tjInitCompress())
    out, size = ctypes.POINTER(ctypes.c_ubyte)(), ctypes.c_ulong(0)
    src = np.ascontiguousarray(cmyk)
    tjpf_cmyk, tjsamp_444 = 11, 0
    rc = tj.tjCompress2(
        handle, src.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)), SIZE, 0, SIZE, tjpf_cmyk,
        ctypes.byref(out), ctypes.byref(size), tjsamp_444, 90, 0,
    )  # fmt: skip
    if rc != 0:
        sys.exit("TurboJPEG could not write the YCCK file")
    data = ctypes.string_at(out, size.value)
    tj.tjFree(out)
    tj.tjDestroy(handle)
    return data


def corpus(tmp: Path) -> list[tuple[str, str, str, bytes, str]]:
    """(file, kind, made_by, bytes, expect) of every file."""
    rgb = picture()
    image = Image.fromarray(rgb)
    ppm = tmp / "picture.ppm"
    image.save(ppm)
    gray_ppm = tmp / "gray.pgm"
    image.convert("L").save(gray_ppm)
    cmyk = np.asarray(image.convert("CMYK"))
    files = [("baseline.jpg", "baseline", "Pillow quality=90 (4:2:0)", pillow(image), "decode")]
    files.append(("progressive.jpg", "progressive", "cjpeg -quality 90 -progressive", cjpeg(ppm, "-progressive"), "decode"))
    files.append(("restart.jpg", "restart markers", "cjpeg -quality 90 -restart 1", cjpeg(ppm, "-restart", "1"), "decode"))
    for name, factors in SAMPLING.items():
        made = f"cjpeg -quality 90 -sample {factors}"
        files.append((f"sampling_{name}.jpg", f"{name[0]}:{name[1]}:{name[2]} sampling", made, cjpeg(ppm, "-sample", factors), "decode"))
    files.append(("gray.jpg", "grayscale", "cjpeg -quality 90 -grayscale", cjpeg(ppm, "-grayscale"), "decode"))
    files.append(("arithmetic.jpg", "arithmetic coding", "cjpeg -quality 90 -arithmetic", cjpeg(ppm, "-arithmetic"), "decode"))
    files.append(("cmyk.jpg", "CMYK", "Pillow quality=90 of Image.convert('CMYK')", pillow(Image.fromarray(cmyk, "CMYK")), "decode"))
    files.append(("ycck.jpg", "YCCK", "TurboJPEG tjCompress2 TJPF_CMYK 4:4:4 quality 90", ycck(cmyk), "decode"))
    icc = bytearray(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())
    icc[24:36] = bytes([7, 234, 0, 1, 0, 1] + [0] * 6)  # LittleCMS stamps the time: a fixed date, the same bytes
    icc[84:100] = bytes(16)  # and the profile ID (an MD5 over it, date included): zero means "not computed"
    icc = bytes(icc)
    files.append(("icc.jpg", "ICC profile", "Pillow quality=90 icc_profile=ImageCms sRGB", pillow(image, icc_profile=icc), "decode"))
    for k, what in ORIENTATIONS.items():
        exif = Image.Exif()
        exif[0x0112] = k
        made = f"Pillow quality=90 exif Orientation={k} ({what})"
        files.append((f"exif_orientation_{k}.jpg", f"EXIF orientation {k}", made, pillow(image, exif=exif.tobytes()), "decode"))
    whole = pillow(image)
    cut = whole[: len(whole) // 2]
    files.append(("truncated.jpg", "truncated", "Pillow quality=90, the first half of its bytes", cut, "refuse"))
    return files


# The stated bound, in levels (0-255) against Pillow's pixels, for a CPU loader in evaluation mode at the
# image's own size: every CPU decoder here is libjpeg-turbo and the colour rules are Pillow's, so the
# pixels are the same (measured: 0 for every kind, both loaders). A GPU decoder states its own bound.
MAX_LEVELS: dict[str, int] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus(Path(tmp))
    manifest = []
    for name, kind, made_by, data, expect in files:
        (a.out / name).write_bytes(data)
        levels = MAX_LEVELS.get(kind, 0) if expect == "decode" else None
        manifest.append({"file": name, "kind": kind, "made_by": made_by, "expect": expect, "max_levels": levels})
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(len(d) for *_, d, _ in files)
    print(f"{a.out}: {len(files)} files, {total / 1024:.0f} KB in all, and manifest.json")


if __name__ == "__main__":
    main()
