"""An image of more pixels than Pillow's decompression-bomb limit (a 14000 x 14000 PNG) is refused alike by
`pack`, TorchIterator and DALIIterator, from its header, with the limit and how to raise it named."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from builders import IndexReader, jpeg_bytes, make_folder
from PIL import Image

from dali_fast.data.checks import check_encoded
from dali_fast.data.format import DATA_FILE
from dali_fast.data.pack.packed import pack
from dali_fast.data.packed import MemmapReader
from dali_fast.loaders.bad_records import BadRecordError

# New names are imported in the tests that use them (see test_damaged_jpeg.py).


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bilevel_png(width: int, height: int) -> bytes:
    """A real, decodable 1-bit PNG of ``width`` x ``height`` (all black: a few KiB however large)."""
    rows = (b"\0" + bytes((width + 7) // 8)) * height
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def with_frame_size(jpeg: bytes, width: int, height: int) -> bytes:
    """``jpeg`` with its frame header saying ``width`` x ``height`` (the structure stays whole)."""
    b = bytearray(jpeg)
    sof = b.index(b"\xff\xc0")
    b[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(b)


BIG = "14000x14000 pixels (196,000,000), over the limit of 178,956,970"


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    return bilevel_png(14000, 14000)


def test_the_structural_check_refuses_a_14000_px_png_or_jpeg_naming_the_limit_and_the_fix(huge_png):
    why = check_encoded(huge_png)
    assert why == (
        f"{BIG} (twice PIL.Image.MAX_IMAGE_PIXELS, Pillow's decompression-bomb guard); if the image is "
        "genuine, raise it: PIL.Image.MAX_IMAGE_PIXELS in Python (None: no limit), "
        "DALI_FAST_MAX_PIXELS=<pixels> or none for dali-fast"
    )
    assert check_encoded(with_frame_size(jpeg_bytes(), 14000, 14000)) == why
    assert check_encoded(np.frombuffer(huge_png, np.uint8)) == why  # an array reads the same as bytes
    assert check_encoded(bilevel_png(13000, 13000)) is None  # 169,000,000: under the limit
    assert check_encoded(with_frame_size(jpeg_bytes(), 13000, 13000)) is None


def test_the_limit_follows_pillows_setting(huge_png, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert check_encoded(huge_png) is None
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses above twice it
    assert check_encoded(bilevel_png(50, 40)) is None
    assert check_encoded(bilevel_png(50, 41)).startswith("50x41 pixels (2,050), over the limit of 2,000 ")


def test_the_limit_is_pillow_s_default_when_pillow_is_not_there_yet_or_half_imported(monkeypatch):
    """Packed records are checked on the loader's read-ahead thread, which may run while the training thread
    imports Pillow for the first time: its module is in sys.modules, MAX_IMAGE_PIXELS not yet set."""
    import sys
    import types

    from dali_fast.data.checks import PILLOW_MAX_IMAGE_PIXELS, pixel_limit

    monkeypatch.setitem(sys.modules, "PIL.Image", types.ModuleType("PIL.Image"))  # mid-import
    assert pixel_limit() == 2 * PILLOW_MAX_IMAGE_PIXELS
    monkeypatch.delitem(sys.modules, "PIL.Image")  # not imported at all
    assert pixel_limit() == 2 * PILLOW_MAX_IMAGE_PIXELS
    monkeypatch.setitem(sys.modules, "PIL.Image", types.SimpleNamespace(MAX_IMAGE_PIXELS=None))
    assert pixel_limit() is None
    monkeypatch.setitem(sys.modules, "PIL.Image", types.SimpleNamespace(MAX_IMAGE_PIXELS=10))
    assert pixel_limit() == 20


@pytest.mark.parametrize("workers", [1, 2])
def test_pack_leaves_it_out_with_the_same_words(tmp_path, huge_png, workers):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(), huge_png], "b": [jpeg_bytes(30, 20)]})
    for verify in (True, False):
        dst = tmp_path / f"p{verify}{workers}"
        report = pack(src, dst, progress=False, verify=verify, workers=workers)
        assert report.skipped == [(str(src / "a" / "001.png"), check_encoded(huge_png))]
        assert report.records == 2


def test_pack_workers_keep_a_raised_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # under it: 40 x 30 = 1,200 passes, 60 x 40 not
    src = make_folder(tmp_path / "src", {"a": [bilevel_png(40, 30), bilevel_png(60, 40)]})
    report = pack(src, tmp_path / "p", progress=False, workers=2)
    assert [p for p, _ in report.skipped] == [str(src / "a" / "001.png")]


def test_a_packed_png_over_the_limit_is_refused_at_read_time(tmp_path, monkeypatch):
    """The packed reader's O(1) look reads a PNG's IHDR from its first bytes: a set packed under a higher
    limit is held to the one in force when it is read."""
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(), bilevel_png(60, 40), bilevel_png(20, 10)]})
    pack(src, tmp_path / "p", progress=False)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    _, _, bad = MemmapReader(tmp_path / "p").read_batch_checked([0, 1, 2])
    assert bad == {1: check_encoded(bilevel_png(60, 40))} and bad[1].startswith(
        "60x40 pixels (2,400), over the limit of 2,000 "
    )


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_every_loader_refuses_it_alike(huge_png, monkeypatch, backend):
    """TorchIterator and DALIIterator (which decoded it: DALI has no such guard) name it in one line, and
    skip and count it. DALI is given a small image over a lowered limit (a 14000 px one would decode to
    588 MB in a loader that let it through)."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        from dali_fast.loaders.dali_iterator import DALIIterator as Loader

        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
        big = bilevel_png(64, 48)
        items = [jpeg_bytes(32, 24) for _ in range(8)]
        kw = {"num_threads": 2}
    else:
        from dali_fast.loaders.torch_iterator import TorchIterator as Loader

        big = huge_png
        items = [jpeg_bytes(40, 30) for _ in range(8)]
        kw = {"num_workers": 2}
    items[3] = big
    loader = Loader(IndexReader(items), 4, image_size=16, device="cpu", **kw)
    with pytest.raises(BadRecordError) as e:
        for _ in loader:
            pass
    assert str(e.value) == (
        f"record 3 (mem://3.jpg): {check_encoded(big)}; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )
    loader.close()
    skipping = Loader(IndexReader(items), 4, image_size=16, device="cpu", on_error="skip", **kw)
    assert sorted(y for _, batch in skipping for y in batch.tolist()) == [0, 1, 2, 4, 5, 6, 7]
    assert skipping.skipped == 1
    skipping.close()


def test_the_command_raises_the_limit_from_its_variable(tmp_path, huge_png, monkeypatch, capsys):
    from dali_fast.cli import main

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(), huge_png]})
    assert main(["inspect", str(src), "--verify"]) == 1
    assert (
        capsys.readouterr().out.splitlines()[-2]
        == f"bad:      record 1 ({src / 'a' / '001.png'}): {check_encoded(huge_png)}"
    )
    monkeypatch.setenv("DALI_FAST_MAX_PIXELS", "196000000")
    assert main(["pack", str(src), str(tmp_path / "p"), "--no-verify"]) == 0  # no 196 MB decode
    assert MemmapReader(tmp_path / "p").count == 2 and Image.MAX_IMAGE_PIXELS == 98_000_000
    monkeypatch.setenv("DALI_FAST_MAX_PIXELS", "lots")
    assert main(["inspect", str(src)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "dali-fast inspect: error: DALI_FAST_MAX_PIXELS='lots': give the most pixels an image may have, "
        "e.g. 250000000, or none"
    )


def test_a_png_without_its_ihdr_is_refused(huge_png):
    assert check_encoded(huge_png[:8] + chunk(b"IEND", b"")) == "corrupt PNG (no IHDR chunk first)"


def header_png(width: int, height: int) -> bytes:
    """A PNG whose IHDR says ``width`` x ``height``, whole in structure (its pixels are not there)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_the_packed_readers_quick_look_holds_a_png_to_the_limit_exactly(tmp_path, monkeypatch):
    """The packed reader reads a PNG's width and height from its IHDR (4 big-endian bytes each, every byte
    counted): a PNG of exactly the limit passes on its ends alone, one over it is named; a damaged record
    beside them is named; with no limit every PNG passes; beyond 2**53 pixels the count is still exact."""
    import dali_fast.data.packed as packed

    w, h = 2_147_483_647, 4_194_307  # 2**53 + 2,147,482,621 pixels: a float64 rounds the product down by one
    items = [
        header_png(0x02020202, 1),  # 33,686,018 pixels: the limit below, exactly
        header_png(2, 0x01010101),  # the same number
        header_png(0x01010102, 2),  # 2 over it
        header_png(1, 0x02020203),  # 1 over it
        header_png(2, 2),  # damaged below
        header_png(w, h),
    ]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    src = make_folder(tmp_path / "src", {"a": items})
    assert pack(src, tmp_path / "p", progress=False, verify=False).records == len(items)
    r = MemmapReader(tmp_path / "p")
    at = int(r.records["offset"][4]) + int(r.records["length"][4]) - 7  # its last chunk: "IEND" -> "IeND"
    del r
    with open(tmp_path / "p" / DATA_FILE, "r+b") as f:
        f.seek(at)
        f.write(b"e")
    walked = []
    real = packed.check_encoded
    monkeypatch.setattr(packed, "check_encoded", lambda data: walked.append(bytes(data)) or real(data))
    reader = MemmapReader(tmp_path / "p")
    damaged = {4: "truncated PNG (no IEND chunk)"}
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 0x01010101)
    _, _, bad = reader.read_batch_checked(range(5))
    assert bad == {2: check_encoded(items[2]), 3: check_encoded(items[3])} | damaged
    assert bad[2].startswith("16843010x2 pixels (33,686,020), over the limit of 33,686,018 ")
    assert bad[3].startswith("1x33686019 pixels (33,686,019), over the limit of 33,686,018 ")
    assert len(walked) == 3  # the two over the limit and the damaged one: not the two at it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert reader.read_batch_checked(range(6))[2] == damaged
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", (w * h - 1) // 2)
    assert reader.read_batch_checked([5, 1])[2] == {0: check_encoded(items[5])}
    assert check_encoded(items[5]).startswith(f"{w}x{h} pixels ({w * h:,}), over the limit of {w * h - 1:,} ")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", (w * h + 1) // 2)
    assert reader.read_batch_checked([5, 1])[2] == {}


@pytest.mark.parametrize(
    ("text", "pillow"),
    [
        ("none", None),
        (" None\n", None),
        ("NONE", None),
        ("196000000", 98_000_000),
        ("196,000,001", 98_000_001),  # Pillow refuses above twice its value: rounded up
        ("196_000_000", 98_000_000),
        ("1__000", 500),  # underscores anywhere are taken out
        ("2", 1),
        ("1", 1),  # the least
    ],
)
def test_the_pixel_variable_sets_pillows_limit(monkeypatch, text, pillow):
    from dali_fast.data.checks import apply_pixel_limit_env, pixel_limit

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # restored after the test
    monkeypatch.setenv("DALI_FAST_MAX_PIXELS", text)
    apply_pixel_limit_env()
    assert Image.MAX_IMAGE_PIXELS == pillow and pixel_limit() == (None if pillow is None else 2 * pillow)


@pytest.mark.parametrize("text", ["0", "-5", "", "1e9", "no"])
def test_a_pixel_variable_of_no_pixels_is_refused(monkeypatch, text):
    from dali_fast.data.checks import apply_pixel_limit_env

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    monkeypatch.setenv("DALI_FAST_MAX_PIXELS", text)
    with pytest.raises(ValueError) as e:
        apply_pixel_limit_env()
    assert str(e.value) == (
        f"DALI_FAST_MAX_PIXELS={text!r}: give the most pixels an image may have, e.g. 250000000, or none"
    )
    assert Image.MAX_IMAGE_PIXELS == 1000
    monkeypatch.delenv("DALI_FAST_MAX_PIXELS")
    apply_pixel_limit_env()  # unset: left as it is
    assert Image.MAX_IMAGE_PIXELS == 1000
