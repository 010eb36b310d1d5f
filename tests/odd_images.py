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
    scene = _scene()
    out: dict[str, bytes] = {"plain": good_jpeg()}
    gray16 = (np.linspace(0, 65535, 64 * 48).reshape(48, 64)).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(gray16).save(buf, "PNG")  # mode I;16
    out["gray16_png"] = buf.getvalue()
    rgb16 = io.BytesIO()
    Image.fromarray(scene).convert("RGB").save(rgb16, "PNG")
    out["rgb_png"] = rgb16.getvalue()
    # EXIF orientation 6: the stored pixels are the scene rotated; a viewer turns it back.
    stored = np.ascontiguousarray(np.rot90(scene, k=1))  # 90° counter-clockwise on disk
    exif = Image.Exif()
    exif[0x0112] = 6
    out["exif_rotated"] = _jpeg(stored, exif=exif.tobytes())
    cmyk = io.BytesIO()
    Image.fromarray(scene).convert("CMYK").save(cmyk, "JPEG", quality=95)
    out["cmyk_jpeg"] = cmyk.getvalue()
    alpha = io.BytesIO()
    Image.fromarray(np.dstack([scene, np.full(scene.shape[:2], 128, np.uint8)]), "RGBA").save(alpha, "PNG")
    out["alpha_png"] = alpha.getvalue()
    pal = io.BytesIO()
    Image.fromarray(scene).convert("P", palette=Image.Palette.ADAPTIVE, colors=64).save(pal, "PNG")
    out["palette_png"] = pal.getvalue()
    out["gray_jpeg"] = _jpeg(np.asarray(Image.fromarray(scene).convert("L")))
    out["progressive_jpeg"] = _jpeg(scene, progressive=True)
    # A motion photo / editor trailer: 4 KiB after the end-of-image marker.
    out["trailing_data_jpeg"] = good_jpeg() + bytes(range(256)) * 16
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
