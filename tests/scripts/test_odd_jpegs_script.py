"""scripts/odd_jpegs.py makes the committed corpus again, byte for byte (where Debian's tools are installed)."""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_makes_the_committed_corpus_byte_for_byte(tmp_path):
    if shutil.which("cjpeg") is None or ctypes.util.find_library("turbojpeg") is None:
        pytest.skip("needs Debian's libjpeg-turbo-progs and libturbojpeg0 (apt-get install)")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "odd_jpegs.py"), str(tmp_path)], check=True)
    committed = ROOT / "tests" / "fixtures" / "odd_jpegs"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in committed.iterdir())
    for made in tmp_path.iterdir():
        assert made.read_bytes() == (committed / made.name).read_bytes(), made.name
