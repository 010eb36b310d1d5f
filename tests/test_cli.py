import subprocess
import sys

import pytest

from dali_fast.cli import build_parser, main

COMMANDS = ["make-synthetic", "pack", "inspect", "bench", "train", "doctor"]


def run(*args):
    return subprocess.run([sys.executable, "-m", "dali_fast", *args], capture_output=True, text=True)


def test_every_command_is_listed():
    sub = next(a for a in build_parser()._actions if a.dest == "command")  # noqa: SLF001
    assert sorted(sub.choices) == sorted(COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: dali-fast {cmd}")
    assert "options:" in out


def test_help_from_the_real_command():
    r = run("train", "--help")
    assert r.returncode == 0 and "usage: dali-fast train" in r.stdout and "--checkpoint" in r.stdout


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "the following arguments are required: command"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["make-synthetic"], "the following arguments are required: out"),
        (["make-synthetic", "x", "--images", "many"], "argument --images: invalid int value: 'many'"),
        (["pack", "src"], "the following arguments are required: dst"),
        (["pack", "a", "b", "--max-side", "big"], "argument --max-side: invalid int value: 'big'"),
        (["inspect"], "the following arguments are required: dataset"),
        (["inspect", "x", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["bench", "--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
        (["bench", "--cache-bytes", "lots"], "argument --cache-bytes: 'lots' is not a size"),
        (["train", "--loader", "jax"], "argument --loader: invalid choice: 'jax'"),
        (["train", "--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
        (["doctor", "--fast"], "unrecognized arguments: --fast"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert e.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith("dali-fast") and says in lines[0] and "--help" in lines[0]


def test_usage_error_from_the_real_command_is_one_line():
    r = run("train", "--loader", "jax")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "dali-fast train: error: argument --loader: invalid choice" in r.stderr


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
