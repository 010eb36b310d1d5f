"""Checks of one record that cost O(1) or a walk of its headers, never a decode: what a bad record
would break first (a DALI pipeline dies on a JPEG it cannot parse), each verdict a reason in words.

The pixel limit: an image of more pixels than `pixel_limit` (Pillow's decompression-bomb guard, 2 x
``PIL.Image.MAX_IMAGE_PIXELS``) is refused by every loader and by `pack`, from its header (a JPEG's
frame, a PNG's IHDR), before any decoder sees it; DALI's decoders have no such guard of their own.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np

JPEG_SOI, JPEG_EOI = b"\xff\xd8\xff", b"\xff\xd9"  # a JPEG's first three bytes; its end-of-image marker
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # a PNG's last chunk: length 0, type IEND, its crc
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0-7: markers without a length
JPEG_SOI_BYTES, JPEG_EOI_BYTES = np.frombuffer(JPEG_SOI, np.uint8), np.frombuffer(JPEG_EOI, np.uint8)
PNG_SIGNATURE_BYTES, PNG_IEND_BYTES = np.frombuffer(PNG_SIGNATURE, np.uint8), np.frombuffer(PNG_IEND, np.uint8)
QUICK_MIN = 24  # bytes: records shorter (no real image is) get the full check instead of the quick look
_JPEG_FRAMES = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC}  # SOF0-15: not DHT, JPG, DAC
PILLOW_MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3  # Pillow's default Image.MAX_IMAGE_PIXELS
PIXELS_ENV = "DALI_FAST_MAX_PIXELS"  # the dali-fast command's pixel limit (`apply_pixel_limit_env`)


def pixel_limit() -> int | None:
    """The most pixels an image may have: twice ``PIL.Image.MAX_IMAGE_PIXELS`` (178,956,970 by default),
    where Pillow refuses an image as a possible decompression bomb, so that every decoder stops where
    Pillow does; None when it is None (no limit). Read at each call: a script may change it. Pillow not
    imported (nobody changed it), or being imported on another thread right now (its module is there,
    the attribute not yet): Pillow's default."""
    most = getattr(sys.modules.get("PIL.Image"), "MAX_IMAGE_PIXELS", PILLOW_MAX_IMAGE_PIXELS)
    return None if most is None else 2 * int(most)


def too_many_pixels(width: int, height: int, limit: int | None) -> str | None:
    """Why an image of ``width`` x ``height`` is refused under ``limit`` (see `pixel_limit`), or None."""
    if limit is None or max(1, width) * max(1, height) <= limit:
        return None
    return (
        f"{width}x{height} pixels ({width * height:,}), over the limit of {limit:,} (twice "
        "PIL.Image.MAX_IMAGE_PIXELS, Pillow's decompression-bomb guard); if the image is genuine, raise it: "
        f"PIL.Image.MAX_IMAGE_PIXELS in Python (None: no limit), {PIXELS_ENV}=<pixels> or none for dali-fast"
    )


def apply_pixel_limit_env() -> None:
    """Set the pixel limit from ``$DALI_FAST_MAX_PIXELS`` (a number of pixels, or ``none``), where set: the
    dali-fast command's way to raise it (a script sets ``PIL.Image.MAX_IMAGE_PIXELS`` itself)."""
    text = os.environ.get(PIXELS_ENV)
    if text is None:
        return
    from PIL import Image

    if text.strip().lower() == "none":
        Image.MAX_IMAGE_PIXELS = None
        return
    try:
        most = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        most = 0
    if most < 1:
        raise ValueError(f"{PIXELS_ENV}={text!r}: give the most pixels an image may have, e.g. 250000000, or none")
    Image.MAX_IMAGE_PIXELS = (most + 1) // 2  # Pillow refuses above twice its value


def check_index(i: int, n: int) -> int:
    """Record ``i`` of a data set of ``n`` records as an index in ``range(n)`` (negative ones count from
    the end), or an `IndexError` naming both."""
    j = int(i)
    if j < 0:
        j += n
    if not 0 <= j < n:
        raise IndexError(f"record {i} out of range for a data set of {n} records")
    return j


def check_encoded(data: np.ndarray | bytes) -> str | None:
    """Structural check of an encoded image; returns the reason it is bad, or None.

    Catches what would otherwise kill a DALI pipeline, without decoding: empty records, bytes
    that are not JPEG/PNG, a broken JPEG marker structure or PNG chunk structure, and truncation
    (no end-of-image marker after the JPEG's first scan, no PNG IEND chunk). Data after the end
    of the image (phones' motion photos, editors' trailers) is allowed, as decoders allow it.

    It reads the headers, not the compressed image: the JPEG's end-of-image marker is looked for
    from the end, where a whole image has it. ``bytes`` are read in place; an array or another
    buffer is walked in place and its scan data copied once (no search over it either way).
    """
    buf = data if isinstance(data, bytes) else memoryview(np.ascontiguousarray(data, dtype=np.uint8)).cast("B")
    if not len(buf):
        return "empty record"
    if buf[:3] == JPEG_SOI:
        return _check_jpeg(buf)
    if buf[:8] == PNG_SIGNATURE:
        return _check_png(buf)
    other = _OTHER_FORMATS.get(bytes(buf[:2]))
    if other is not None:
        return other(buf)
    return "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)"


def _check_jpeg(buf: bytes | memoryview) -> str | None:
    """Walk the marker segments to the first scan, then look for an end-of-image marker after it; the
    frame header's size is held to the pixel limit.

    Entropy-coded data cannot contain 0xFFD9 (0xFF is stuffed), and an EXIF thumbnail's own end
    marker sits inside an APP segment that the walk skips, so it cannot pass for the image's.
    The marker is searched from the end (`rfind`): at the last two bytes of a whole image, it is
    found at once, where a search from the scan's start would read the whole image.
    """
    n, pos = len(buf), 2
    size: tuple[int, int] | None = None  # (width, height) from the frame header
    while True:  # each turn moves on by 2 bytes or more, or returns: it ends, whatever the bytes say
        while pos + 1 < n and buf[pos] == 0xFF and buf[pos + 1] == 0xFF:
            pos += 1  # fill bytes
        if pos + 2 > n:
            return "truncated JPEG (ends inside its headers)"
        if buf[pos] != 0xFF:
            return f"corrupt JPEG (no marker at byte {pos})"
        marker = buf[pos + 1]
        if marker == 0xD9:
            return "corrupt JPEG (end of image before any scan)"
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if pos + 4 > n:
            return "truncated JPEG (ends inside its headers)"
        length = (buf[pos + 2] << 8) | buf[pos + 3]
        if length < 2:
            return f"corrupt JPEG (segment length {length} at byte {pos})"
        end = pos + 2 + length
        if end > n:
            return "truncated JPEG (ends inside its headers)"
        if marker in _JPEG_FRAMES and length >= 7:  # precision, height, width
            size = ((buf[pos + 7] << 8) | buf[pos + 8], (buf[pos + 5] << 8) | buf[pos + 6])
        if marker == 0xDA:  # start of scan: compressed data follows
            found = buf.rfind(JPEG_EOI, end) if isinstance(buf, bytes) else buf[end:].tobytes().rfind(JPEG_EOI)
            if found < 0:
                return "truncated JPEG (no end-of-image marker)"
            return too_many_pixels(*size, pixel_limit()) if size else None
        pos = end


def _check_png(buf: bytes | memoryview) -> str | None:
    """Walk the chunks (length, type, data, crc) to IEND; the size in IHDR is held to the pixel limit."""
    n, pos = len(buf), 8
    while pos + 12 <= n:  # each chunk moves on by 12 bytes or more
        length = int.from_bytes(buf[pos : pos + 4], "big")
        kind = bytes(buf[pos + 4 : pos + 8])
        if not kind.isalpha():
            return f"corrupt PNG (bad chunk type {kind!r} at byte {pos})"
        pos += 12 + length
        if pos > n:
            return "truncated PNG (a chunk runs past the end)"
        if kind == b"IEND":
            if buf[12:16] != b"IHDR":  # the first chunk; Pillow refuses a PNG without it
                return "corrupt PNG (no IHDR chunk first)"
            width, height = int.from_bytes(buf[16:20], "big"), int.from_bytes(buf[20:24], "big")
            return too_many_pixels(width, height, pixel_limit())
    return "truncated PNG (no IEND chunk)"


def _check_webp(buf: bytes | memoryview) -> str | None:
    """RIFF size against the bytes there are; the canvas (VP8X), lossless (VP8L) or lossy (VP8) size."""
    if len(buf) < 30 or bytes(buf[8:12]) != b"WEBP":
        return "corrupt WebP (no WEBP header)" if len(buf) >= 12 else "truncated WebP (ends inside its header)"
    if 8 + int.from_bytes(buf[4:8], "little") > len(buf):
        return "truncated WebP (its RIFF size runs past the end)"
    kind = bytes(buf[12:16])
    if kind == b"VP8X":
        size = 1 + int.from_bytes(buf[24:27], "little"), 1 + int.from_bytes(buf[27:30], "little")
    elif kind == b"VP8L":
        bits = int.from_bytes(buf[21:25], "little")
        size = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    elif kind == b"VP8 ":
        size = int.from_bytes(buf[26:28], "little") & 0x3FFF, int.from_bytes(buf[28:30], "little") & 0x3FFF
    else:
        return f"corrupt WebP (unknown first chunk {kind!r})"
    return too_many_pixels(*size, pixel_limit())


def _check_bmp(buf: bytes | memoryview) -> str | None:
    """The file size in the header against the bytes there are; the size in the info header."""
    if len(buf) < 26:
        return "truncated BMP (ends inside its header)"
    stated = int.from_bytes(buf[2:6], "little")
    if stated > len(buf):
        return f"truncated BMP ({len(buf)} of the {stated} bytes its header states)"
    width = int.from_bytes(buf[18:22], "little", signed=True)
    height = int.from_bytes(buf[22:26], "little", signed=True)  # negative: stored top-down
    return too_many_pixels(abs(width), abs(height), pixel_limit())


def _check_tiff(buf: bytes | memoryview) -> str | None:
    """The first IFD's entries, and every strip or tile it names, within the bytes there are (a cut TIFF
    loses strips); its width and height against the pixel limit."""
    order = "little" if bytes(buf[:2]) == b"II" else "big"
    n = len(buf)
    if n < 8 or int.from_bytes(buf[2:4], order) != 42:
        return "corrupt TIFF (no TIFF header)"
    ifd = int.from_bytes(buf[4:8], order)
    if ifd + 2 > n:
        return "truncated TIFF (its first directory is past the end)"
    count = int.from_bytes(buf[ifd : ifd + 2], order)
    if ifd + 2 + 12 * count > n:
        return "truncated TIFF (ends inside its first directory)"
    tags: dict[int, list[int]] = {}
    for k in range(count):
        at = ifd + 2 + 12 * k
        tag, kind, values = (int.from_bytes(buf[at + a : at + b], order) for a, b in ((0, 2), (2, 4), (4, 8)))
        width = {3: 2, 4: 4}.get(kind)
        if width is None or tag not in (256, 257, 273, 279, 324, 325):
            continue
        where = at + 8 if width * values <= 4 else int.from_bytes(buf[at + 8 : at + 12], order)
        if where + width * values > n:
            return "truncated TIFF (a directory entry points past the end)"
        tags[tag] = [int.from_bytes(buf[where + width * j : where + width * (j + 1)], order) for j in range(values)]
    for offsets, counts in ((273, 279), (324, 325)):
        if any(o + c > n for o, c in zip(tags.get(offsets, []), tags.get(counts, []), strict=False)):
            return "truncated TIFF (its image data runs past the end)"
    return too_many_pixels(tags.get(256, [0])[0], tags.get(257, [0])[0], pixel_limit())


_PNM_TOKEN = re.compile(rb"(?:\s|#[^\n]*\n)*(\d+)")


def _check_pnm(buf: bytes | memoryview) -> str | None:
    """A binary PPM/PGM/PBM's header (magic, width, height, maxval) and its pixel bytes against the bytes
    there are; an ASCII one (P1-P3) by its header only."""
    magic = bytes(buf[1:2])  # one of 1-6: the dispatch below reaches this for P1-P6 only
    if not bytes(buf[2:3]).isspace():
        return "not an image (a P without a PBM/PGM/PPM number)"
    numbers, pos = [], 2
    for _ in range(2 if magic in b"14" else 3):
        # Over the whole buffer: a header's comments may run to any length (Pillow reads them all).
        m = _PNM_TOKEN.match(buf, pos)
        if m is None:
            return "corrupt PPM/PGM (its header is not width, height and maxval)"
        numbers.append(int(m.group(1)))
        pos = m.end()
    width, height = numbers[0], numbers[1]
    if magic in b"456":
        wide = 2 if magic != b"4" and numbers[2] > 255 else 1
        row = -(-width // 8) if magic == b"4" else width * (3 if magic == b"6" else 1) * wide
        if pos + 1 + row * height > len(buf):
            return f"truncated PPM/PGM ({len(buf)} bytes, its header needs {pos + 1 + row * height})"
    return too_many_pixels(width, height, pixel_limit())


# The other image formats an ImageFolder may hold (torchvision's extensions), by their first two bytes.
_OTHER_FORMATS = {
    b"RI": _check_webp,
    b"BM": _check_bmp,
    b"II": _check_tiff,
    b"MM": _check_tiff,
    **{b"P" + d: _check_pnm for d in (b"1", b"2", b"3", b"4", b"5", b"6")},
}


def pillow_reason(error: BaseException, name: str | None = None) -> str:
    """Why Pillow could not read a record: Pillow's `<_io.BytesIO object at 0x…>` stand-in for the file
    replaced by ``name``, or left out when the message names the record already."""
    text = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", f" {name}" if name else "", str(error))
    return f"undecodable: {type(error).__name__}: {text}"


def check_label(label: int, classes: int) -> str | None:
    """Why ``label`` is not a class index of a data set with ``classes`` classes, or None."""
    if 0 <= label < classes:
        return None
    if classes == 1:
        return f"label {label} is not the data set's one class (0)"
    return f"label {label} is not one of the data set's {classes} classes (0..{classes - 1})"
