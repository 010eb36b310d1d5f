"""`ShardCache`: the node's shard files within the budget, pinned shards kept, dead downloads cleared."""

from __future__ import annotations

import os
import subprocess
import sys

from dali_fast.data.remote.cache import ShardCache


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


def test_a_fork_never_falls_between_opening_a_lock_file_and_recording_it(tmp_path):
    """A thread opens and closes shard lock files while the main thread forks: no child may hold a lock
    file it does not know of (it would keep a flock lock past its parent's release: a stalled cache)."""
    import threading

    from dali_fast.data.remote import cache as remote_cache

    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            remote_cache.close_lock(remote_cache.open_lock(tmp_path / "x.lock"))

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    leaked = 0
    try:
        for _ in range(200):
            pid = os.fork()
            if pid == 0:  # the child: count the lock files it still has open
                held = 0
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        held += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
                    except OSError:
                        pass
                os._exit(1 if held else 0)
            leaked += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        stop.set()
        thread.join()
    assert leaked == 0
