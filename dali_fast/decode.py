"""One decoding rule for every loader, so the same file gives the same pixels everywhere.

DALI's decoders apply the EXIF orientation and scale 16-bit images to 8 bits; Pillow does neither by
itself (`convert("RGB")` on a 16-bit gray PNG clips it to white). `open_rgb` makes Pillow follow
DALI's rule: orientation applied, 16-bit scaled (value >> 8), CMYK/alpha/palette/gray to RGB.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = (5, 6, 7, 8)  # orientations that turn the image by 90 degrees
_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")


def open_image(data: bytes | np.ndarray) -> Image.Image:
    """A lazily decoded Pillow image of an encoded record (not yet loaded: `draft` still possible)."""
    from PIL import Image

    return Image.open(io.BytesIO(data if isinstance(data, bytes) else np.asarray(data).tobytes()))


def orientation(im: Image.Image) -> int:
    """The EXIF orientation (1 = as stored), read without decoding the pixels."""
    try:
        value = im.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - a damaged EXIF block means "as stored", as decoders treat it
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def oriented_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) as the image is shown, after its EXIF orientation."""
    w, h = im.size
    return (h, w) if orientation(im) in _SWAPS_SIDES else (w, h)


def to_rgb(im: Image.Image) -> Image.Image:
    """The image as shown (EXIF orientation applied), 8-bit RGB; 16-bit values are scaled by 1/256."""
    from PIL import Image

    rot = orientation(im)
    if im.mode in _WIDE_MODES:
        wide = np.asarray(im).astype(np.uint32)
        im = Image.fromarray((np.minimum(wide, 65535) >> 8).astype(np.uint8), "L")
    if rot != 1:
        # Pillow's own table (ImageOps.exif_transpose), applied to the converted pixels.
        method = {
            2: Image.Transpose.FLIP_LEFT_RIGHT,
            3: Image.Transpose.ROTATE_180,
            4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE,
            6: Image.Transpose.ROTATE_270,
            7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90,
        }[rot]
        im = im.transpose(method)
    return im if im.mode == "RGB" else im.convert("RGB")


def decode_rgb(data: bytes | np.ndarray) -> np.ndarray:
    """Decode a whole record to uint8 (H, W, 3) RGB by the shared rule (the reference of the tests)."""
    with open_image(data) as im:
        return np.asarray(to_rgb(im), dtype=np.uint8)
