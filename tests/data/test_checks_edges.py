"""The structural check at its edges: the shortest frame header that still names a size is held to the
pixel limit, and the limit counts an image one pixel thin as one pixel, not two. A TIFF (torchvision's
folder rule reads .tif): its first directory, every strip or tile it names, and its size, in both byte
orders; the files are Pillow's, or built here field by field and read back by Pillow, so that each cut
lands where the layout says."""

from __future__ import annotations

import io
import struct

import numpy as np
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


# ------------------------------------------------------------------------------------------------ TIFF

NO_HEADER = "corrupt TIFF (no TIFF header)"
NO_DIRECTORY = "truncated TIFF (its first directory is past the end)"
IN_DIRECTORY = "truncated TIFF (ends inside its first directory)"
ENTRY = "truncated TIFF (a directory entry points past the end)"
DATA = "truncated TIFF (its image data runs past the end)"
SHORT, LONG, RATIONAL, ASCII = 3, 4, 5, 2


def tiff(order: str, pixels: np.ndarray, *, tile: int = 0, size_kind: int = SHORT, extra=()) -> tuple[bytes, dict]:
    """A grey 8-bit TIFF of ``pixels``, uncompressed: header, the first directory at byte 8, the values that
    do not fit an entry, then the strips (a row each) or the square tiles of side ``tile``. ``extra``:
    more (tag, kind, count, value bytes) entries. Returns the bytes and where each part starts."""
    e = "<" if order == "II" else ">"
    h, w = pixels.shape
    if tile:
        pieces = [pixels[y : y + tile, x : x + tile].tobytes() for y in range(0, h, tile) for x in range(0, w, tile)]
    else:
        pieces = [pixels[y].tobytes() for y in range(h)]
    counts = [len(p) for p in pieces]
    entries = [
        (256, size_kind, 1, struct.pack(e + ("H" if size_kind == SHORT else "I"), w)),
        (257, size_kind, 1, struct.pack(e + ("H" if size_kind == SHORT else "I"), h)),
        (258, SHORT, 1, struct.pack(e + "H", 8)),
        (259, SHORT, 1, struct.pack(e + "H", 1)),
        (262, SHORT, 1, struct.pack(e + "H", 1)),
        (277, SHORT, 1, struct.pack(e + "H", 1)),
        *extra,
    ]
    offsets_tag, counts_tag = (324, 325) if tile else (273, 279)
    if tile:
        entries += [(322, SHORT, 1, struct.pack(e + "H", tile)), (323, SHORT, 1, struct.pack(e + "H", tile))]
    else:
        entries += [(278, SHORT, 1, struct.pack(e + "H", 1))]
    n_entries = len(entries) + 2
    directory_end = 8 + 2 + 12 * n_entries + 4
    # after the directory: the offsets array, the counts array, the other values over 4 bytes, the data
    offsets_at, counts_at = directory_end, directory_end + 4 * len(pieces)
    data_at = counts_at + 4 * len(pieces) + sum(len(v) for *_, v in extra if len(v) > 4)
    offsets = [data_at + sum(counts[:i]) for i in range(len(pieces))]
    entries += [
        (offsets_tag, LONG, len(pieces), struct.pack(e + "I" * len(pieces), *offsets)),
        (counts_tag, LONG, len(pieces), struct.pack(e + "I" * len(pieces), *counts)),
    ]
    entries.sort(key=lambda t: t[0])
    head = order.encode() + struct.pack(e + "HI", 42, 8)
    table, values, next_value = b"", b"", counts_at + 4 * len(pieces)
    for tag, kind, count, value in entries:
        if len(value) <= 4:
            field = value.ljust(4, b"\0")
        else:
            where = {offsets_tag: offsets_at, counts_tag: counts_at}.get(tag)
            if where is None:
                where, next_value = next_value, next_value + len(value)
                values += value
            field = struct.pack(e + "I", where)
        table += struct.pack(e + "HHI", tag, kind, count) + field
    body = head + struct.pack(e + "H", n_entries) + table + b"\0\0\0\0"
    assert len(body) == directory_end
    body += struct.pack(e + "I" * len(pieces), *offsets) + struct.pack(e + "I" * len(pieces), *counts) + values
    assert len(body) == data_at
    return body + b"".join(pieces), {"directory_end": directory_end, "data": data_at, "n_entries": n_entries}


def grey(h: int = 6, w: int = 5) -> np.ndarray:
    return ((np.arange(h * w).reshape(h, w) * 7) % 251).astype(np.uint8)


@pytest.mark.parametrize("order", ["II", "MM"])
@pytest.mark.parametrize("tile", [0, 16])
def test_the_built_files_are_tiffs_pillow_reads_pixel_for_pixel(order, tile):
    pixels = grey(32, 32) if tile else grey()
    data, _ = tiff(order, pixels, tile=tile)
    assert np.array_equal(np.asarray(PIL.Image.open(io.BytesIO(data))), pixels)
    assert check_encoded(data) is None


@pytest.mark.parametrize("order", ["II", "MM"])
@pytest.mark.parametrize("tile", [0, 16])
def test_a_tiff_cut_anywhere_is_named_by_where_the_cut_fell(order, tile):
    """Every cut from the header to the last pixel byte: the reason is that of the part the cut fell in."""
    data, at = tiff(order, grey(32, 32) if tile else grey(), tile=tile)
    entries_end = 10 + 12 * at["n_entries"]
    for cut in range(2, len(data)):
        if cut < 8:
            want = NO_HEADER
        elif cut < 10:
            want = NO_DIRECTORY
        elif cut < entries_end:
            want = IN_DIRECTORY
        elif cut < at["data"]:
            want = ENTRY  # the offsets and counts arrays lie past the cut
        else:
            want = DATA
        assert check_encoded(data[:cut]) == want, (cut, at)


def test_pillow_s_own_tiff_passes_whole_and_is_named_cut_anywhere():
    """Pillow's layout: the directory at byte 8, the bits per sample outside it, then the one strip."""
    rgb = np.dstack([grey(40, 30), grey(40, 30)[::-1], grey(40, 30)[:, ::-1]])
    out = io.BytesIO()
    PIL.Image.fromarray(rgb).save(out, "TIFF")
    data = out.getvalue()
    assert data[:2] == b"II" and int.from_bytes(data[4:8], "little") == 8 and check_encoded(data) is None
    entries_end = 10 + 12 * int.from_bytes(data[8:10], "little")
    for cut in range(2, len(data)):
        want = NO_HEADER if cut < 8 else NO_DIRECTORY if cut < 10 else IN_DIRECTORY if cut < entries_end else DATA
        assert check_encoded(data[:cut]) == want, cut


def test_a_bad_magic_number_and_a_short_file_have_no_header():
    data, _ = tiff("II", grey())
    assert check_encoded(data[:2] + b"\x2b\x00" + data[4:]) == NO_HEADER  # BigTIFF's 43: not read here
    assert check_encoded(b"MM\x00\x2a\x00\x00\x00") == NO_HEADER
    assert check_encoded(b"MM\x00\x2a\x00\x00\x00\x08") == NO_DIRECTORY


@pytest.mark.parametrize("order", ["II", "MM"])
@pytest.mark.parametrize("size_kind", [SHORT, LONG])
def test_the_size_is_held_to_the_pixel_limit_read_as_short_or_long(monkeypatch, order, size_kind):
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)  # the limit: twice that
    small, _ = tiff(order, grey(10, 10), size_kind=size_kind)
    wide, _ = tiff(order, grey(5, 21), size_kind=size_kind)
    tall, _ = tiff(order, grey(21, 5), size_kind=size_kind)
    assert check_encoded(small) is None
    assert check_encoded(wide).startswith("21x5 pixels (105), over the limit of 100")
    assert check_encoded(tall).startswith("5x21 pixels (105), over the limit of 100")


def _set_entry(data: bytes, n_entries: int, tag: int, **fields: int) -> bytes:
    """``data`` with the first directory's entry for ``tag`` changed: its tag (``retag``), ``kind`` or ``value``."""
    out = bytearray(data)
    for k in range(n_entries):
        pos = 10 + 12 * k
        if int.from_bytes(out[pos : pos + 2], "little") == tag:
            for name, (a, b) in {"retag": (0, 2), "kind": (2, 4), "value": (8, 12)}.items():
                if name in fields:
                    out[pos + a : pos + b] = fields[name].to_bytes(b - a, "little")
            return bytes(out)
    raise AssertionError(f"no entry {tag}")


def test_entries_of_other_tags_or_kinds_are_not_followed(monkeypatch):
    """A description whose text lies past the end, or a width of a kind the check does not read (RATIONAL)
    pointing past the end, neither stops a whole file nor counts as its size."""
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)  # the limit: twice that
    text = (270, ASCII, 40, b"a description of forty bytes, no less...")
    data, at = tiff("II", grey(5, 25), extra=[text])
    assert check_encoded(data).startswith("25x5 pixels (125), over the limit of 100")
    assert check_encoded(_set_entry(data, at["n_entries"], 270, value=len(data) + 100)).startswith("25x5 pixels")
    odd = _set_entry(data, at["n_entries"], 256, kind=RATIONAL, value=len(data) + 100)
    assert check_encoded(odd) is None  # no width read: 1 x 5 pixels, within the limit
    for kind in (1, 2, 5, 6, 7, 8, 9, 10, 11, 12):
        assert check_encoded(_set_entry(data, at["n_entries"], 256, kind=kind)) is None, kind


def test_a_tiff_without_a_width_or_height_is_not_refused_for_its_size(monkeypatch):
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)
    data, at = tiff("II", grey(30, 30))
    for tag in (256, 257):
        alone = _set_entry(data, at["n_entries"], tag, retag=65000)  # a private tag now
        assert check_encoded(alone) is None, tag
    assert check_encoded(data).startswith("30x30 pixels (900), over the limit of 100")


def test_strip_arrays_of_two_lengths_are_checked_pair_by_pair_not_raised():
    """A directory whose StripByteCounts lists fewer strips than StripOffsets: the pairs there are are
    checked (the decoder names what is wrong with the rest); the check itself never raises."""
    data, at = tiff("II", grey(6, 5))
    short = bytearray(data)
    for k in range(at["n_entries"]):
        pos = 10 + 12 * k
        if int.from_bytes(short[pos : pos + 2], "little") == 279:
            short[pos + 4 : pos + 8] = (5).to_bytes(4, "little")  # 5 counts for 6 strips
    assert check_encoded(bytes(short)) is None
    assert check_encoded(bytes(short[:-1])) is None  # the last strip has no count: nothing to hold it to
    assert check_encoded(bytes(short[:-6])) == DATA  # the fifth strip, which has one, is cut


# ---------------------------------------------------------------------------------- WebP, BMP, PPM/PGM


def _saved(image: PIL.Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kw)
    return out.getvalue()


def _wide(channels: int = 3) -> np.ndarray:
    """21 x 5 pixels: one side past the limit of 100 pixels the tests set, the other within it."""
    return (np.arange(5 * 21 * channels).reshape(5, 21, channels) % 251).astype(np.uint8).squeeze()


def _webps() -> dict[str, bytes]:
    """Pillow's three WebP layouts: lossless (VP8L), lossy (VP8), and with an alpha channel (VP8X)."""
    rgb = PIL.Image.fromarray(_wide())
    return {
        "VP8L": _saved(rgb, "WEBP", lossless=True),
        "VP8 ": _saved(rgb, "WEBP", quality=80),
        "VP8X": _saved(PIL.Image.fromarray(_wide(4), "RGBA"), "WEBP", quality=80),
    }


@pytest.mark.parametrize("kind", ["VP8L", "VP8 ", "VP8X"])
def test_a_webp_s_size_is_read_from_each_layout_and_a_cut_is_named(monkeypatch, kind):
    data = _webps()[kind]
    assert data[12:16] == kind.encode() and PIL.Image.open(io.BytesIO(data)).size == (21, 5)
    assert check_encoded(data) is None
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)  # the limit: twice that
    assert check_encoded(data).startswith("21x5 pixels (105), over the limit of 100")
    for cut in range(2, len(data)):
        want = (
            "truncated WebP (ends inside its header)" if cut < 12
            else "corrupt WebP (no WEBP header)" if cut < 30
            else "truncated WebP (its RIFF size runs past the end)"
        )  # fmt: skip
        assert check_encoded(data[:cut]) == want, cut


def test_a_lossy_webp_s_scale_bits_are_not_its_size_and_odd_chunks_are_named(monkeypatch):
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)
    data = bytearray(_webps()["VP8 "])
    data[27] |= 0xC0  # the width's upscaling bits
    data[29] |= 0xC0  # the height's
    assert check_encoded(bytes(data)).startswith("21x5 pixels (105), over the limit of 100")
    other = bytes(data[:12]) + b"ALPH" + bytes(data[16:])
    assert check_encoded(other) == "corrupt WebP (unknown first chunk b'ALPH')"
    assert check_encoded(bytes(data[:8]) + b"WAVE" + bytes(data[12:])) == "corrupt WebP (no WEBP header)"


def test_a_lossless_webp_reads_both_14_bit_sides(monkeypatch):
    """VP8L packs width - 1 and height - 1 in 14 bits each: a 16383 x 3 side read whole, not masked off."""
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 10**5)
    data = bytearray(_webps()["VP8L"])
    bits = int.from_bytes(data[21:25], "little")
    data[21:25] = ((bits & ~0xFFFFFFF) | 16383 | (2 << 14)).to_bytes(4, "little")
    assert check_encoded(bytes(data)) is None  # 49152 pixels, within 200000
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 20000)
    assert check_encoded(bytes(data)).startswith("16384x3 pixels (49,152), over the limit of 40,000")


def test_a_bmp_s_stated_size_and_its_sides_either_way_up(monkeypatch):
    data = _saved(PIL.Image.fromarray(_wide()), "BMP")
    stated = int.from_bytes(data[2:6], "little")
    assert stated == len(data) and check_encoded(data) is None
    for cut in range(2, len(data)):
        want = "truncated BMP (ends inside its header)" if cut < 26 else f"truncated BMP ({cut} of the {stated} bytes its header states)"
        assert check_encoded(data[:cut]) == want, cut
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)
    assert check_encoded(data).startswith("21x5 pixels (105), over the limit of 100")
    top_down = data[:22] + (-5).to_bytes(4, "little", signed=True) + data[26:]
    assert check_encoded(top_down).startswith("21x5 pixels (105), over the limit of 100")
    flipped = data[:18] + (-21).to_bytes(4, "little", signed=True) + data[22:]
    assert check_encoded(flipped).startswith("21x5 pixels (105), over the limit of 100")


def _pnms() -> dict[str, bytes]:
    """Pillow's binary PPM and PGM (8 and 16 bits) and PBM."""
    rgb = PIL.Image.fromarray(_wide())
    sixteen = PIL.Image.fromarray((np.arange(105).reshape(5, 21) * 600).astype(np.uint16))
    return {
        "P6": _saved(rgb, "PPM"),
        "P5": _saved(rgb.convert("L"), "PPM"),
        "P5 16-bit": _saved(sixteen, "PPM"),
        "P4": _saved(rgb.convert("1"), "PPM"),
    }


@pytest.mark.parametrize("kind", ["P6", "P5", "P5 16-bit", "P4"])
def test_a_binary_pnm_needs_every_pixel_byte_its_header_names(monkeypatch, kind):
    data = _pnms()[kind]
    assert data[:2] == kind[:2].encode() and PIL.Image.open(io.BytesIO(data)).size == (21, 5)
    assert check_encoded(data) is None
    header = len(data) - {"P6": 21 * 3, "P5": 21, "P5 16-bit": 42, "P4": 3}[kind] * 5
    for cut in range(header, len(data)):
        assert check_encoded(data[:cut]) == f"truncated PPM/PGM ({cut} bytes, its header needs {len(data)})", cut
    for cut in range(3, header - 1):
        assert check_encoded(data[:cut]) is not None, cut  # a header cut short names some fault
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)
    assert check_encoded(data).startswith("21x5 pixels (105), over the limit of 100")


def test_pnm_headers_with_comments_ascii_kinds_and_what_is_not_one(monkeypatch):
    commented = b"P5\n# written by hand\n3 # width\n2\n255\n" + bytes(6)
    assert np.asarray(PIL.Image.open(io.BytesIO(commented))).shape == (2, 3)
    assert check_encoded(commented) is None
    assert check_encoded(commented[:-1]) == f"truncated PPM/PGM ({len(commented) - 1} bytes, its header needs {len(commented)})"
    long_comment = b"P5\n#" + b"x" * 1000 + b"\n2 1\n255\n\x01\x02"  # a header past any fixed window
    assert np.asarray(PIL.Image.open(io.BytesIO(long_comment))).tolist() == [[1, 2]]
    assert check_encoded(long_comment) is None and check_encoded(memoryview(long_comment)) is None
    assert check_encoded(long_comment[:-1]) == f"truncated PPM/PGM ({len(long_comment) - 1} bytes, its header needs {len(long_comment)})"
    ascii_ppm = b"P3\n2 1\n255\n1 2 3 4 5 6\n"
    assert np.asarray(PIL.Image.open(io.BytesIO(ascii_ppm))).shape == (1, 2, 3)
    assert check_encoded(ascii_ppm) is None and check_encoded(ascii_ppm[:-4]) is None  # its header only
    assert check_encoded(b"P1\n4 2\n0 1 0 1\n1 0 1 0\n") is None  # a bitmap: no maxval
    not_one = "not an image (a P without a PBM/PGM/PPM number)"
    assert [check_encoded(b) for b in (b"P6x3 2 255\n", b"P6")] == [not_one] * 2
    assert check_encoded(b"P7\nWIDTH 2\n").startswith("not an image (unknown signature")  # PAM: not torchvision's
    assert check_encoded(b"P6\n3 two 255\n") == "corrupt PPM/PGM (its header is not width, height and maxval)"
    assert check_encoded(b"P4\n3\n") == "corrupt PPM/PGM (its header is not width, height and maxval)"
    assert check_encoded(b"P4\n9 2\n" + bytes(4)) is None  # 9 pixels a row: 2 bytes
    assert check_encoded(b"P4\n9 2\n" + bytes(3)) == "truncated PPM/PGM (10 bytes, its header needs 11)"
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 50)
    assert check_encoded(b"P3\n21 5\n255\n").startswith("21x5 pixels (105), over the limit of 100")
    assert check_encoded(b"P5\n5 21\n255\n" + bytes(105)).startswith("5x21 pixels (105), over the limit of 100")


def test_a_bmp_s_reserved_bytes_are_not_its_size_and_pnm_edges():
    """Bytes 6-9 of a BMP are reserved (some writers put their own data there): not part of the file size.
    A PGM header of its magic and one space only names no size; a maxval of 256 means two bytes a sample."""
    data = bytearray(_saved(PIL.Image.fromarray(_wide()), "BMP"))
    data[6:10] = b"\x07\x00\x09\x00"
    assert check_encoded(bytes(data)) is None
    assert check_encoded(b"P6\n") == "corrupt PPM/PGM (its header is not width, height and maxval)"
    assert check_encoded(b"P5 ") == "corrupt PPM/PGM (its header is not width, height and maxval)"
    sixteen = b"P5\n3 2\n256\n" + bytes(12)
    assert check_encoded(sixteen) is None
    assert check_encoded(sixteen[:-1]) == f"truncated PPM/PGM ({len(sixteen) - 1} bytes, its header needs {len(sixteen)})"
    eight = b"P5\n3 2\n255\n" + bytes(6)
    assert check_encoded(eight) is None and check_encoded(eight[:-1]) is not None
