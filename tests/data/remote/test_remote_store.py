"""What names remote shards (the object-store side of remote data; downloads are tested against servers
in test_remote.py)."""

from __future__ import annotations

from pathlib import Path

from dali_fast.data.remote.store import is_remote


def test_urls_are_remote_and_paths_are_not():
    assert is_remote("s3://b/x.tar") and is_remote("gs://b/x-{0..3}.tar") and is_remote("https://h/x.tar")
    assert not is_remote("data/train") and not is_remote("file:///data/x.tar") and not is_remote(Path("s3:/x"))
