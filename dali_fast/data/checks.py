"""Checks of one record that cost O(1) or a walk of its headers, never a decode: what a bad record
would break first (a DALI pipeline dies on a JPEG it cannot parse), each verdict a reason in words."""

from __future__ import annotations

import re

import numpy as np

JPEG_SOI, JPEG_EOI = b"\xff\xd8\xff", b"\xff\xd9"  # a JPEG's first three bytes; its end-of-image marker
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # a PNG's last chunk: length 0, type IEND, its crc
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0-7: markers without a length
JPEG_SOI_BYTES, JPEG_EOI_BYTES = np.frombuffer(JPEG_SOI, np.uint8), np.frombuffer(JPEG_EOI, np.uint8)
PNG_SIGNATURE_BYTES, PNG_IEND_BYTES = np.frombuffer(PNG_SIGNATURE, np.uint8), np.frombuffer(PNG_IEND, np.uint8)
QUICK_MIN = 20  # bytes: records shorter (no real image is) get the full check instead of the quick look


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
    return "not a JPEG or PNG (unknown signature)"


def _check_jpeg(buf: bytes | memoryview) -> str | None:
    """Walk the marker segments to the first scan, then look for an end-of-image marker after it.

    Entropy-coded data cannot contain 0xFFD9 (0xFF is stuffed), and an EXIF thumbnail's own end
    marker sits inside an APP segment that the walk skips, so it cannot pass for the image's.
    The marker is searched from the end (`rfind`): at the last two bytes of a whole image, it is
    found at once, where a search from the scan's start would read the whole image.
    """
    n, pos = len(buf), 2
    for _ in range(n):  # each segment moves on by 2 bytes or more: bounded, whatever the bytes say
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
        if marker == 0xDA:  # start of scan: compressed data follows
            found = buf.rfind(JPEG_EOI, end) if isinstance(buf, bytes) else buf[end:].tobytes().rfind(JPEG_EOI)
            return None if found >= 0 else "truncated JPEG (no end-of-image marker)"
        pos = end
    return "truncated JPEG (no scan)"


def _check_png(buf: bytes | memoryview) -> str | None:
    """Walk the chunks (length, type, data, crc) to IEND."""
    n, pos = len(buf), 8
    for _ in range(n):  # each chunk moves on by 12 bytes or more: bounded
        if pos + 12 > n:
            return "truncated PNG (no IEND chunk)"
        length = int.from_bytes(buf[pos : pos + 4], "big")
        kind = bytes(buf[pos + 4 : pos + 8])
        if not kind.isalpha():
            return f"corrupt PNG (bad chunk type {kind!r} at byte {pos})"
        pos += 12 + length
        if pos > n:
            return "truncated PNG (a chunk runs past the end)"
        if kind == b"IEND":
            return None
    return "truncated PNG (no IEND chunk)"


def pillow_reason(error: BaseException) -> str:
    """Why Pillow could not read a record, without Pillow's `<_io.BytesIO object at 0x…>` stand-in for its name."""
    text = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the record", str(error))
    return f"undecodable: {type(error).__name__}: {text}"


def check_label(label: int, classes: int) -> str | None:
    """Why ``label`` is not a class index of a data set with ``classes`` classes, or None."""
    if 0 <= label < classes:
        return None
    return f"label {label} is not one of the data set's {classes} classes (0..{classes - 1})"
