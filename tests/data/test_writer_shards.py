"""`pack` and shards: a pack written in shards of a given size, and packs made from WebDataset shards."""

import pytest
from builders import jpeg_bytes, one_line

from dali_fast.data.format import DATA_FILE
from dali_fast.data.open import open_dataset
from dali_fast.data.pack.packed import pack
from dali_fast.data.packed import MemmapReader


def test_a_sharded_pack_holds_the_same_records(photo_folder, tmp_path):
    whole = pack(photo_folder, tmp_path / "whole", workers=2, progress=False)
    sharded = pack(photo_folder, tmp_path / "sharded", workers=2, shard_size=200_000, progress=False)
    a, b = MemmapReader(tmp_path / "whole"), MemmapReader(tmp_path / "sharded")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("data-*.bin"))
    assert len(shards) > 3 and shards[0] == "data-00000.bin" and not (tmp_path / "sharded" / DATA_FILE).exists()
    assert all((tmp_path / "sharded" / s).stat().st_size <= 200_000 for s in shards)
    assert whole.records == sharded.records == len(a) == len(b) == 59
    for i in range(len(a)):
        assert bytes(a[i][0]) == bytes(b[i][0]) and a[i][1] == b[i][1] and a.source(i) == b.source(i)
    views, labels = b.read_batch([58, 0, 30])
    assert [bytes(v) for v in views] == [bytes(a[i][0]) for i in (58, 0, 30)] and labels.tolist() == [
        a[i][1] for i in (58, 0, 30)
    ]
    assert b.verify() == [] and b.index_intact() and b.shard_size == 200_000
    (tmp_path / "sharded" / shards[1]).unlink()
    with pytest.raises(FileNotFoundError) as e:
        MemmapReader(tmp_path / "sharded")
    assert "a shard is missing" in one_line(e)
    with pytest.raises(ValueError, match="larger than the shard size 1000"):
        pack(photo_folder, tmp_path / "tiny", shard_size=1000, progress=False)
    assert not (tmp_path / "tiny").exists()


def test_shard_size_edges_and_messages(photo_folder, tmp_path):
    from dali_fast.data.packed import MemmapReader as MR

    largest = max(p.stat().st_size for p in photo_folder.rglob("*.jpg"))
    report = pack(
        photo_folder, tmp_path / "exact", shard_size=largest, workers=1, progress=False
    )  # a record may fill a shard
    r = MR(tmp_path / "exact")
    assert report.records == 59 and all(
        (tmp_path / "exact" / f.name).stat().st_size <= largest for f in (tmp_path / "exact").glob("data-*.bin")
    )
    assert r.verify() == []
    with pytest.raises(ValueError) as e:
        pack(photo_folder, tmp_path / "one", shard_size=1, workers=1, progress=False)
    first = sorted(photo_folder.rglob("*.jpg"))[0]
    assert one_line(e) == (
        f"{first}: {first.stat().st_size} bytes, larger than the shard size 1; use a larger --shard-size"
    )
    with pytest.raises(ValueError) as e:
        pack(photo_folder, tmp_path / "zero", shard_size=0, progress=False)
    assert one_line(e) == "shard_size=0: must be a positive number of bytes"
    assert not any(p.name.startswith(".one") or p.name == "one" for p in tmp_path.iterdir())


def test_a_shard_fills_up_exactly_before_the_next_begins(small_folder, tmp_path):
    """Records are written in pack order; a shard takes a record that fills it to exactly ``shard_size``."""
    first = pack(small_folder, tmp_path / "plain", progress=False)
    r = MemmapReader(tmp_path / "plain")
    sizes = [int(n) for n in r.records["length"]]
    exact = sizes[0] + sizes[1]
    pack(small_folder, tmp_path / "sharded", shard_size=exact, progress=False)
    assert (tmp_path / "sharded" / "data-00000.bin").stat().st_size == exact  # two records, full to the byte
    s = MemmapReader(tmp_path / "sharded")
    assert [bytes(s[i][0]) for i in range(len(s))] == [bytes(r[i][0]) for i in range(first.records)]


def test_pack_from_shards_in_one_process_reads_the_members(tmp_path, monkeypatch):
    wds = pytest.importorskip("webdataset")
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    (tmp_path / "shards").mkdir()
    images = [jpeg_bytes(30 + i, 20) for i in range(5)]
    with wds.TarWriter(str(tmp_path / "shards" / "a.tar")) as sink:
        for i, img in enumerate(images):
            sink.write({"__key__": f"k{i}", "jpg": img, "cls": str(i % 2).encode()})
    report = pack(tmp_path / "shards", tmp_path / "p", workers=1, progress=False)
    r = MemmapReader(tmp_path / "p")
    assert report.records == 5 and [bytes(r[i][0]) for i in range(5)] == images
    assert [r[i][1] for i in range(5)] == [0, 1, 0, 1, 0] and r.source(2).endswith("a.tar:k2.jpg")


def test_pack_converts_shards_to_a_packed_set(tmp_path, cache):
    from builders import write_shards  # skipped without the webdataset package

    samples = write_shards(tmp_path / "shards", label="json")
    report = pack(
        str(tmp_path / "shards" / "train-{000000..000002}.tar"), tmp_path / "packed", workers=2, progress=False
    )
    p = open_dataset(tmp_path / "packed")
    assert report.records == 21 and p.classes == ["0", "1", "2", "3"]
    assert [(bytes(p[i][0]), p[i][1]) for i in range(21)] == samples
    assert p.source(3).endswith("train-000000.tar:sample00003.jpg")


def test_pack_names_a_bad_member_by_shard_and_key(tmp_path, cache):
    wds = pytest.importorskip("webdataset")

    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(3):
            image = jpeg_bytes()[:200] if i == 1 else jpeg_bytes()  # sample 1: cut off inside its headers
            sink.write({"__key__": f"k{i}", "jpg": image, "cls": b"0"})
    report = pack(str(root / "a.tar"), tmp_path / "packed", progress=False)
    assert report.records == 2
    assert report.skipped == [(f"{root / 'a.tar'}:k1.jpg", "truncated JPEG (ends inside its headers)")]
