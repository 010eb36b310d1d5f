"""One decoding rule for every loader, so the same file gives the same pixels everywhere.

DALI's decoders apply the EXIF orientation and scale 16-bit images to 8 bits; Pillow does neither by
itself (`convert("RGB")` on a 16-bit gray PNG clips it to white). `to_rgb` makes Pillow follow
DALI's rule: orientation applied, 16-bit scaled (value >> 8), CMYK/alpha/palette/gray to RGB.

`Decoder` serves `TorchIterator`'s workers: plain JPEGs (8-bit gray or YCbCr, orientation 1, the
bulk of every photo data set) through libjpeg-turbo directly (simplejpeg, about 2x Pillow's speed,
the same pixels), everything else through Pillow and `to_rgb`.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


# ----------------------------------------------------------------------------- the fast JPEG path

_SOF_FAST = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential and progressive (Huffman) frames
_SOF_OTHER = (0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)  # lossless, hierarchical, arithmetic
_STANDALONE = (0x01, *range(0xD0, 0xD8))  # TEM, RST0-7: markers without a length
_FAST_COLORSPACES = ("YCbCr", "Gray")


@dataclass(frozen=True)
class JpegHeader:
    """What the marker segments before the first scan say, read without decoding."""

    width: int
    height: int
    components: int
    precision: int
    orientation: int  # EXIF orientation; 1 = as stored (also when there is no EXIF block)
    adobe: bool  # an Adobe APP14 segment (its colour transform decides RGB/YCbCr/CMYK/YCCK)


def _exif_orientation(tiff: memoryview) -> int | None:
    """The orientation tag of an EXIF block's first IFD: 1 when absent, None when the block is damaged."""
    if len(tiff) < 8 or bytes(tiff[:2]) not in (b"II", b"MM"):
        return None
    order = "little" if bytes(tiff[:2]) == b"II" else "big"

    def num(at: int, size: int) -> int:
        return int.from_bytes(tiff[at : at + size], order)

    ifd = num(4, 4)
    if ifd + 2 > len(tiff):
        return None
    count = num(ifd, 2)
    if ifd + 2 + 12 * count > len(tiff):
        return None
    for k in range(count):
        entry = ifd + 2 + 12 * k
        if num(entry, 2) == EXIF_ORIENTATION:
            kind, n = num(entry + 2, 2), num(entry + 4, 4)
            if n != 1 or kind not in (3, 4):  # SHORT or LONG, one value
                return None
            return num(entry + 8, 2) if kind == 3 else num(entry + 8, 4)
    return 1


def jpeg_header(data: bytes | np.ndarray) -> JpegHeader | None:
    """Walk a JPEG's marker segments up to the first scan; None when it is not a JPEG or cannot be
    read this way (the general path then decides what it is)."""
    buf = memoryview(data if isinstance(data, bytes) else np.ascontiguousarray(data, dtype=np.uint8)).cast("B")
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    pos, orientation, adobe, sof = 2, 1, False, None
    seen_exif = False
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xDA:  # start of scan: the header is complete
            break
        length = (buf[pos + 2] << 8) | buf[pos + 3]
        seg, end = pos + 4, pos + 2 + length
        if length < 2 or end > n:
            return None
        if marker == 0xE1 and not seen_exif and buf[seg : seg + 6] == b"Exif\0\0":
            seen_exif = True  # the first EXIF block counts, as in Pillow
            value = _exif_orientation(buf[seg + 6 : end])
            if value is None:
                return None
            orientation = value
        elif marker == 0xEE and buf[seg : seg + 5] == b"Adobe":
            adobe = True
        elif marker in _SOF_FAST:
            if length < 8:
                return None
            precision = buf[seg]
            height = (buf[seg + 1] << 8) | buf[seg + 2]
            width = (buf[seg + 3] << 8) | buf[seg + 4]
            sof = (width, height, buf[seg + 5], precision)
        elif marker in _SOF_OTHER:
            return None
        pos = end
    else:
        return None  # no scan
    if sof is None:
        return None
    width, height, components, precision = sof
    return JpegHeader(width, height, components, precision, orientation, adobe)


def fast_path_header(data: bytes | np.ndarray) -> JpegHeader | None:
    """The header of a JPEG the fast decoder serves exactly as `to_rgb` would (8-bit, 1 or 3 components
    in gray or YCbCr, no Adobe colour transform, orientation 1), else None: the general path decodes it."""
    if _simplejpeg() is None:
        return None
    head = jpeg_header(data)
    if (
        head is None
        or head.precision != 8
        or head.components not in (1, 3)
        or head.adobe
        or head.orientation != 1
        or head.width < 1
        or head.height < 1
    ):
        return None
    try:
        _, _, colorspace, _ = _simplejpeg().decode_jpeg_header(data)
    except ValueError:
        return None
    return head if colorspace in _FAST_COLORSPACES else None


@functools.lru_cache(maxsize=1)
def _simplejpeg() -> Any:
    """The simplejpeg module (libjpeg-turbo), or None where it is not installed."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def reduction(width: int, height: int, need: tuple[int, int]) -> int:
    """The JPEG DCT scale 1/k (k in 8, 4, 2, 1) by Pillow's draft rule for a requested size of twice
    ``need``: the largest k with the decoded image still at least 2 x ``need`` on both sides."""
    scale = min(width // max(1, 2 * need[0]), height // max(1, 2 * need[1]))
    return next((k for k in (8, 4, 2) if scale >= k), 1)


class Decoder:
    """Decodes records by the one rule (`to_rgb`), reusing its output memory from image to image.

    Plain JPEGs (see `fast_path_header`) are decoded by libjpeg-turbo through simplejpeg, at the DCT
    scale Pillow's draft mode would pick, into a buffer kept between calls: no allocation, no fresh
    pages to fault in per image. Everything else (PNG, EXIF-rotated, CMYK, 16-bit, palette...), and a
    JPEG the fast decoder refuses, goes through Pillow: an image is bad only if Pillow says so.
    One per worker process; not thread-safe.
    """

    def __init__(self, max_buffer: int = 64 * 2**20) -> None:
        self.max_buffer = max_buffer
        self._buffer = np.empty(0, np.uint8)
        self.fast = 0  # images served by the fast path (for tests and benchmarks)
        self.general = 0

    def open(self, data: bytes | np.ndarray) -> Opened:
        """The record's displayed (width, height) and a way to decode it, without decoding yet."""
        head = fast_path_header(data)
        if head is not None:
            return Opened(self, data, head.width, head.height, head, None)
        im = open_image(data)
        width, height = oriented_size(im)
        return Opened(self, data, width, height, None, im)

    def _fast(self, data: bytes | np.ndarray, head: JpegHeader, k: int) -> np.ndarray:
        sj = _simplejpeg()
        w, h = -(-head.width // k), -(-head.height // k)
        size = w * h * 3
        kw: dict[str, Any] = {"colorspace": "RGB"}
        if k > 1:
            kw.update(min_width=w, min_height=h, min_factor=k)
        if size > self.max_buffer:
            return sj.decode_jpeg(data, **kw)  # a huge image: its own memory, freed after use
        if self._buffer.size < size:
            self._buffer = np.empty(max(size, self._buffer.size * 5 // 4), np.uint8)
        return sj.decode_jpeg(data, buffer=self._buffer, **kw)


@dataclass
class Opened:
    """An opened record: displayed ``width`` x ``height``; `decode` gives its RGB pixels."""

    decoder: Decoder
    data: bytes | np.ndarray
    width: int
    height: int
    head: JpegHeader | None
    image: Image.Image | None

    def decode(self, need: tuple[int, int] | None = None) -> np.ndarray:
        """uint8 (H', W', 3) RGB of the whole image as shown; with ``need`` (the displayed size the output
        needs), a JPEG may be decoded at 1/2, 1/4 or 1/8 scale by Pillow's draft rule (`reduction`).
        The array may be the decoder's reused buffer: use it before the next decode. Raises what the
        decoder raises for a damaged record."""
        if self.head is not None:
            k = reduction(self.width, self.height, need) if need else 1
            try:
                pixels = self.decoder._fast(self.data, self.head, k)  # noqa: SLF001 - the decoder's own helper
            except ValueError:
                self.image = open_image(self.data)  # refused (damaged?): Pillow's verdict decides
            else:
                self.decoder.fast += 1
                return pixels
        self.decoder.general += 1
        im = self.image if self.image is not None else open_image(self.data)
        if need and im.format == "JPEG":
            stored = need if im.size == (self.width, self.height) else (need[1], need[0])
            im.draft("RGB", (2 * stored[0], 2 * stored[1]))
        return np.array(to_rgb(im), dtype=np.uint8)
