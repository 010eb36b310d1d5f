"""File writes (`dali_fast.files`): atomic files and folders, what dead runs left behind, the cache
folder."""

import os
import subprocess
import sys

import pytest

from dali_fast.files import atomic_dir, atomic_write, clean_stale, default_cache_dir


def test_atomic_write_never_exposes_a_partial_file(tmp_path):
    path = tmp_path / "sub" / "state.bin"
    atomic_write(path, lambda f: f.write(b"old contents"))
    seen_during_write = []

    def write(f):
        f.write(b"new ")
        f.flush()
        seen_during_write.append(path.read_bytes())  # a reader in the middle of the write
        f.write(b"contents")

    atomic_write(path, write, durable=True)
    assert seen_during_write == [b"old contents"]
    assert path.read_bytes() == b"new contents"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.bin"]


def test_atomic_write_failure_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


def test_atomic_write_removes_temporaries_of_dead_writers_only(tmp_path):
    path = tmp_path / "state.bin"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = tmp_path / f".state.bin.{int(dead.stdout)}.tmp"
    live_tmp = tmp_path / f".state.bin.{os.getppid()}.tmp"  # a writer that is still running
    dead_tmp.write_bytes(b"partial")
    live_tmp.write_bytes(b"in progress")
    atomic_write(path, lambda f: f.write(b"x"))
    assert not dead_tmp.exists() and live_tmp.exists()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def test_atomic_dir_shows_the_folder_only_when_complete(tmp_path):
    dst = tmp_path / "out"
    with atomic_dir(dst) as tmp:
        (tmp / "a").write_bytes(b"1")
        assert not dst.exists() and tmp.parent == tmp_path and tmp.name.startswith(".out.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (dst / "a").read_bytes() == b"1"
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty) as tmp:  # an empty folder is replaced
        (tmp / "b").write_bytes(b"2")
    assert (empty / "b").read_bytes() == b"2"


def test_a_failing_atomic_dir_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="disk full"), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_bytes(b"half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_appearing_meanwhile_is_named_and_kept(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(FileExistsError) as e, atomic_dir(dst, doing="packing", what="pack") as tmp:
        (tmp / "mine").write_bytes(b"1")
        dst.mkdir()
        (dst / "theirs").write_bytes(b"2")
    assert str(e.value) == f"{dst}: appeared while packing (another pack to the same place?); this pack is discarded"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and sorted(p.name for p in dst.iterdir()) == ["theirs"]


def test_clean_stale_removes_dead_runs_files_and_folders_only(tmp_path):
    dst, dead = tmp_path / "set", _dead_pid()
    left = [tmp_path / f".set.{dead}.tmp", tmp_path / f".set.{dead}-0a1b.tmp"]
    kept = [tmp_path / f".set.{os.getppid()}-0a1b.tmp", tmp_path / f".set.{os.getpid()}.tmp", tmp_path / ".set.x.tmp"]
    left[0].write_bytes(b"partial")
    left[1].mkdir()
    (left[1] / "data.bin").write_bytes(b"partial")
    for p in kept:
        p.mkdir()
    other = tmp_path / f".settings.{dead}.tmp"  # another path's temporary
    other.write_bytes(b"x")
    clean_stale(dst)
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept) and other.exists()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DALI_FAST_CACHE")
    assert str(default_cache_dir()).endswith(".cache/dali_fast")
