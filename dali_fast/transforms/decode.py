"""One decoding rule for every loader, so the same file gives the same pixels everywhere.

DALI's decoders apply the EXIF orientation and scale 16-bit images to 8 bits; Pillow does neither by
itself (`convert("RGB")` on a 16-bit gray PNG clips it to white). `to_rgb` makes Pillow follow
DALI's rule: orientation applied, 16-bit scaled (value >> 8), CMYK/alpha/palette/gray to RGB.

`Decoder` serves `TorchIterator`'s workers: plain JPEGs (8-bit gray or YCbCr, any EXIF orientation,
the bulk of every photo data set) through libjpeg-turbo directly (simplejpeg, about 2x Pillow's speed,
the same pixels), everything else through Pillow and `to_rgb`.

Damaged JPEG data: libjpeg-turbo reports damage in a JPEG's compressed data ("Corrupt JPEG data: ...",
"Premature end of JPEG file") as a warning and goes on, filling what it lost with grey or smeared
pixels; Pillow says nothing at all. Here such a JPEG is a bad record (`CorruptJpeg`), whichever path
decodes it: the fast path decodes strictly (simplejpeg's ``strict``, which costs a good image nothing),
and a JPEG that goes to Pillow is first decoded strictly at 1/8 scale (`jpeg_damage`). `verdict` is
the rule as `pack` and ``inspect --verify`` apply it.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data.checks import check_encoded, pillow_reason

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


def stored_size(data: bytes | np.ndarray) -> tuple[int, int] | None:
    """(width, height) of a JPEG (its frame header) or PNG (its IHDR) as stored, read without decoding;
    None for anything else or a header that cannot be read."""
    head = bytes(data[:24])
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    jpeg = jpeg_header(data)
    return (jpeg.width, jpeg.height) if jpeg is not None else None


def fast_path_header(data: bytes | np.ndarray) -> JpegHeader | None:
    """The header of a JPEG the fast decoder serves exactly as `to_rgb` would (8-bit, 1 or 3 components
    in gray or YCbCr, no Adobe colour transform; its EXIF orientation is applied after the decode, as
    `to_rgb` applies it), else None: the general path decodes it."""
    if _simplejpeg() is None:
        return None
    head = jpeg_header(data)
    if (
        head is None
        or head.precision != 8
        or head.components not in (1, 3)
        or head.adobe
        or head.width < 1
        or head.height < 1
    ):
        return None
    try:
        _, _, colorspace, _ = _simplejpeg().decode_jpeg_header(data)
    except ValueError:
        return None
    return head if colorspace in _FAST_COLORSPACES else None


def oriented(pixels: np.ndarray, rot: int) -> np.ndarray:
    """``pixels`` (H, W, C) as stored, shown as EXIF orientation ``rot`` says: a view, as Pillow's
    ``transpose`` in `to_rgb` turns them (1 = as stored)."""
    if rot in _SWAPS_SIDES:
        pixels = pixels.transpose(1, 0, 2)  # TRANSPOSE (5); the others are it and a flip
        return {5: pixels, 6: pixels[:, ::-1], 7: pixels[::-1, ::-1], 8: pixels[::-1]}[rot]
    return {1: pixels, 2: pixels[:, ::-1], 3: pixels[::-1, ::-1], 4: pixels[::-1]}[rot]


class CorruptJpeg(ValueError):
    """libjpeg-turbo reported damage in a JPEG's compressed data (the message is the reason)."""


# libjpeg-turbo's warnings that mean lost or invented pixels (jerror.h: JWRN_HIT_MARKER, JWRN_HUFF_BAD_CODE,
# JWRN_EXTRANEOUS_DATA, JWRN_MUST_RESYNC, JWRN_ARITH_BAD_CODE, JWRN_JPEG_EOF, JWRN_BOGUS_PROGRESSION). Its
# other warnings (an unknown JFIF revision, odd scan parameters) leave the pixels whole.
_DAMAGE = ("Corrupt JPEG data", "Premature end of JPEG file", "Inconsistent progression sequence")


def damage_reason(message: str) -> str | None:
    """The bad-record reason for libjpeg-turbo's ``message`` when it reports damage, else None."""
    if message.startswith(_DAMAGE):
        return f"corrupt JPEG (libjpeg-turbo: {message})"
    return None


def _strict_decode(data: bytes | np.ndarray) -> tuple[bool, str | None]:
    """A JPEG decoded strictly by libjpeg-turbo at 1/8 scale (every bit of its scans is still read):
    (whether it decoded whole, why it is damaged). (False, None): not a JPEG, or one libjpeg-turbo cannot
    read at all (a fatal error, or a warning that is no damage: Pillow's verdict then decides)."""
    sj = _simplejpeg()
    if sj is None or len(data) < 3 or bytes(data[:3]) != b"\xff\xd8\xff":
        return False, None
    try:
        _, _, colorspace, _ = sj.decode_jpeg_header(data)
        to = {"CMYK": "CMYK", "YCCK": "CMYK", "Gray": "GRAY"}.get(colorspace, "RGB")
        sj.decode_jpeg(data, colorspace=to, min_width=1, min_height=1, min_factor=8, strict=True)
    except ValueError as e:
        return False, damage_reason(str(e))
    return True, None


def jpeg_damage(data: bytes | np.ndarray) -> str | None:
    """Why libjpeg-turbo finds a JPEG's compressed data damaged, or None (whole, not a JPEG, or one it
    cannot read at all). A strict decode at 1/8 scale: about two thirds of a full decode's time."""
    return _strict_decode(data)[1]


def verdict(data: bytes | np.ndarray, name: str | None = None) -> str | None:
    """Why a record is bad by the one rule, reading all of it, or None: the structural checks
    (`check_encoded`, the pixel limit included), then a JPEG's strict decode by libjpeg-turbo (damage
    reported is bad; decoded whole is good), and Pillow's decode for everything else. What `pack` and
    ``inspect --verify`` apply to every record; ``name`` (the file) is put in Pillow's words for it."""
    reason = check_encoded(data)
    if reason is not None:
        return reason
    whole, reason = _strict_decode(data)
    if whole or reason is not None:
        return reason
    try:
        with open_image(data) as im:
            im.load()
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
        return pillow_reason(e, name)
    return None


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
    pages to fault in per image. Everything else (PNG, CMYK, 16-bit, palette...), and a JPEG the fast
    decoder cannot read at all, goes through Pillow. A JPEG whose compressed data libjpeg-turbo reports
    damaged is `CorruptJpeg`, on either path (see the module's note); otherwise an image is bad only if
    Pillow says so. One per worker process; not thread-safe.
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
            turned = head.orientation in _SWAPS_SIDES
            return Opened(self, data, *((head.height, head.width) if turned else (head.width, head.height)), head, None)
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
            except ValueError as e:
                reason = damage_reason(str(e))
                if reason is not None:
                    raise CorruptJpeg(reason) from None
                self.image = open_image(self.data)  # not readable this way: Pillow's verdict decides
            else:
                self.decoder.fast += 1
                return oriented(pixels, self.head.orientation)
        else:
            reason = jpeg_damage(self.data)  # a JPEG Pillow decodes would hide the damage
            if reason is not None:
                raise CorruptJpeg(reason)
        self.decoder.general += 1
        im = self.image if self.image is not None else open_image(self.data)
        if need and im.format == "JPEG":
            stored = need if im.size == (self.width, self.height) else (need[1], need[0])
            im.draft("RGB", (2 * stored[0], 2 * stored[1]))
        return np.array(to_rgb(im), dtype=np.uint8)
