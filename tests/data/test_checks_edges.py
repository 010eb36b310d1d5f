"""The structural check at its edges: the shortest frame header that still names a size is held to the
pixel limit, and the limit counts an image one pixel thin as one pixel, not two."""

from __future__ import annotations

import PIL.Image
import pytest
from builders import APP0, EOI, SOI, SOS, jpeg_segment

from dali_fast.data.checks import check_encoded, too_many_pixels


def frame(width: int, height: int, extra: bytes = b"") -> bytes:
    """A SOF0 segment: precision 8, then height and width (and ``extra``, the components, if any)."""
    return jpeg_segment(0xC0, bytes([8, height >> 8, height & 255, width >> 8, width & 255]) + extra)


@pytest.mark.parametrize("extra", [b"", b"\x01", b"\x01\x01\x11\x00"])  # segment lengths 7, 8, 11
def test_a_frame_header_that_names_a_size_is_held_to_the_limit(monkeypatch, extra):
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)  # the limit: twice that
    small, large = (SOI + APP0 + frame(w, h, extra) + SOS + b"\x12" + EOI for w, h in ((10, 10), (20, 10)))
    assert check_encoded(small) is None
    assert check_encoded(large).startswith("20x10 pixels (200), over the limit of 100 (twice PIL.Image.MAX_IMAGE")


def test_the_limit_counts_pixels_as_they_are():
    assert too_many_pixels(1, 10, 10) is None and too_many_pixels(10, 1, 10) is None
    assert too_many_pixels(0, 10, 10) is None and too_many_pixels(11, 1, 10).startswith("11x1 pixels (11), over")
    assert too_many_pixels(10**6, 10**6, None) is None


def test_markers_without_a_length_in_the_headers_are_walked_past_to_the_scan():
    """TEM and RST markers carry no length: the walk steps over them and goes on to the scan, so a cut
    after them is still found (it did not stop at them and call the record whole)."""
    for standalone in (b"\xff\x01", b"\xff\xd0", b"\xff\xd7"):
        whole = SOI + APP0 + standalone + frame(10, 10) + SOS + b"\x12"
        assert check_encoded(whole + EOI) is None
        assert check_encoded(whole) == "truncated JPEG (no end-of-image marker)"
        assert check_encoded(SOI + standalone + b"\x00\x00") == "corrupt JPEG (no marker at byte 4)"
