"""The tar walk: each regular member of an uncompressed tar (name, data offset, size) as Python's `tarfile`
reads it, and so as webdataset, whose `ShardWriter` writes through `tarfile`, reads it back.

What that takes beyond the 512-byte ustar header (`tarfile.TarInfo.frombuf` and its ``_proc_*`` methods):

- the ustar ``prefix`` field before the name (a POSIX name of up to 255 bytes split at a slash);
- GNU long names (``L``, ``././@LongLink``: the next member's name is this member's data) and long link
  names (``K``, consumed: links are not samples);
- PAX extended headers (``x``, and Solaris' ``X``) for the next member and global ones (``g``) for every
  member after them: ``path`` replaces the name (how `tarfile`'s default format stores a name over 100
  bytes, or one that is not ASCII: the ustar field then holds a ``?`` for each such character), ``size``
  the size (a member over 8 GiB);
- names as UTF-8, any byte that is not kept as it is (``surrogateescape``, as `tarfile` decodes them);
- data blocks only after regular members and types `tarfile` does not know: links, folders, devices and
  FIFOs have none, whatever their size field says.

The walk reads headers only, through a read-only memory map: a shard of 10,000 members costs 10,000 header
reads, and a shard the user may only read is walked as well.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import NamedTuple

BLOCK = 512
REGULAR = (b"0", b"\0", b"7")  # regular files, as tarfile's isreg() (GNU sparse files aside)
NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, FIFOs: no data blocks follow
PAX = (b"x", b"X", b"g")
LONG = (b"L", b"K")
SPARSE = b"S"
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_HDRCHARSET = re.compile(rb"\d+ hdrcharset=([^\n]+)\n")


class Member(NamedTuple):
    """One member of a tar: its name (as `tarfile` gives it), where its data starts, its size, and whether
    it is a regular file (the only kind that is a sample's part; the others are listed for messages)."""

    name: str
    offset: int
    size: int
    kind: str


def nts(field: bytes) -> str:
    """A NUL-terminated header field as text: UTF-8, any other byte kept (`tarfile`'s ``nts``)."""
    end = field.find(b"\0")
    return (field if end < 0 else field[:end]).decode("utf-8", "surrogateescape")


def octal(field: bytes) -> int:
    """A numeric header field: octal text, or GNU's base-256 (high bit set) for large sizes."""
    if field[:1] and field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").strip()
    return int(text, 8) if text else 0


def header_ok(header: bytes) -> bool:
    """Whether a 512-byte block is a tar header: its checksum (unsigned, or signed as old tars wrote it)
    and its size field hold."""
    try:
        stored = int(header[148:156].rstrip(b"\0 ").strip() or b"-1", 8)
        octal(header[124:136])
    except ValueError:
        return False
    rest = header[:148] + b" " * 8 + header[156:]
    return stored == sum(rest) or stored == sum(rest) - 256 * sum(b > 127 for b in rest)


def pax_fields(data: bytes) -> dict[str, str]:
    """The records of a PAX header (``"%d %s=%s\\n"``), decoded as `tarfile` decodes them: UTF-8, and names
    whose bytes are not UTF-8 (``hdrcharset=BINARY``, or GNU tar <= 1.23) with each such byte kept."""
    fields: dict[str, str] = {}
    pos = 0
    while (m := _PAX_RECORD.match(data, pos)) is not None:
        length = int(m.group(1))
        if length <= 0:
            break
        value = data[m.end(2) + 1 : m.start(1) + length - 1]
        fields[m.group(2).decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return fields


def _padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


def scan_tar(path: Path) -> tuple[list[Member], str | None]:
    """Every member of an uncompressed tar, in order, and what is known of the damage when the walk stopped
    early (a truncated or damaged shard: where it ends, and that whatever followed is lost, however much
    that was), or None. Only members of kind ``"file"`` hold data that can be read in place."""
    size = path.stat().st_size
    if size == 0:
        return [], "empty file: any samples it held are lost"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as buf:
            return _walk(buf, size)


def _walk(buf: memoryview, size: int) -> tuple[list[Member], str | None]:
    """`scan_tar` over the file's ``size`` bytes in ``buf``."""
    members: list[Member] = []
    pos = 0
    global_pax: dict[str, str] = {}
    pending: dict[str, str] | None = None  # the next member's PAX records (global ones included)
    long_name: str | None = None

    def after() -> str:
        return f" after member {members[-1].name}" if members else " before any member"

    while pos + BLOCK <= size:
        header = bytes(buf[pos : pos + BLOCK])
        if header == b"\0" * BLOCK:
            return members, None  # the end-of-archive blocks
        if not header_ok(header):
            return members, f"damaged: no tar header at byte {pos}{after()}; any samples after it are lost"
        kind = header[156:157]
        if kind == b"\0" and nts(header[0:100]).endswith("/"):
            kind = b"5"  # an old tar's folder: a regular file whose name ends in a slash
        length = octal(header[124:136])
        start = pos + BLOCK
        if kind in PAX or kind in LONG:  # a header for the member that follows: its data is the header
            if start + length > size:
                return members, f"truncated: the file ends inside a member's header{after()}; any samples after it are lost"
            data = bytes(buf[start : start + length])
            if kind == b"g":
                global_pax.update(pax_fields(data))
            elif kind in PAX:
                pending = {**global_pax, **(pending or {}), **pax_fields(data)}
            elif kind == b"L":
                long_name = nts(data)
            pos = start + _padded(length)
            continue
        name = nts(header[0:100])
        prefix = nts(header[345:500])
        if prefix and kind != SPARSE:
            name = f"{prefix}/{name}"
        if "path" in global_pax:
            name = global_pax["path"]
        if long_name is not None:
            name = long_name
        fields = pending if pending is not None else global_pax
        if pending is not None and "path" in pending:
            name = pending["path"]
        if "size" in fields:
            try:
                length = int(fields["size"])
            except ValueError:
                length = 0
        name = name.rstrip("/") if (kind == b"5" or "path" in fields) else name
        pending, long_name = None, None
        has_data = kind not in NO_DATA
        if has_data and start + length > size:
            return members, (
                f"truncated: the file ends inside member {name} (at byte {size} of the {start + length} it needs); "
                "that sample and any after it are lost"
            )
        what = "file" if kind in REGULAR else "sparse" if kind == SPARSE else _KINDS.get(kind, "other")
        members.append(Member(name, start, length if has_data else 0, what))
        pos = start + (_padded(length) if has_data else 0)
    if pos < size and any(buf[pos:size]):
        return members, f"truncated: the file ends inside a member's header{after()}; any samples after it are lost"
    if pos >= size:  # a tar ends with zero blocks; a copy cut at a member's end has none
        return members, f"truncated: no end-of-archive blocks{after()}; any samples after it are lost"
    return members, None


_KINDS = {b"1": "hard link", b"2": "symbolic link", b"3": "device", b"4": "device", b"5": "folder", b"6": "FIFO"}
