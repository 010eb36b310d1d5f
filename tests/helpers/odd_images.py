"""Real-world images, odd but valid, and the corrupt kinds met in the wild: made in memory for the tests.

`odd_valid()` and `corrupt()` return {name: encoded bytes}. Every corrupt kind is described by
what it breaks: the cheap structural check catches some; the others pass it and only fail to decode.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def _jpeg(arr: np.ndarray, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "JPEG", quality=95, **save)
    return out.getvalue()


def _scene(w: int = 64, h: int = 48) -> np.ndarray:
    """A smooth colour scene with a distinct left/right and top/bottom, so rotations show."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    return np.stack([255 * x / (w - 1), 255 * y / (h - 1), np.full_like(x, 90)], axis=-1).astype(np.uint8)


def _segments(jpeg: bytes) -> list[tuple[int, int, int]]:
    """(marker, offset, length) of each segment up to and including the first SOS."""
    pos, out = 2, []
    while True:
        marker, length = jpeg[pos + 1], (jpeg[pos + 2] << 8) | jpeg[pos + 3]
        out.append((marker, pos, length))
        if marker == 0xDA:
            return out
        pos += 2 + length


def good_jpeg() -> bytes:
    return _jpeg(_scene())


def odd_valid() -> dict[str, bytes]:
    """Valid files that decoders treat differently unless a rule is chosen: each decodes to an RGB image."""
    return {name: data for name, (data, _) in odd_valid_with_truth().items()}


def odd_valid_with_truth() -> dict[str, tuple[bytes, np.ndarray]]:
    """{name: (encoded bytes, the uint8 RGB image a viewer shows)}: the truth is made independently of
    any decoder under test (from the pixels the file was written from)."""
    scene = _scene()
    gray = np.asarray(Image.fromarray(scene).convert("L"))
    out: dict[str, tuple[bytes, np.ndarray]] = {"plain": (good_jpeg(), scene)}
    ramp16 = (np.linspace(0, 65535, 64 * 48).reshape(48, 64)).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(ramp16).save(buf, "PNG")  # mode I;16
    out["gray16_png"] = (buf.getvalue(), np.repeat((ramp16 >> 8).astype(np.uint8)[..., None], 3, axis=2))
    buf = io.BytesIO()
    Image.fromarray(scene).save(buf, "PNG")
    out["rgb_png"] = (buf.getvalue(), scene)
    # EXIF orientation 6: the stored pixels are the scene turned; a viewer turns them back.
    stored = np.ascontiguousarray(np.rot90(scene, k=1))  # 90 degrees counter-clockwise on disk
    exif = Image.Exif()
    exif[0x0112] = 6
    out["exif_rotated"] = (_jpeg(stored, exif=exif.tobytes()), scene)
    buf = io.BytesIO()
    Image.fromarray(scene).convert("CMYK").save(buf, "JPEG", quality=95)
    out["cmyk_jpeg"] = (buf.getvalue(), scene)
    buf = io.BytesIO()
    Image.fromarray(np.dstack([scene, np.full(scene.shape[:2], 128, np.uint8)]), "RGBA").save(buf, "PNG")
    out["alpha_png"] = (buf.getvalue(), scene)
    pal = Image.fromarray(scene).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    buf = io.BytesIO()
    pal.save(buf, "PNG")
    out["palette_png"] = (buf.getvalue(), np.asarray(pal.convert("RGB")))
    out["gray_jpeg"] = (_jpeg(gray), np.repeat(gray[..., None], 3, axis=2))
    out["progressive_jpeg"] = (_jpeg(scene, progressive=True), scene)
    # A motion photo / editor trailer: 4 KiB after the end-of-image marker.
    out["trailing_data_jpeg"] = (good_jpeg() + bytes(range(256)) * 16, scene)
    return out


def corrupt() -> dict[str, bytes]:
    """Files no decoder can read. The first group fails the cheap check; the second passes it."""
    good = good_jpeg()
    segs = _segments(good)
    png = odd_valid()["rgb_png"]
    out = {
        "empty": b"",
        "random_bytes": bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8)),
        "truncated_jpeg": good[: len(good) // 2],
        "truncated_in_scan_jpeg": good[:-100],
        "truncated_png": png[: len(png) // 2],
        "truncated_png_with_iend": png[: len(png) // 2] + png[-12:],
        "broken_header_jpeg_with_eoi": good[:200] + bytes(range(256)) * 4 + b"\xff\xd9",
    }
    # Marker structure intact, so the cheap check passes; the decoder fails on the tables.
    dht = next(p for m, p, _ in segs if m == 0xC4)
    b = bytearray(good)
    b[dht + 5 : dht + 21] = bytes([255] * 16)
    out["bogus_huffman_table_jpeg"] = bytes(b)
    sos = next(p for m, p, _ in segs if m == 0xDA)
    b = bytearray(good)
    b[sos + 6] = 0x33  # the scan names Huffman tables that were never defined
    out["undefined_table_jpeg"] = bytes(b)
    sof = next(p for m, p, _ in segs if m == 0xC0)
    b = bytearray(good)
    b[sof + 4] = 12  # 12-bit samples in a baseline frame
    out["bad_precision_jpeg"] = bytes(b)
    return out


PASS_THE_CHEAP_CHECK = ("bogus_huffman_table_jpeg", "undefined_table_jpeg", "bad_precision_jpeg")


def damaged_scans(good: bytes) -> dict[str, bytes]:
    """``good`` (a JPEG of 12 KiB or more) damaged in its compressed data as files are in the wild: 4 KiB
    zeroed in the middle (a bad disk sector), or cut at two thirds with an end marker appended (a repair
    tool's work). Their headers and end are whole, so the structural check passes them; libjpeg-turbo
    reports the damage and decodes on; Pillow decodes them without a word."""
    mid = len(good) // 2
    return {
        "zeroed_4k": good[:mid] + bytes(4096) + good[mid + 4096 :],
        "cut_with_end_marker": good[: len(good) * 2 // 3] + b"\xff\xd9",
    }
