import os
import subprocess
import sys

import pytest

from dali_fast.system import atomic_write, available_cpus, cpus_per_local_rank, read_proc_kib


def test_cpus_are_shared_between_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpus_per_local_rank() == available_cpus()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(available_cpus() * 4))
    assert cpus_per_local_rank() == 1  # never zero
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpus_per_local_rank() == max(1, available_cpus() // 2)


def test_read_proc_kib(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert read_proc_kib(str(status), "VmRSS") == 1024
    assert read_proc_kib(str(status), "VmSwap") is None
    assert read_proc_kib(str(tmp_path / "missing"), "VmRSS") is None


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
