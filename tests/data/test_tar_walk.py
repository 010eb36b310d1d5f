"""The tar walk at its edges, on tars built header by header: what `tarfile` reads (the oracle wherever it
reads the file), and where a damaged or cut tar ends, in exact words."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from dali_fast.data.tar import BLOCK, Member, header_ok, nts, octal, pax_fields, scan_tar

END = bytes(2 * BLOCK)  # the end-of-archive blocks


def header(name: bytes, size: int = 0, kind: bytes = b"0", *, size_field: bytes | None = None, prefix: bytes = b"",
           signed: bool = False) -> bytes:  # fmt: skip
    """One 512-byte ustar header, its checksum as tar writes it (``signed``: as old tars summed signed bytes)."""
    h = bytearray(BLOCK)
    h[0 : len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"%011o\0" % 0
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[345 : 345 + len(prefix)] = prefix
    h[148:156] = b" " * 8
    total = sum(b - 256 if signed and b > 127 else b for b in h)
    h[148:156] = b"%06o\0 " % (total & 0o777777)
    return bytes(h)


def member(name: bytes, data: bytes, kind: bytes = b"0", **kw) -> bytes:
    return header(name, len(data), kind, **kw) + data + bytes(-len(data) % BLOCK)


def pax(records: dict[str, str], kind: bytes = b"x") -> bytes:
    """A PAX header (``x`` for the next member, ``g`` for every member after it) holding ``records``."""
    body = b""
    for key, value in records.items():
        text = f" {key}={value}\n".encode()
        n = len(text) + len(str(len(text)))
        n = len(text) + len(str(n))
        body += str(n).encode() + text
    return member(b"././@PaxHeader", body, kind)


def write(tmp_path: Path, *parts: bytes, name: str = "t.tar") -> Path:
    path = tmp_path / name
    path.write_bytes(b"".join(parts))
    return path


def theirs(path: Path) -> list[tuple[str, int, int]]:
    with tarfile.open(path) as tf:
        return [(m.name, m.offset_data, m.size) for m in tf if m.isreg()]


def files(members: list[Member]) -> list[tuple[str, int, int]]:
    return [(m.name, m.offset, m.size) for m in members if m.kind == "file"]


LOST = "any samples after it are lost"


def test_where_a_damaged_or_cut_tar_ends_in_exact_words(tmp_path):
    a = member(b"a.jpg", b"x" * 700)
    assert scan_tar(write(tmp_path, b"")) == ([], "empty file: any samples it held are lost")
    assert scan_tar(write(tmp_path, b"\x01" * BLOCK, END))[1] == f"damaged: no tar header at byte 0 before any member; {LOST}"
    got, why = scan_tar(write(tmp_path, a, b"\x01" * BLOCK, END))
    assert files(got) == [("a.jpg", 512, 700)] and why == f"damaged: no tar header at byte 1536 after member a.jpg; {LOST}"
    cut = write(tmp_path, a[:1000])
    assert scan_tar(cut) == (
        [], "truncated: the file ends inside member a.jpg (at byte 1000 of the 1212 it needs); that sample and any after it are lost"
    )  # fmt: skip
    got, why = scan_tar(write(tmp_path, a, pax({"path": "b.jpg"})[:520]))
    assert why == f"truncated: the file ends inside a member's header after member a.jpg; {LOST}"
    got, why = scan_tar(write(tmp_path, a))  # cut where a member ends: no end blocks
    assert files(got) == [("a.jpg", 512, 700)] and why == f"truncated: no end-of-archive blocks after member a.jpg; {LOST}"
    empty_last = member(b"b.cls", b"")  # a header alone, the file's last block
    got, why = scan_tar(write(tmp_path, a, empty_last))
    assert files(got) == [("a.jpg", 512, 700), ("b.cls", 2048, 0)]
    assert why == f"truncated: no end-of-archive blocks after member b.cls; {LOST}"
    got, why = scan_tar(write(tmp_path, a, empty_last[:300]))  # part of a header
    assert why == f"truncated: the file ends inside a member's header after member a.jpg; {LOST}"
    got, why = scan_tar(write(tmp_path, a, bytes(300)))  # the end blocks themselves cut short: whole
    assert files(got) == [("a.jpg", 512, 700)] and why is None


def test_names_and_sizes_from_pax_records_as_tarfile_reads_them(tmp_path):
    data = b"0123456789abc"
    path = write(
        tmp_path,
        pax({"path": "a_long_name/" + "k" * 120 + ".jpg"}),
        member(b"a_short.jpg", data),
        member(b"next.cls", b"1"),  # the records were for one member only
        pax({"size": "13"}),
        header(b"sized.jpg", 0) + data + bytes(BLOCK - 13),  # the record's size wins over the header's 0
        pax({"size": "not a number"}),
        member(b"zero.jpg", b""),
        member(b"dir/", b"", kind=b"0"),  # a name with a slash, of a regular file: kept as it is
        member(b"olddir/", b"", kind=b"\0"),  # an old tar's folder: a regular type and a slash
        END,
    )
    ours, problem = scan_tar(path)
    assert problem is None and files(ours) == theirs(path)
    assert [m.name for m in ours] == [
        "a_long_name/" + "k" * 120 + ".jpg", "next.cls", "sized.jpg", "zero.jpg", "dir/", "olddir",
    ]  # fmt: skip
    assert [m.kind for m in ours] == ["file"] * 5 + ["folder"]


def test_a_global_header_names_every_member_after_it_as_tarfile_does(tmp_path):
    path = write(tmp_path, member(b"first.jpg", b"1"), pax({"path": "every.jpg"}, b"g"), member(b"a.jpg", b"2"),
                 member(b"b.jpg", b"3"), END)  # fmt: skip
    assert files(scan_tar(path)[0]) == theirs(path) == [("first.jpg", 512, 1), ("every.jpg", 2560, 1), ("every.jpg", 3584, 1)]


def test_members_without_data_and_of_other_kinds(tmp_path):
    path = write(
        tmp_path,
        header(b"link.jpg", 5, b"2"),  # a symbolic link whose size field says 5: no data follows it
        member(b"after_link.jpg", b"abc"),
        member(b"odd.bin", b"zz" * 300, kind=b"Z"),  # a type tarfile does not know: data follows
        member(b"after_odd.jpg", b"def"),
        member(b"sparse.img", b"s" * 10, kind=b"S", prefix=b"ignored"),
        header(b"hard.jpg", 0, b"1") + header(b"chr", 0, b"3") + header(b"fifo", 0, b"6") + header(b"d", 0, b"5"),
        END,
    )
    ours, problem = scan_tar(path)
    # tarfile counts an old GNU sparse file as regular (its data is not the file's bytes in place): the walk
    # names it as sparse, and a shard's reader never reads it as an image
    assert problem is None and files(ours) == [t for t in theirs(path) if t[0] != "sparse.img"]
    assert [(m.name, m.kind, m.size) for m in ours] == [
        ("link.jpg", "symbolic link", 0), ("after_link.jpg", "file", 3), ("odd.bin", "other", 600),
        ("after_odd.jpg", "file", 3), ("sparse.img", "sparse", 10), ("hard.jpg", "hard link", 0),
        ("chr", "device", 0), ("fifo", "FIFO", 0), ("d", "folder", 0),
    ]  # fmt: skip


def test_a_ustar_prefix_and_an_old_signed_checksum(tmp_path):
    path = write(tmp_path, member(b"img.jpg", b"x", prefix=b"some/deep/folder"), member(b"\xe9t\xe9.jpg", b"y", signed=True), END)
    assert files(scan_tar(path)[0]) == theirs(path) == [("some/deep/folder/img.jpg", 512, 1), ("\udce9t\udce9.jpg", 1536, 1)]


def test_the_header_fields_read_as_tar_writes_them():
    assert octal(b"00000001750\0") == 1000 and octal(b"17777777777\0") == 0o17777777777 and octal(b"\0" * 12) == 0
    assert octal(bytes([0x80] + [0] * 9 + [0x12, 0x34])) == 0x1234  # GNU's base-256 for sizes over 8 GiB
    assert octal(b"   17 \0") == 15
    unsigned = header(b"\xe9.jpg", 1)
    signed = header(b"\xe9.jpg", 1, signed=True)
    assert header_ok(unsigned) and header_ok(signed) and unsigned != signed
    assert not header_ok(signed[:148] + b"0000000\0" + signed[156:])
    assert not header_ok(b"\x01" * BLOCK) and not header_ok(unsigned[:124] + b"not octal!!\0" + unsigned[136:])
    assert nts(b"abc\0def") == "abc" and nts(b"abc") == "abc" and nts(b"\xe9t\xe9\0") == "\udce9t\udce9"


def test_pax_records_as_tarfile_decodes_them():
    assert pax_fields(b"13 path=abcd\n15 size=123456\n") == {"path": "abcd", "size": "123456"}
    assert pax_fields(b"13 path=\xe9bcd\n") == {"path": "\udce9bcd"}  # not UTF-8: each byte kept
    assert pax_fields(b"0 path=x\n13 size=1234\n") == {}  # a record of length 0 ends the header
    assert pax_fields(b"12 path=abc\n13 size=1234\n") == {"path": "abc", "size": "1234"}
    three = b"12 path=abc\n13 size=1234\n12 uid=1000\n"  # each record starts where the one before ends
    assert pax_fields(three) == {"path": "abc", "size": "1234", "uid": "1000"}
    assert pax_fields(b"1 a=b\n") == {"a": ""}  # a length too short for its record: tarfile reads it so


def test_the_walk_reads_what_tarfile_wrote_with_non_ascii_links(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        info = tarfile.TarInfo("ü" * 60 + ".jpg")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
        link = tarfile.TarInfo("l")
        link.type, link.linkname = tarfile.LNKTYPE, "ü" * 60 + ".jpg"  # a long link name: a K header
        tf.addfile(link)
        after = tarfile.TarInfo("z.jpg")
        after.size = 1
        tf.addfile(after, io.BytesIO(b"z"))
    assert files(scan_tar(path)[0]) == theirs(path)


@pytest.mark.parametrize("size, blocks", [(0, 0), (1, 1), (512, 1), (513, 2)])
def test_data_takes_whole_blocks(tmp_path, size, blocks):
    path = write(tmp_path, member(b"a", b"q" * size), member(b"b", b"r"), END)
    assert files(scan_tar(path)[0])[1] == ("b", 512 * (2 + blocks), 1)


def test_fields_at_their_widths_and_in_the_forms_writers_use(tmp_path):
    """A 100-byte name (no NUL), a left-aligned size, a checksum without leading zeros, a path record that
    ends in a slash, a global path record for the member right after it: as `tarfile` reads each."""
    long_name = b"d" * 96 + b".jpg"  # exactly 100 bytes: no NUL ends it
    left = header(b"left.jpg", size_field=b"15\0\0\0\0\0\0\0\0\0\0") + b"y" * 13 + bytes(BLOCK - 13)
    plain = bytearray(header(b"plain.jpg", 1))
    total = sum(plain[:148]) + 256 + sum(plain[156:])
    plain[148:156] = b"%o\0" % total + b" " * (7 - len(b"%o" % total))  # "10542\0  ": no leading zeros
    path = write(
        tmp_path,
        member(long_name, b"a"),
        left,
        bytes(plain) + b"p" + bytes(BLOCK - 1),
        pax({"path": "boX/"}),  # a regular file named with a slash by its record: the slash goes
        member(b"ignored.jpg", b"b"),
        pax({"path": "glob.jpg/"}, b"g"),
        member(b"first_after_global.jpg", b"c"),
        member(b"/", b"", kind=b"\0"),  # an old folder's name, one slash
        member(b"e" * 99 + b"/", b"", kind=b"\0"),  # and one of 100 bytes
        END,
    )
    ours, problem = scan_tar(path)
    assert problem is None and files(ours) == theirs(path)
    assert [m.name for m in ours][:5] == [long_name.decode(), "left.jpg", "plain.jpg", "boX", "glob.jpg"]
    assert ours[1].size == 0o15 and [m.kind for m in ours[-2:]] == ["folder", "folder"]


def test_a_tar_cut_right_after_a_pax_record_ends_after_the_member_before(tmp_path):
    a = member(b"a.jpg", b"x")
    record = pax({"path": "b.jpg"})
    body = int(record[124:136].rstrip(b"\0"), 8)
    got, why = scan_tar(write(tmp_path, a, record[: BLOCK + body]))  # the record whole, its padding cut
    assert files(got) == [("a.jpg", 512, 1)] and why == f"truncated: no end-of-archive blocks after member a.jpg; {LOST}"


def test_the_header_fields_at_their_edges():
    assert octal(bytes([0x80, 1] + [0] * 10)) == 1 << 80  # base-256: every byte after the first counts
    signed = header(b"\x7f\x80.jpg", 1, signed=True)  # DEL (127) is not a high byte; 128 is
    assert header_ok(signed) and header_ok(header(b"\x7f\x80.jpg", 1))
    bad_size = header(b"a.jpg", size_field=b"90000000012\0")  # 9 is no octal digit
    assert not header_ok(bad_size)
    assert pax_fields(b"12 p\xe9th=abc\n") == {"p\udce9th": "abc"}  # a keyword that is not UTF-8: its bytes kept


def test_a_read_only_shard_is_walked(tmp_path):
    """The walk maps a shard read-only: one without write permission is read (the map opens no file for
    writing, for any user)."""
    shard = write(tmp_path, member(b"a.jpg", b"x"), END, name="ro.tar")
    shard.chmod(0o444)
    assert files(scan_tar(shard)[0]) == [("a.jpg", 512, 1)]


def test_a_global_record_at_the_archive_s_start_names_its_first_member(tmp_path):
    path = write(tmp_path, pax({"path": "every.jpg/"}, b"g"), member(b"first.jpg", b"1"), END)
    assert files(scan_tar(path)[0]) == theirs(path) == [("every.jpg", 1536, 1)]
