"""The structural checks of a record (JPEG markers, PNG chunks, truncation) and the reasons they give."""

import io
import zlib

import numpy as np
import pytest
from builders import APP0, EOI, SOI, SOS, jpeg_bytes, jpeg_segment

from dali_fast.data.checks import check_encoded, check_index


def test_check_encoded():
    good = jpeg_bytes()
    assert check_encoded(good) is None
    assert check_encoded(np.frombuffer(good, np.uint8)) is None
    assert "empty" in check_encoded(b"")
    assert "truncated JPEG" in check_encoded(good[:-200])
    assert "not an image (unknown signature" in check_encoded(b"hello world")
    from builders import png_bytes

    png = png_bytes()
    assert check_encoded(png) is None
    assert "truncated PNG" in check_encoded(png[:-20])


@pytest.mark.parametrize(
    "data, reason",
    [
        (SOI + APP0 + SOS + b"\x12\x34" + EOI, None),
        (SOI + APP0 + b"\xff\xff\xff" + SOS + b"\x12" + EOI, None),  # fill bytes before a marker
        (SOI + b"\xff\x01" + b"\xff\xd0" + APP0 + SOS + EOI, None),  # TEM, RST0: markers without a length
        (SOI + APP0 + SOS + b"\x12\x34" + EOI + b"trailer" * 300, None),  # data after the image
        (SOI + jpeg_segment(0xE1, bytes(300)) + SOS + b"\x12" + EOI, None),  # a segment of 256 bytes or more
        (SOI + b"\xff\xe0\x00\x02" + SOS + EOI, None),  # the shortest segment: its length field only
        (SOI + jpeg_segment(0xE1, b"Exif" + SOI + EOI) + SOS + b"\x12", "truncated JPEG (no end-of-image marker)"),
        (SOI + APP0 + SOS + b"\x12\x34", "truncated JPEG (no end-of-image marker)"),
        (SOI + APP0 + b"\xff\xda\x00\x02", "truncated JPEG (no end-of-image marker)"),  # ends at the scan
        (SOI + APP0 + EOI, "corrupt JPEG (end of image before any scan)"),
        (SOI + APP0 + b"\x00\x11" + SOS + EOI, f"corrupt JPEG (no marker at byte {2 + len(APP0)})"),
        (SOI + b"\xff\xe0\x00\x01" + SOS + EOI, "corrupt JPEG (segment length 1 at byte 2)"),
        (SOI + b"\xff\xe0\x00\x40abc", "truncated JPEG (ends inside its headers)"),
        (SOI + b"\xff\xe0\x00", "truncated JPEG (ends inside its headers)"),
        (SOI + b"\xff", "truncated JPEG (ends inside its headers)"),
        (SOI + APP0, "truncated JPEG (ends inside its headers)"),
    ],
)
def test_jpeg_structure_check(data, reason):
    assert check_encoded(data) == reason


def _chunk(kind: bytes, body: bytes = b"") -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


PNG_SIG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "data, reason",
    [
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + _chunk(b"IDAT", b"xx") + _chunk(b"IEND"), None),
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + _chunk(b"IEND") + b"trailer", None),
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + _chunk(b"IDAT", b"xx"), "truncated PNG (no IEND chunk)"),
        (PNG_SIG + _chunk(b"IHDR", bytes(13))[:-3], "truncated PNG (a chunk runs past the end)"),
        (PNG_SIG + _chunk(b"IHDR", bytes(13)) + bytes(11), "truncated PNG (no IEND chunk)"),
        (PNG_SIG + _chunk(b"IDAT", b"x" * 40)[:30] + _chunk(b"IEND"), "truncated PNG (a chunk runs past the end)"),
        (PNG_SIG + _chunk(b"ID1T", b"x") + _chunk(b"IEND"), "corrupt PNG (bad chunk type b'ID1T' at byte 8)"),
        (PNG_SIG, "truncated PNG (no IEND chunk)"),
    ],
)
def test_png_structure_check(data, reason):
    assert check_encoded(data) == reason


def test_check_encoded_takes_every_buffer_kind():
    good = jpeg_bytes()
    for form in (good, bytearray(good), memoryview(good), np.frombuffer(good, np.uint8)):
        assert check_encoded(form) is None
    assert check_encoded(np.zeros(0, np.uint8)) == "empty record"
    assert check_encoded(b"\xff\xd8\x00rest") == "not an image (unknown signature: not JPEG, PNG, WebP, BMP, TIFF, PPM or PGM)"


def test_pillow_reasons_name_the_error_not_a_buffer():
    from PIL import Image, UnidentifiedImageError

    from dali_fast.data.checks import pillow_reason

    try:
        Image.open(io.BytesIO(b"junk"))
    except UnidentifiedImageError as e:
        assert pillow_reason(e) == "undecodable: UnidentifiedImageError: cannot identify image file"
        assert pillow_reason(e, "a/x.jpg") == "undecodable: UnidentifiedImageError: cannot identify image file a/x.jpg"
    assert pillow_reason(OSError("broken data stream")) == "undecodable: OSError: broken data stream"


def test_check_encoded_gives_one_verdict_for_bytes_arrays_and_views():
    """Bytes are searched in place, other buffers walked in place and their scan copied once: the same answer."""
    import odd_images

    cases = {**odd_images.odd_valid(), **odd_images.corrupt()}
    cases["two_images"] = odd_images.good_jpeg() + odd_images.good_jpeg()[:-2]  # an EOI inside, none at the end
    cases["thumbnail_eoi_only"] = SOI + jpeg_segment(0xE1, b"Exif" + SOI + EOI) + SOS + b"\x12\x34"
    for name, data in cases.items():
        verdict = check_encoded(data)
        big = np.frombuffer(b"\x00" * 7 + data + b"\x00" * 5, np.uint8)[7 : 7 + len(data)]  # a view inside a buffer
        for form in (np.frombuffer(data, np.uint8), big, memoryview(data), bytearray(data)):
            assert check_encoded(form) == verdict, name
    assert check_encoded(cases["two_images"]) is None  # the first image's EOI follows the first scan
    assert check_encoded(cases["thumbnail_eoi_only"]) == "truncated JPEG (no end-of-image marker)"


def test_check_index_counts_negatives_from_the_end_and_names_both_numbers():
    assert [check_index(i, 5) for i in (0, 4, -1, -5)] == [0, 4, 4, 0]
    for i in (5, -6):
        with pytest.raises(IndexError, match=rf"^record {i} out of range for a data set of 5 records$"):
            check_index(i, 5)
