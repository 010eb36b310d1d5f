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
        (["make-synthetic", "x", "--images", "many"], "argument --images: 'many' is not a whole number"),
        (["make-synthetic", "x", "--seed", "-1"], "argument --seed: -1 is too small; use 0 or more"),
        (["pack", "src"], "the following arguments are required: dst"),
        (["pack", "a", "b", "--max-side", "big"], "argument --max-side: 'big' is not a whole number"),
        (["inspect"], "the following arguments are required: dataset"),
        (["inspect", "x", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["bench", "--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
        (["bench", "--cache-bytes", "lots"], "argument --cache-bytes: 'lots' is not a size"),
        (["bench", "--cache-bytes", "inf"], "argument --cache-bytes: 'inf' is not a size"),
        (["bench", "--epochs", "0"], "argument --epochs: 0 is too small; use 1 or more"),
        (["bench", "--on-error", "ignore"], "argument --on-error: invalid choice: 'ignore'"),
        (["train", "--loader", "jax"], "argument --loader: invalid choice: 'jax'"),
        (
            ["train", "--progressive", "160:192"],
            "argument --progressive: give START:END:FROM_EPOCH:TO_EPOCH[:STEP] in px and epochs, e.g. 160:192:65:76",
        ),
        (
            ["bench", "--progressive", "160:192:76:65"],
            "argument --progressive: end_epoch=65 is before start_epoch=76: the ramp ends after it starts",
        ),
        (["train", "--epochs", "1.5"], "argument --epochs: '1.5' is not a whole number"),
        (["train", "--batch-size", "0"], "argument --batch-size: 0 is too small; use 1 or more"),
        (["train", "--lr", "nan"], "argument --lr: 'nan' is not a positive number"),
        (["train", "--random-erasing", "2"], "argument --random-erasing: '2' is not in [0, 1]"),
        (["train", "--mixup", "-1"], "argument --mixup: '-1' is not a number >= 0 (0 turns it off)"),
        (["bench", "--label-smoothing", "x"], "argument --label-smoothing: 'x' is not in [0, 1]"),
        (["bench", "--eval-crop-fraction", "0"], "argument --eval-crop-fraction: '0' is not in (0, 1]"),
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


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "--loaders", ""], "--loaders is empty"),
        (["bench", "--loaders", "torch,torch"], "--loaders lists torch more than once"),
        (["make-synthetic", "{file}"], "is a file"),
        (["make-synthetic", "{full}"], "already exists and is not empty"),
        (["train", "{data}", "--out", "{file}/sub", "--epochs", "1"], "is a file, not a folder"),
        (["train", "{data}", "--checkpoint", "{file}/ck", "--epochs", "1"], "is a file, not a folder"),
        (["train", "{data}", "--batch-size", "64", "--epochs", "1"], "--batch-size 64 is larger than the 7 training"),
        (["pack", "{data}", "{full}"], "already exists"),
        (["bench", "{data}", "--augment", "foo"], "--augment 'foo': use one or more of none,randaugment,trivialaugment"),
        (["bench", "{data}", "--augment", "none,none"], "--augment 'none,none' names one more than once"),
        (["train", "{data}", "--augment", "none,randaugment"], "train takes one (bench compares several)"),
    ],
)
def test_bad_input_found_before_any_work_one_line_exit_2(tmp_path, capsys, argv, says):
    from dali_fast.data.synthetic import make_synthetic

    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.jpg").write_text("x")
    make_synthetic(tmp_path / "data", images=9, classes=3, progress=False)
    names = {"file": str(tmp_path / "afile"), "full": str(tmp_path / "full"), "data": str(tmp_path / "data")}
    assert main([a.format(**names) for a in argv]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith(("INFO", "WARNING"))]
    assert len(err) == 1 and says in err[0], err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["old.jpg"]  # nothing mixed in


def test_inspect_on_every_kind_of_data_set(tmp_path, cache, capsys):
    from test_shards import write_shards  # skipped without the webdataset package

    from dali_fast.data.synthetic import make_synthetic
    from dali_fast.data.writer import pack

    write_shards(tmp_path / "shards")
    make_synthetic(tmp_path / "folder", images=6, classes=2, progress=False)
    pack(tmp_path / "folder", tmp_path / "packed", progress=False)
    for path, kind, n in (
        ("shards", "WebDatasetReader", 21),
        ("folder", "ImageFolderReader", 6),
        ("packed", "MemmapReader", 6),
    ):
        assert main(["inspect", str(tmp_path / path)]) == 0
        out = capsys.readouterr().out
        assert f"({kind})" in out and f"records:  {n}" in out
