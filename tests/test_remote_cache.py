"""`ShardCache`: the node's shard files within the budget, pinned shards kept, dead downloads cleared."""

from __future__ import annotations

import subprocess
import sys

from dali_fast.data.remote_cache import ShardCache


def test_cache_keeps_pinned_shards_and_clears_dead_downloads(tmp_path):
    cache = ShardCache(tmp_path / "c", limit=300)
    write = lambda body: lambda tmp: tmp.write_bytes(body)  # noqa: E731
    pin_a = cache.acquire("a", 100, write(b"a" * 100), pin=True)
    assert cache.acquire("b", 100, write(b"b" * 100), pin=False) is None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "c" / f"z.part-{int(dead.stdout)}-1").write_bytes(b"z" * 50)  # a download whose process died
    assert cache.acquire("c", 100, write(b"c" * 100), pin=True) != 0
    assert not list((tmp_path / "c").glob("*.part-*"))  # cleared, so c fits
    assert cache.acquire("d", 150, write(b"d" * 150), pin=False, block_for_room=False) is False  # a, c pinned
    cache.release("a", pin_a)
    assert cache.acquire("d", 150, write(b"d" * 150), pin=False) is None
    assert sorted(p.name for p in (tmp_path / "c").glob("*.tar")) == ["c.tar", "d.tar"]  # a and b made room
    assert cache.used() <= 300 and cache.downloads == 4 and cache.evictions == 2
