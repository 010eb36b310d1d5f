import subprocess
import sys

import pytest

from dali_fast.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "dali_fast", *args], capture_output=True, text=True)


@pytest.mark.parametrize("cmd", ["make-synthetic", "pack", "inspect"])
def test_help(cmd):
    r = run(cmd, "--help")
    assert r.returncode == 0 and "usage: dali-fast " + cmd in r.stdout


def test_make_pack_inspect_verify(tmp_path, capsys):
    assert main(["make-synthetic", str(tmp_path / "s"), "--images", "9", "--classes", "3"]) == 0
    assert main(["pack", str(tmp_path / "s"), str(tmp_path / "p")]) == 0
    assert main(["inspect", str(tmp_path / "p"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "records:  9" in out and "classes:  3" in out and "all 9 records match" in out


def test_bad_input_exit_2_one_line(tmp_path):
    r = run("inspect", str(tmp_path / "missing"))
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "no such data set" in lines[0]
    r = run("pack", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert r.returncode == 2 and "no such folder" in r.stderr
