"""`open_dataset`: which reader opens what, and what it says about what it cannot open."""

import pytest
from conftest import jpeg_bytes, one_line

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
        "WebDataset shards (.tar) or an ImageFolder root (ROOT/<class>/<image>.jpg|png)"
    )


def test_a_url_opens_remote_shards_with_the_keywords(monkeypatch):
    import dali_fast.data.remote as remote

    opened = []
    monkeypatch.setattr(remote, "RemoteShardsReader", lambda url, **kw: opened.append((url, kw)) or "remote")
    assert open_dataset("s3://bucket/train-{000000..000003}.tar", cache_dir="/tmp/c", shuffle_window=4) == "remote"
    assert opened == [("s3://bucket/train-{000000..000003}.tar", {"cache_dir": "/tmp/c", "shuffle_window": 4})]
