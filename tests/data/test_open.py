"""`open_dataset`: which reader opens what, and what it says about what it cannot open."""

from pathlib import Path

import pytest
from builders import jpeg_bytes, one_line

from dali_fast.data.open import open_dataset


def test_open_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such data set"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "x.jpg").write_bytes(jpeg_bytes())
    with pytest.raises(ValueError) as e:
        open_dataset(tmp_path / "flat")
    assert one_line(e) == (
        f"{tmp_path / 'flat'}: not a data set; expected a packed folder (index.bin + data.bin, from `dali-fast pack`), "
        "WebDataset shards (.tar), Parquet files (.parquet) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )


def test_a_url_opens_remote_shards_with_the_keywords(monkeypatch):
    import dali_fast.data.remote.webdataset as remote

    opened = []
    monkeypatch.setattr(remote, "RemoteShardsReader", lambda url, **kw: opened.append((url, kw)) or "remote")
    assert open_dataset("s3://bucket/train-{000000..000003}.tar", cache_dir="/tmp/c", shuffle_window=4) == "remote"
    kw = {"target": None, "num_classes": None, "classes": None, "cache_dir": "/tmp/c", "shuffle_window": 4}
    assert opened == [("s3://bucket/train-{000000..000003}.tar", kw)]


def test_a_folder_is_told_by_what_it_holds_and_a_mix_is_refused(tmp_path, cache):
    from builders import write_shards  # skipped without the webdataset package

    from dali_fast.data.pack.packed import pack

    write_shards(tmp_path / "shards")
    assert type(open_dataset(tmp_path / "shards")).__name__ == "WebDatasetReader"
    (tmp_path / "shards" / ".hidden").mkdir()  # hidden entries are neither
    assert type(open_dataset(tmp_path / "shards")).__name__ == "WebDatasetReader"
    (tmp_path / "shards" / "cat").mkdir()
    (tmp_path / "shards" / "cat" / "a.jpg").write_bytes(jpeg_bytes())
    for call in (lambda: open_dataset(tmp_path / "shards"), lambda: pack(tmp_path / "shards", tmp_path / "p")):
        with pytest.raises(ValueError) as e:
            call()
        assert one_line(e).startswith(
            f"{tmp_path / 'shards'}: holds both WebDataset shards (3 shards: train-000000.tar, ...) and sub-folders "
            "(1 folder: cat, ...); a data set is one or the other"
        )
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("pattern", ["x-{000..003}.tar", "x-{a,b}", "{x,y}/{0..1}.tar"])
def test_a_brace_pattern_that_matches_no_file_is_named(tmp_path, pattern):
    with pytest.raises(FileNotFoundError) as e:
        open_dataset(tmp_path / pattern)
    assert one_line(e).startswith(f"{tmp_path / pattern}: the pattern matches no file (none of ")


def test_a_url_is_routed_by_the_name_it_spells_and_only_a_folder_is_listed(monkeypatch):
    """A URL ending in .tar or .parquet (or a brace pattern's first choice doing so) says what it names;
    a brace pattern of other names is shards; only a bare folder costs a listing (`holds_parquet`), with the
    storage options given."""
    from dali_fast.data.open import _remote_parquet
    from dali_fast.data.remote import parquet_index

    listed: list[tuple] = []
    monkeypatch.setattr(parquet_index, "holds_parquet", lambda url, so: listed.append((url, so)) or url.endswith("pq"))
    kw = {"storage_options": {"anon": True}}
    named = {
        "s3://b/train-000000.tar": False,
        "s3://b/train-{000000..000009}.tar": False,
        "s3://b/{a,b}.tar": False,
        "s3://b/train-{0..1}": False,  # a pattern names shards
        "s3://b/x.parquet": True,
        "s3://b/{a.parquet,b.parquet}": True,
        "gs://b/data/train-{00000..00001}-of-00002.parquet": True,
    }
    assert {url: _remote_parquet(url, kw) for url in named} == named and listed == []
    assert _remote_parquet("s3://b/folder-pq", kw) is True and _remote_parquet("s3://b/shards/", kw) is False
    assert listed == [("s3://b/folder-pq", {"anon": True}), ("s3://b/shards/", {"anon": True})]


def test_a_packed_folder_that_also_holds_shards_opens_as_the_pack(tmp_path, cache):
    """index.bin makes a folder a pack, whatever else it holds (shards written beside it, say)."""
    from builders import jpeg_bytes, make_folder, write_shards

    from dali_fast.data.pack.packed import pack

    pack(make_folder(tmp_path / "src", {"a": [jpeg_bytes()] * 3}), tmp_path / "p", progress=False)
    write_shards(tmp_path / "p")  # .tar files beside the pack's files
    assert type(open_dataset(tmp_path / "p")).__name__ == "MemmapReader" and len(open_dataset(tmp_path / "p")) == 3


def test_urls_are_remote_and_paths_are_not():
    from dali_fast.data.remote.store import is_remote

    assert is_remote("s3://b/x.tar") and is_remote("gs://b/x-{0..3}.tar") and is_remote("https://h/x.tar")
    assert not is_remote("data/train") and not is_remote("file:///data/x.tar") and not is_remote(Path("s3:/x"))
