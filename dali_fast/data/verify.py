"""Whether a record decodes, by the one rule every loader, `pack` and ``inspect --verify`` apply: the
structural checks, then a JPEG's strict decode by libjpeg-turbo (damage it reports makes the record bad,
where Pillow would decode grey or smeared pixels in silence), and Pillow's decode for everything else.

Here, below the transforms, so that writing a data set (`pack`) and reading one for training share it;
`transforms.decode` decodes pixels by the same rule."""

from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import check_encoded, pillow_reason

if TYPE_CHECKING:
    from PIL import Image


def open_image(data: bytes | np.ndarray) -> Image.Image:
    """A lazily decoded Pillow image of an encoded record (not yet loaded: `draft` still possible)."""
    from PIL import Image

    return Image.open(io.BytesIO(data if isinstance(data, bytes) else np.asarray(data).tobytes()))


@functools.lru_cache(maxsize=1)
def simplejpeg_module() -> Any:
    """The simplejpeg module (libjpeg-turbo), or None where it is not installed."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


# libjpeg-turbo's warnings that mean lost or invented pixels (jerror.h: JWRN_HIT_MARKER, JWRN_HUFF_BAD_CODE,
# JWRN_EXTRANEOUS_DATA, JWRN_MUST_RESYNC, JWRN_ARITH_BAD_CODE, JWRN_JPEG_EOF, JWRN_BOGUS_PROGRESSION). Its
# other warnings (an unknown JFIF revision, odd scan parameters) leave the pixels whole.
_DAMAGE = ("Corrupt JPEG data", "Premature end of JPEG file", "Inconsistent progression sequence")


def damage_reason(message: str) -> str | None:
    """The bad-record reason for libjpeg-turbo's ``message`` when it reports damage, else None."""
    if message.startswith(_DAMAGE):
        return f"corrupt JPEG (libjpeg-turbo: {message})"
    return None


def strict_decode(data: bytes | np.ndarray) -> tuple[bool, str | None]:
    """A JPEG decoded strictly by libjpeg-turbo at 1/8 scale (every bit of its scans is still read):
    (whether it decoded whole, why it is damaged). (False, None): not a JPEG, or one libjpeg-turbo cannot
    read at all (a fatal error, or a warning that is no damage: Pillow's verdict then decides)."""
    sj = simplejpeg_module()
    if sj is None or len(data) < 3 or bytes(data[:3]) != b"\xff\xd8\xff":
        return False, None
    try:
        _, _, colorspace, _ = sj.decode_jpeg_header(data)
        to = {"CMYK": "CMYK", "YCCK": "CMYK", "Gray": "GRAY"}.get(colorspace, "RGB")
        sj.decode_jpeg(data, colorspace=to, min_width=1, min_height=1, min_factor=8, strict=True)
    except ValueError as e:
        return False, damage_reason(str(e))
    return True, None


def jpeg_damage(data: bytes | np.ndarray) -> str | None:
    """Why libjpeg-turbo finds a JPEG's compressed data damaged, or None (whole, not a JPEG, or one it
    cannot read at all). A strict decode at 1/8 scale: about two thirds of a full decode's time."""
    return strict_decode(data)[1]


def verdict(data: bytes | np.ndarray, name: str | None = None) -> str | None:
    """Why a record is bad by the one rule, reading all of it, or None: the structural checks
    (`check_encoded`, the pixel limit included), then a JPEG's strict decode by libjpeg-turbo (damage
    reported is bad; decoded whole is good), and Pillow's decode for everything else. What `pack` and
    ``inspect --verify`` apply to every record; ``name`` (the file) is put in Pillow's words for it."""
    reason = check_encoded(data)
    if reason is not None:
        return reason
    whole, reason = strict_decode(data)
    if whole or reason is not None:
        return reason
    try:
        with open_image(data) as im:
            im.load()
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad files; each is reported
        return pillow_reason(e, name)
    return None
