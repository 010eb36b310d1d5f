"""`pack` reads local data: a URL is said so in one line, before any work, not "no such folder" of the
path a URL becomes."""

from __future__ import annotations

import pytest

from dali_fast import pack


@pytest.mark.parametrize("url", ["s3://bucket/train-{000000..000003}.tar", "https://host/shards/"])
def test_pack_refuses_a_url_in_one_line(url, tmp_path):
    with pytest.raises(ValueError) as e:
        pack(url, tmp_path / "packed", progress=False)
    assert str(e.value) == f"{url}: pack reads local data; copy the shards to a local disk and pack them there"
    assert list(tmp_path.iterdir()) == []
