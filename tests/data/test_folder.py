"""`ImageFolderReader`: the reader interface over an ImageFolder, batches read in the reader threads."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import jpeg_bytes, make_folder
from spies import ConcurrencySpy

from dali_fast.data.folder import ImageFolderReader
from dali_fast.data.open import open_dataset
from dali_fast.data.pack.packed import pack


def test_image_folder_reader_same_interface(small_folder, tmp_path):
    pack(small_folder, tmp_path / "p", progress=False)
    a, b = ImageFolderReader(small_folder), open_dataset(tmp_path / "p")
    assert isinstance(open_dataset(small_folder), ImageFolderReader)
    assert a.classes == b.classes and len(a) == len(b)
    for i in range(len(a)):
        assert bytes(a[i][0]) == bytes(b[i][0]) and a[i][1] == b[i][1]
    assert Path(a.source(0)).is_file()


def test_a_class_folder_that_cannot_be_listed_is_named_not_dropped(tmp_path, monkeypatch, caplog):
    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes()], "b": [jpeg_bytes(), jpeg_bytes(40, 30)]})
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path).name == "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with caplog.at_level("WARNING"):
        reader = ImageFolderReader(src)
    assert reader.classes == ["a", "b"] and len(reader) == 1  # labels keep their meaning
    assert reader.skipped == [(str(src / "b"), "folder cannot be listed: Permission denied")]
    assert any(str(src / "b") in r.getMessage() for r in caplog.records)
    report = pack(src, tmp_path / "p", progress=False)
    assert (str(src / "b"), "folder cannot be listed: Permission denied") in report.skipped


def test_folder_batch_reads_overlap_in_the_read_threads_and_keep_their_order(tmp_path, monkeypatch):
    """A folder's files are read by the pool, several at once (a network file system's latency overlaps),
    never on the calling thread; results come back in the batch's order."""
    import threading

    import dali_fast.data.folder as folder

    images = [jpeg_bytes(20 + k, 20) for k in range(32)]
    root = make_folder(tmp_path / "imgs", {"a": images})
    reader = ImageFolderReader(root)
    spy = ConcurrencySpy(folder._read_file_checked)
    monkeypatch.setattr(folder, "_read_file_checked", spy)
    order = list(range(31, -1, -1))
    datas, labels, bad = reader.read_batch_checked(order)
    assert bad == {} and [bytes(d) for d in datas] == [images[k] for k in order] and labels.tolist() == [0] * 32
    assert spy.most >= 4, spy
    assert threading.current_thread().name not in spy.threads
    assert all(name.startswith("dali_fast-read") for name in spy.threads)


def test_folder_batch_reads_name_unreadable_and_broken_files(tmp_path):
    good = jpeg_bytes(32, 24)
    root = make_folder(tmp_path / "imgs", {"a": [good, good[:-50], good, good]})
    (root / "a" / "002.jpg").unlink()
    (root / "a" / "002.jpg").symlink_to(root / "gone.jpg")
    reader = ImageFolderReader(root)
    datas, labels, bad = reader.read_batch_checked([3, 2, 1, 0])
    assert bad == {1: "unreadable: No such file or directory", 2: "truncated JPEG (no end-of-image marker)"}
    assert datas[1] is None and bytes(datas[0]) == good and bytes(datas[2]) == good[:-50]
    views, _ = reader.read_batch([0, 3])
    assert [bytes(v) for v in views] == [good, good]
    with pytest.raises(FileNotFoundError):
        reader.read_batch([2])


def test_batch_reads_leave_no_file_open_and_the_process_exits_cleanly(tmp_path):
    """Every read closes its file, failed ones too; the idle reader threads do not hold the process at exit."""
    good = jpeg_bytes(32, 24)
    root = make_folder(tmp_path / "imgs", {"a": [good] * 6 + [good[:-30]]})
    reader = ImageFolderReader(root)
    (root / "a" / "003.jpg").unlink()  # gone after the listing

    def open_here() -> list[str]:  # this process's fds on the set's files (others come and go with other tests)
        out = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
                    out.append(fd)
        return out

    for _ in range(20):
        _, _, bad = reader.read_batch_checked(range(7))
        assert set(bad) == {3, 6}
        with pytest.raises(FileNotFoundError):
            reader.read_batch(range(7))
        assert open_here() == []
    script = (
        "from dali_fast.data.folder import ImageFolderReader; "
        f"r = ImageFolderReader({str(root)!r}); d, _, bad = r.read_batch_checked(range(6)); "
        "print(len(d), sorted(bad))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "6 [5]", done.stderr[-2000:]
