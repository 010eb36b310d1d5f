"""A JPEG whose compressed data is damaged (4 KiB zeroed, a cut with an end marker appended): libjpeg-turbo
reports it, Pillow decodes it without a word. Every part that decodes by the one rule (TorchIterator's
decoder, `pack`, ``inspect --verify``) treats it as a bad record and names it; DALI's decoder has no
strict mode (the documented exception)."""

from __future__ import annotations

import io

import numpy as np
import odd_images
import pytest
from builders import IndexReader, jpeg_bytes, make_folder
from PIL import Image

from dali_fast.data.pack.packed import pack
from dali_fast.data.packed import MemmapReader
from dali_fast.loaders.bad_records import BadRecordError
from dali_fast.loaders.torch_iterator import TorchIterator
from dali_fast.tools.inspect import inspect_dataset
from dali_fast.transforms.decode import Decoder, decode_rgb, to_rgb

pytest.importorskip("simplejpeg")

# New names are imported in the tests that use them, so that each test of this file, run against code
# without them, fails on what it checks rather than all of them on an import.

ZEROED = "corrupt JPEG (libjpeg-turbo: Corrupt JPEG data: 844 extraneous bytes before marker 0xd9)"
CUT = "corrupt JPEG (libjpeg-turbo: Corrupt JPEG data: premature end of data segment)"


def photo(w: int = 240, h: int = 180, seed: int = 0, mode: str = "RGB", **save) -> bytes:
    """A JPEG with detail everywhere (noise over gradients): 24 KiB at 240 x 180, so 4 KiB zeroed in the
    middle falls in its compressed data."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x ^ y) & 255], -1)
    px = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(px).convert(mode).save(out, "JPEG", quality=90, **save)
    return out.getvalue()


def rotated(orientation: int, **save) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return photo(exif=exif.tobytes(), **save)


@pytest.fixture(scope="module")
def damaged() -> dict[str, bytes]:
    return odd_images.damaged_scans(photo())


def test_pillow_hides_the_damage_that_libjpeg_turbo_reports(damaged):
    """The premise: both pass the structural check and Pillow decodes both; libjpeg-turbo names the damage."""
    from dali_fast.data.checks import check_encoded
    from dali_fast.data.verify import jpeg_damage

    for data in damaged.values():
        assert check_encoded(data) is None
        with Image.open(io.BytesIO(data)) as im:
            assert np.asarray(im.convert("RGB")).shape == (180, 240, 3)
    assert jpeg_damage(damaged["zeroed_4k"]) == ZEROED
    assert jpeg_damage(damaged["cut_with_end_marker"]) == CUT
    assert jpeg_damage(photo()) is None and jpeg_damage(odd_images.odd_valid()["rgb_png"]) is None


@pytest.mark.parametrize(
    "good",
    [photo(), photo(progressive=True), rotated(6), rotated(3), photo(mode="L"), photo(mode="CMYK")],
    ids=["baseline", "progressive", "exif-6", "exif-3", "gray", "cmyk"],
)
def test_the_decoder_refuses_damage_on_either_path_full_or_scaled(good):
    """The fast path (baseline, progressive, gray, EXIF-rotated) and the general one (CMYK, through
    Pillow) alike: `CorruptJpeg` with libjpeg-turbo's words, at full scale and when a draft scale is
    asked for; the whole file decodes."""
    from dali_fast.data.verify import jpeg_damage, verdict
    from dali_fast.transforms.decode import CorruptJpeg

    assert Decoder().open(good).decode().shape[2] == 3
    for name, data in odd_images.damaged_scans(good).items():
        for need in (None, (30, 22)):
            decoder = Decoder()
            with pytest.raises(CorruptJpeg) as e:
                decoder.open(data).decode(need)
            assert str(e.value) == jpeg_damage(data) and str(e.value).startswith("corrupt JPEG (libjpeg-turbo: ")
            assert (decoder.fast, decoder.general) == (0, 0), name
        assert verdict(data) == jpeg_damage(data)
    assert verdict(good) is None


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("need", [None, (30, 30)])
def test_every_exif_orientation_takes_the_fast_path_with_pillows_pixels(orientation, need):
    """An EXIF-rotated JPEG is decoded by libjpeg-turbo and turned as `to_rgb` turns Pillow's image: the
    same pixels, bit for bit, at full scale and at the draft scale Pillow would pick."""
    data = rotated(orientation)
    decoder = Decoder()
    opened = decoder.open(data)
    got = opened.decode(need)
    assert decoder.fast == 1 and decoder.general == 0
    with Image.open(io.BytesIO(data)) as im:
        if need:
            stored = need if orientation < 5 else need[::-1]
            im.draft("RGB", (2 * stored[0], 2 * stored[1]))
        want = np.asarray(to_rgb(im))
    np.testing.assert_array_equal(got, want)
    assert (opened.width, opened.height) == ((240, 180) if orientation < 5 else (180, 240))
    if need is None:
        np.testing.assert_array_equal(got, decode_rgb(data))


def reader_with(bad: dict[int, bytes], n: int = 12) -> IndexReader:
    items = [jpeg_bytes(40 + i, 30 + i % 4) for i in range(n)]
    for i, data in bad.items():
        items[i] = data
    return IndexReader(items)


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_iterator_names_a_damaged_jpeg_and_skips_and_counts_it(damaged, workers):
    kw = dict(image_size=16, device="cpu", num_workers=workers)
    loader = TorchIterator(reader_with({5: damaged["zeroed_4k"]}), 4, **kw)
    with pytest.raises(BadRecordError) as e:
        for _ in loader:
            pass
    assert str(e.value) == (
        f"record 5 (mem://5.jpg): {ZEROED}; remove or re-pack it, "
        "or skip bad records with on_error='skip' (dali-fast: --on-error skip)"
    )
    loader.close()
    skipping = TorchIterator(reader_with(dict(zip((5, 9), damaged.values(), strict=True))), 4, on_error="skip", **kw)
    for epoch in (0, 1):
        skipping.set_epoch(epoch)
        labels = sorted(y for _, batch in skipping for y in batch.tolist())
        assert labels == [i for i in range(12) if i not in (5, 9)]
    assert skipping.skipped == 4  # two records, two epochs
    skipping.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_pack_leaves_a_damaged_jpeg_out_named(tmp_path, damaged, workers):
    good = [photo(seed=s) for s in range(3)]
    src = make_folder(
        tmp_path / "src", {"a": [good[0], damaged["zeroed_4k"]], "b": [damaged["cut_with_end_marker"], *good[1:]]}
    )
    report = pack(src, tmp_path / "p", progress=False, workers=workers)
    assert report.skipped == [(str(src / "a" / "001.jpg"), ZEROED), (str(src / "b" / "000.jpg"), CUT)]
    assert report.records == 3 and report.ignored == []
    r = MemmapReader(tmp_path / "p")
    assert [bytes(r[i][0]) for i in range(3)] == good
    unchecked = pack(src, tmp_path / "q", progress=False, verify=False)  # the structural check alone passes them
    assert unchecked.records == 5 and unchecked.skipped == []


def lines_of(path, **kw) -> tuple[int, list[str]]:
    out: list[str] = []
    code = inspect_dataset(str(path), verify=True, emit=out.append, **kw)
    return code, out


def test_inspect_verify_decodes_every_record_of_any_data_set_and_names_the_bad(tmp_path, damaged):
    """A folder (once refused: verify was a packed set's crc) and a packed set made without verify: every
    bad record named with its reason, exit 1; the same from one process or two."""
    many = [jpeg_bytes(24 + i % 7, 20 + i % 5) for i in range(270)]  # enough for the worker processes
    src = make_folder(
        tmp_path / "src", {"a": many[:135] + [damaged["zeroed_4k"]], "b": many[135:] + [damaged["cut_with_end_marker"]]}
    )
    want = [
        f"bad:      record 135 ({src / 'a' / '135.jpg'}): {ZEROED}",
        f"bad:      record 271 ({src / 'b' / '135.jpg'}): {CUT}",
        "verify:   2 bad records of 272; remove or replace them (pack leaves them out)",
    ]
    for workers in (1, 2):
        code, out = lines_of(src, workers=workers)
        assert code == 1 and out[-3:] == want, out
    pack(src, tmp_path / "p", progress=False, verify=False)
    code, out = lines_of(tmp_path / "p", workers=2)
    assert code == 1
    assert out[-3:] == [
        f"bad:      record 135 (a/135.jpg): {ZEROED}",
        f"bad:      record 271 (b/135.jpg): {CUT}",
        "verify:   2 bad records of 272; remove or replace them (pack leaves them out)",
    ]
    pack(src, tmp_path / "clean", progress=False)  # verify: they are left out
    code, out = lines_of(tmp_path / "clean")
    assert code == 0
    assert (
        out[-1]
        == "verify:   all 270 records match their crc32 and decode (JPEGs strictly: libjpeg-turbo reports no damage)"
    )


def test_inspect_verify_on_the_command_line_exits_1_naming_the_record(tmp_path, damaged, capsys):
    from dali_fast.cli import main

    src = make_folder(tmp_path / "src", {"a": [photo(), damaged["cut_with_end_marker"]]})
    assert main(["inspect", str(src), "--verify"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        f"bad:      record 1 ({src / 'a' / '001.jpg'}): {CUT}",
        "verify:   1 bad record of 2; remove or replace them (pack leaves them out)",
    ]


def test_dali_decodes_damaged_jpeg_data_as_docs_say(damaged):
    """The documented exception: DALI 2.x has no strict decode, so DALIIterator delivers such an image (and
    libjpeg-turbo prints its bare warning). If this fails, DALI changed: update docs/troubleshooting.md."""
    from dali_fast.loaders.dali_iterator import DALIIterator

    loader = DALIIterator(reader_with({5: damaged["zeroed_4k"]}), 4, image_size=16, device="cpu", num_threads=2)
    labels = [y for _, batch in loader for y in batch.tolist()]
    assert sorted(labels) == list(range(12)) and loader.skipped == 0
    loader.close()
