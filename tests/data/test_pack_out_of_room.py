"""`pack` that runs out of room (a file-size limit, a full disk): one line naming the destination, exit code
2, and nothing left behind that could pass for a data set."""

from __future__ import annotations

import errno
import resource
import subprocess
import sys

import pytest
from builders import make_folder, photo

from dali_fast.data.pack.packed import pack


def _photos(root, n: int = 12):
    import io

    from PIL import Image

    def jpeg(i: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(photo(120, 160, seed=i)).save(out, "JPEG", quality=95)
        return out.getvalue()

    return make_folder(root, {"a": [jpeg(i) for i in range(n)], "b": [jpeg(100 + i) for i in range(n)]})


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # bytes: less than the data set


@pytest.mark.parametrize("fmt", ["packed", "webdataset"])
def test_a_file_size_limit_is_one_line_exit_2_and_nothing_left(tmp_path, cache, fmt):
    src = _photos(tmp_path / "src")
    dst = tmp_path / "out" / "p"
    dst.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "dali_fast", "pack", str(src), str(dst), "--workers", "1", "--format", fmt],
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
        timeout=120,
    )
    err = [line for line in done.stderr.splitlines() if line.strip() and " error: " in line]
    assert done.returncode == 2, done.stderr
    assert err == [
        f"dali-fast pack: error: {dst}: out of room while packing (File too large: the disk is full, or a quota or "
        "file-size limit was reached); nothing was left there: free space, or choose another destination"
    ]
    assert not dst.exists() and list(dst.parent.iterdir()) == []  # no temporary folder either


def test_a_full_disk_is_the_same_line(tmp_path, cache, monkeypatch):
    """A full disk (ENOSPC) is injected at the writer's first data write: the same one line, nothing left."""
    from dali_fast.data.pack import packed as writer

    src = _photos(tmp_path / "src", 2)

    def full(self, payload):  # noqa: ARG001
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer._DataWriter, "write", full)
    with pytest.raises(ValueError) as e:
        pack(src, tmp_path / "p", progress=False, workers=1)
    assert str(e.value).startswith(f"{tmp_path / 'p'}: out of room while packing (No space left on device: ")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["src"]
