"""`pack` with worker processes: byte-identical output for any worker count, a killed pack leaves nothing,
memory independent of the image count, workers capped at the CPUs."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from builders import jpeg_bytes, make_folder

from dali_fast.data.format import DATA_FILE, INDEX_FILE
from dali_fast.data.pack.packed import pack
from dali_fast.data.packed import MemmapReader


@pytest.mark.parametrize("max_side", [None, 128])
def test_parallel_pack_is_byte_identical_for_any_worker_count(photo_folder, tmp_path, max_side):
    outputs = {}
    for workers in (1, 2, 4):
        dst = tmp_path / f"w{workers}"
        report = pack(photo_folder, dst, max_side=max_side, workers=workers, progress=False)
        assert report.records == 59 and len(report.skipped) == 1
        outputs[workers] = [(dst / f).read_bytes() for f in (INDEX_FILE, DATA_FILE, "paths.bin")]
    assert outputs[1] == outputs[2] == outputs[4]
    with pytest.raises(ValueError, match="workers=0: must be 1 or more"):
        pack(photo_folder, tmp_path / "w0", workers=0, progress=False)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that are still its children."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan reaped by init is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 3])
def test_a_killed_parallel_pack_leaves_no_destination(photo_folder, tmp_path, workers):
    dst = tmp_path / "packed"
    code = f"from dali_fast import pack; pack({str(photo_folder)!r}, {str(dst)!r}, workers={workers}, progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.stat().st_size for p in tmp_path.glob(".packed.*.tmp/data.bin")):
        time.sleep(0.005)
    workers_of_pack = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not dst.exists()
    assert (len(workers_of_pack) > 0) == (workers > 1)  # (capped at the CPUs)
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(pid) for pid in workers_of_pack):
        time.sleep(0.05)
    assert [pid for pid in workers_of_pack if alive(pid)] == []  # none left waiting for tasks forever
    assert pack(photo_folder, dst, workers=workers, progress=False).records == 59  # and the next pack completes
    assert list(tmp_path.glob(".packed.*.tmp")) == []


@pytest.mark.slow
def test_pack_memory_does_not_grow_with_the_number_of_images(tmp_path):
    """Peak RSS packing 5,000 images stays within a fixed budget of packing 500 (2 workers, verify on)."""
    import io as _io

    from PIL import Image

    def folder(n: int) -> Path:
        root = tmp_path / f"src{n}"
        if root.exists():
            return root
        for c in range(5):
            (root / f"c{c}").mkdir(parents=True)
        buf = _io.BytesIO()  # noise compresses badly: about 25 KB each, 120 MB for 5,000
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(
            buf, "JPEG", quality=95
        )
        for i in range(n):
            (root / f"c{i % 5}" / f"{i:05d}.jpg").write_bytes(buf.getvalue())
        return root

    def peak_kib(n: int) -> int:
        code = (
            f"from dali_fast import pack; pack({str(folder(n))!r}, {str(tmp_path / f'p{n}')!r}, workers=2, progress=False)\n"
            "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')))"
        )
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)

    small, large = peak_kib(500), peak_kib(5000)
    assert large - small < 16 * 1024, f"{small} KiB for 500 images, {large} KiB for 5,000"


def test_parallel_pack_from_a_script_without_a_main_guard_runs_it_once(photo_folder, tmp_path):
    """Workers must not re-run the caller's script (what spawn and forkserver do without `if __name__ == ...`)."""
    script = tmp_path / "user_script.py"
    script.write_text(
        "from dali_fast import pack\n"
        "print('script ran', flush=True)\n"
        f"pack({str(photo_folder)!r}, {str(tmp_path / 'out')!r}, workers=2, progress=False)\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("script ran") == 1 and (tmp_path / "out" / "index.bin").is_file()


def test_parallel_pack_still_verifies_by_decoding(tmp_path):
    """An image that passes the structural check but does not decode is left out, by any worker count."""
    import odd_images

    items = [jpeg_bytes(40 + i, 30) for i in range(6)] + [odd_images.corrupt()["bogus_huffman_table_jpeg"]]
    src = make_folder(tmp_path / "src", {"a": items})
    for workers in (1, 2):
        report = pack(src, tmp_path / f"p{workers}", workers=workers, progress=False)
        assert report.records == 6 and [p for p, _ in report.skipped] == [str(src / "a" / "006.jpg")]


@pytest.fixture
def pools(monkeypatch) -> list[tuple[int, dict]]:
    """(max_workers, keyword arguments) of each process pool started while the test runs."""
    import concurrent.futures

    started: list[tuple[int, dict]] = []
    real = concurrent.futures.ProcessPoolExecutor.__init__

    def spy(self, max_workers=None, *args, **kwargs):
        started.append((max_workers, kwargs))
        real(self, max_workers, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ProcessPoolExecutor, "__init__", spy)
    return started


def test_more_workers_than_cpus_are_capped_with_a_warning(small_folder, tmp_path, caplog, pools):
    from dali_fast.machine import available_cpus

    with caplog.at_level("WARNING"):
        pack(small_folder, tmp_path / "p", progress=False, workers=999)
    started = [n for n, _ in pools]
    assert started == [available_cpus()] or (available_cpus() == 1 and started == [])
    assert any(
        m.startswith("workers=999: more than the ") and f"packing with {available_cpus()}" in m for m in caplog.messages
    )


@pytest.mark.parametrize("cpus", [1, 3])
def test_workers_are_capped_at_the_cpus_and_a_cap_is_said_exactly(
    small_folder, tmp_path, caplog, monkeypatch, pools, cpus
):
    """As many workers as CPUs: no warning, that many processes; one more: one line naming both numbers
    (in words: '1 CPU', '3 CPUs'), and the CPUs' count of processes. The pool forks (the caller's script
    is not re-run in each worker) and its workers die with this process."""
    import multiprocessing

    from dali_fast.data.pack import pool

    monkeypatch.setattr(pool, "available_cpus", lambda: cpus)
    started = pools
    pack(small_folder, tmp_path / "ref", progress=False, workers=1)
    want = sorted(MemmapReader(tmp_path / "ref").records["crc32"])
    started.clear()
    for name, workers in (("same", cpus), ("more", cpus + 1)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dali_fast.data.pack.pool"):
            pack(small_folder, tmp_path / name, progress=False, workers=workers)
        assert sorted(MemmapReader(tmp_path / name).records["crc32"]) == want
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if workers == cpus:
            assert said == []
        else:
            unit = "1 CPU" if cpus == 1 else f"{cpus} CPUs"
            assert said == [f"workers={workers}: more than the {unit} this process may use; packing with {cpus}"]
    if cpus == 1:
        assert started == []  # one worker: packed in this process
    else:
        assert [n for n, _ in started] == [cpus, cpus]
        for _, kwargs in started:
            assert kwargs["mp_context"].get_start_method() == "fork"
            assert isinstance(kwargs["mp_context"], type(multiprocessing.get_context("fork")))
            # each worker starts by dying with this process (`die_with_parent`), and packs need no other setup
            assert kwargs["initializer"] is pool._start_worker and kwargs["initargs"] == (os.getpid(), None, ())


def test_by_default_under_pack_small_images_pack_in_this_process_and_more_with_every_cpu(tmp_path, monkeypatch, pools):
    """workers=None: under PACK_SMALL images, this process packs (starting workers would cost more than the
    work), however many CPUs there are; from PACK_SMALL images on, one worker per CPU. The bytes are the same."""
    from dali_fast.data.pack import pool

    monkeypatch.setattr(pool, "available_cpus", lambda: 2)
    n = pool.PACK_SMALL
    half = n // 2
    src = make_folder(
        tmp_path / "src",
        {
            "a": [jpeg_bytes(8 + i % 5, 8) for i in range(half)],
            "b": [jpeg_bytes(9, 8 + i % 3) for i in range(n - half)],
        },
    )
    report = pack(src, tmp_path / "all", progress=False)
    assert [w for w, _ in pools] == [2] and report.records == n
    (src / "b" / f"{n - half - 1:03d}.jpg").unlink()
    pools.clear()
    report = pack(src, tmp_path / "under", progress=False)
    assert pools == [] and report.records == n - 1
    pack(src, tmp_path / "one", progress=False, workers=1)
    for name in (INDEX_FILE, DATA_FILE, "paths.bin"):
        assert (tmp_path / "under" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_reader_packs_with_workers_on_linux_and_in_this_process_elsewhere(
    small_folder, tmp_path, monkeypatch, pools, platform
):
    """A reader reaches the workers by fork: on Linux its records are read by the workers asked for; where
    the start method is not fork, by this process alone. The bytes are those of a pack in this process."""
    from dali_fast.data.pack import pool

    monkeypatch.setattr(pool, "available_cpus", lambda: 2)
    pack(small_folder, tmp_path / "ref", progress=False, workers=1)
    pack(MemmapReader(tmp_path / "ref"), tmp_path / "one", progress=False, workers=1)
    assert pools == []
    monkeypatch.setattr(sys, "platform", platform)
    report = pack(MemmapReader(tmp_path / "ref"), tmp_path / "two", progress=False, workers=2)
    assert [n for n, _ in pools] == ([2] if platform == "linux" else [])
    assert report.records == len(MemmapReader(tmp_path / "ref").records) > 1 and report.skipped == []
    for name in (INDEX_FILE, DATA_FILE, "paths.bin"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
