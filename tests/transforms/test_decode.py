"""The decoding rule and its fast JPEG path: which files take it, and that it gives Pillow's pixels."""

from __future__ import annotations

import io

import numpy as np
import odd_images
import pytest
from builders import jpeg_bytes
from PIL import Image

from dali_fast.transforms.decode import CorruptJpeg, Decoder, decode_rgb, fast_path_header, jpeg_header, reduction

pytest.importorskip("simplejpeg")

FAST = ("plain", "gray_jpeg", "progressive_jpeg", "trailing_data_jpeg", "exif_rotated")
GENERAL = ("gray16_png", "rgb_png", "cmyk_jpeg", "alpha_png", "palette_png")


def photo_like(w: int, h: int, seed: int = 0, **save) -> bytes:
    """A JPEG with detail at every scale (noise over gradients), so decoders and scales differ if they can."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), (x ^ y) & 255], -1)
    px = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


def test_the_header_walk_reads_size_components_and_orientation():
    odd = odd_images.odd_valid()
    plain = jpeg_header(odd["plain"])
    assert (plain.width, plain.height, plain.components, plain.precision, plain.orientation) == (64, 48, 3, 8, 1)
    rotated = jpeg_header(odd["exif_rotated"])
    assert (rotated.width, rotated.height, rotated.orientation) == (48, 64, 6)  # as stored; shown turned
    assert jpeg_header(odd["gray_jpeg"]).components == 1
    assert jpeg_header(odd["progressive_jpeg"]).width == 64
    assert jpeg_header(odd["cmyk_jpeg"]).components == 4 and jpeg_header(odd["cmyk_jpeg"]).adobe
    assert jpeg_header(odd["rgb_png"]) is None
    assert jpeg_header(b"") is None and jpeg_header(b"\xff\xd8") is None
    assert jpeg_header(odd["plain"][:20]) is None  # cut inside the header: not this path's to judge
    # a numpy record (what readers return) reads the same as bytes
    assert jpeg_header(np.frombuffer(odd["plain"], np.uint8)) == plain


def test_a_damaged_exif_block_goes_to_the_general_path():
    exif = Image.Exif()
    exif[0x0112] = 6
    data = bytearray(jpeg_bytes(40, 30, exif=exif.tobytes()))
    at = data.index(b"Exif\0\0") + 6
    data[at : at + 2] = b"XX"  # neither II nor MM: the block cannot be read
    assert jpeg_header(bytes(data)) is None and fast_path_header(bytes(data)) is None
    assert decode_rgb(bytes(data)).shape == (30, 40, 3)  # Pillow reads it as stored, as the rule says


def test_which_files_take_the_fast_path():
    odd = odd_images.odd_valid()
    for name in FAST:
        assert fast_path_header(odd[name]) is not None, name
    for name in GENERAL:
        assert fast_path_header(odd[name]) is None, name


@pytest.mark.parametrize("name", FAST + GENERAL)
def test_the_decoder_gives_exactly_the_rules_pixels(name):
    """Fast or general, the same pixels as `decode_rgb` (Pillow + the rule), bit for bit."""
    data = odd_images.odd_valid()[name]
    decoder = Decoder()
    opened = decoder.open(data)
    truth = decode_rgb(data)
    assert (opened.height, opened.width) == truth.shape[:2]
    np.testing.assert_array_equal(opened.decode(), truth)
    assert (decoder.fast, decoder.general) == ((1, 0) if name in FAST else (0, 1))


def test_photos_decode_bit_identical_to_pillow():
    decoder = Decoder()
    for seed, (w, h) in enumerate([(470, 370), (333, 500), (640, 480), (97, 61)]):
        data = photo_like(w, h, seed)
        np.testing.assert_array_equal(decoder.open(data).decode(), decode_rgb(data))
        progressive = photo_like(w, h, seed, progressive=True)
        np.testing.assert_array_equal(decoder.open(progressive).decode(), decode_rgb(progressive))
    assert decoder.fast == 8 and decoder.general == 0


@pytest.mark.parametrize(
    ("size", "need", "k"),
    [
        ((1000, 800), (100, 80), 4),
        ((1000, 800), (250, 200), 2),
        ((1000, 800), (251, 200), 1),
        ((4000, 3000), (224, 224), 4),
        ((4000, 3000), (224, 168), 8),
        ((470, 370), (224, 224), 1),
        ((470, 370), (600, 500), 1),
    ],
)
def test_reduction_is_pillows_draft_rule(size, need, k):
    assert reduction(*size, need) == k
    data = photo_like(*size)
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", (2 * need[0], 2 * need[1]))
        assert im.size == (-(-size[0] // k), -(-size[1] // k))  # what Pillow decodes at


@pytest.mark.parametrize("need", [(100, 80), (60, 40), (20, 15)])
def test_scaled_decode_matches_pillows_draft_decode(need):
    data = photo_like(1000, 800, 3)
    opened = Decoder().open(data)
    got = opened.decode(need)
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", (2 * need[0], 2 * need[1]))
        ref = np.asarray(im.convert("RGB"))
    assert got.shape == ref.shape and got.shape[0] < 800
    np.testing.assert_array_equal(got, ref)


def test_the_output_buffer_is_reused_and_huge_images_get_their_own():
    decoder = Decoder()
    a = photo_like(120, 90, 1)
    b = photo_like(100, 80, 2)
    first = decoder.open(a).decode()
    second = decoder.open(b).decode()
    assert np.shares_memory(first, second)  # one buffer, no allocation per image
    np.testing.assert_array_equal(second, decode_rgb(b))
    small = Decoder(max_buffer=1000)
    one, two = small.open(a).decode(), small.open(a).decode()
    assert not np.shares_memory(one, two) and small._buffer.size == 0  # noqa: SLF001
    np.testing.assert_array_equal(one, decode_rgb(a))


def outcome(decode, data):
    """The pixels, or the type of the error."""
    try:
        return decode(data)
    except Exception as e:  # noqa: BLE001 - the error's type is the outcome compared
        return type(e)


@pytest.mark.parametrize("name", list(odd_images.corrupt()))
def test_a_damaged_record_gets_pillows_verdict(name):
    """A JPEG the fast path cannot read goes to Pillow, whose error (or image) is the outcome, unless
    libjpeg-turbo reported damage in its data: that is `CorruptJpeg`, never Pillow's silent image."""
    data = odd_images.corrupt()[name]
    decoder = Decoder()
    ours, pillow = outcome(lambda d: decoder.open(d).decode(), data), outcome(decode_rgb, data)
    if name == "truncated_in_scan_jpeg":  # cut in its scan: "Premature end of JPEG file"
        assert ours is CorruptJpeg and pillow is OSError
    elif isinstance(pillow, np.ndarray):
        np.testing.assert_array_equal(ours, pillow)
    else:
        assert ours is pillow, (ours, pillow)
    assert decoder.fast == 0


def test_the_fallback_from_the_fast_path_is_taken():
    """These pass the header walk, so the fast decoder meets them first and hands them on."""
    corrupt = odd_images.corrupt()
    for name in ("undefined_table_jpeg", "truncated_in_scan_jpeg"):
        assert fast_path_header(corrupt[name]) is not None, name
