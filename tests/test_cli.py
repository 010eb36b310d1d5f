import importlib.util
import subprocess
import sys

import pytest

from dali_fast.cli import main

COMMANDS = ["make-synthetic", "pack", "inspect", "bench", "stages", "train", "doctor"]


def test_every_command_has_a_runner():
    from dali_fast.cli import COMMANDS as RUNNERS

    assert sorted(RUNNERS) == sorted(COMMANDS)


def run(*args):
    return subprocess.run([sys.executable, "-m", "dali_fast", *args], capture_output=True, text=True)


def test_help_from_the_real_command():
    r = run("train", "--help")
    assert r.returncode == 0 and "usage: dali-fast train" in r.stdout and "--checkpoint" in r.stdout


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
        (
            ["bench", "{data}", "--augment", "foo"],
            "--augment 'foo': use one or more of none,randaugment,trivialaugment",
        ),
        (["bench", "{data}", "--augment", "none,none"], "--augment 'none,none' names one more than once"),
        (["train", "{data}", "--augment", "none,randaugment"], "train takes one (bench compares several)"),
        (
            ["bench", "{data}", "--loaders", "baseline", "--cache-bytes", "1M"],
            "--cache-bytes does nothing to the baseline",
        ),
        (["bench", "{data}", "--loaders", "baseline", "--controller"], "--controller does nothing to the baseline"),
        (["bench", "{data}", "--out", "{file}"], "--out {file}: {file} is a file, not a folder"),
        (["stages", "{data}", "--out", "{file}"], "--out {file}: {file} is a file, not a folder"),
        (["bench", "{data}", "--batch-size", "10"], "--batch-size 10 is larger than the 9 images of {data}"),
        (["stages", "{data}", "--batch-size", "10"], "--batch-size 10 is larger than the 9 images of"),
        (["train", "{data}", "--checkpoint-every", "3"], "--checkpoint-every needs a checkpoint folder"),
        (["bench", "{data}", "--eval-crop-fraction", "0.9"], "--eval-crop-fraction shapes evaluation batches"),
        (["bench", "{data}", "--label-smoothing", "0.1"], "--label-smoothing alone changes only the loss"),
        (["bench", "{data}", "--dtype", "uint8", "--cutmix", "1"], "--mixup and --cutmix blend normalized images"),
        *(
            []
            if importlib.util.find_spec("ffcv")
            else [(["bench", "{data}", "--loaders", "torch,ffcv"], "the ffcv row needs FFCV: pip install ffcv")]
        ),
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
    assert len(err) == 1 and says.format(**names) in err[0], err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["old.jpg"]  # nothing mixed in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "data", "full"]  # nothing half-written


@pytest.mark.parametrize(
    "argv",
    [
        ["stages", "--augment", "randaugment"],
        ["stages", "--loaders", "dali"],
        ["stages", "--mixup", "0.2"],
        ["stages", "--on-error", "skip"],
        ["stages", "--random-erasing", "0.5"],
        ["stages", "--alternate"],
        ["bench", "--stages"],
        ["bench", "--total-epochs", "10"],
    ],
)
def test_each_command_takes_only_the_options_it_honours(argv, capsys):
    """`stages` runs its own fixed rows: the loader rows' flags are not among its options (nothing is
    accepted and then ignored), and `bench` no longer has the stages' flags."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"unrecognized arguments: {argv[1]}" in err[0], err


def test_inspect_on_every_kind_of_data_set(tmp_path, cache, capsys):
    from builders import write_shards  # skipped without the webdataset package

    from dali_fast.data.pack.packed import pack
    from dali_fast.data.synthetic import make_synthetic

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


@pytest.mark.parametrize("command", ["bench", "train"])
def test_an_unwritable_cache_folder_is_one_line_naming_the_variable(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "afile" / "cache"))
    assert main([command, "--images", "8", "--epochs", "1", "--out", str(tmp_path / "out")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(
        f"dali-fast {command}: error: DALI_FAST_CACHE={tmp_path / 'afile' / 'cache'}: cannot write "
    )
    assert err[0].endswith("; set DALI_FAST_CACHE to a writable folder")


def test_no_bars_without_a_terminal_but_a_line_per_stage(tmp_path):
    r = run("make-synthetic", str(tmp_path / "s"), "--images", "12", "--classes", "3")
    assert r.returncode == 0, r.stderr
    r2 = run("pack", str(tmp_path / "s"), str(tmp_path / "p"), "--workers", "1")
    assert r2.returncode == 0, r2.stderr
    r3 = run("inspect", str(tmp_path / "p"), "--verify")
    for done, stage in (
        (r, "make-synthetic: 12 images ..."),
        (r2, "pack s: 12 images ..."),
        (r3, "verify: 12 records"),
    ):
        assert "\r" not in done.stderr and "|" not in done.stderr, done.stderr  # no bar drawn into a log
        assert stage in done.stderr, done.stderr


def test_on_a_terminal_the_bar_is_closed_before_the_error_line(tmp_path):
    import fcntl
    import os
    import struct
    import termios

    from dali_fast.data.synthetic import make_synthetic

    make_synthetic(tmp_path / "s", images=9, classes=3, progress=False)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(
        [sys.executable, "-m", "dali_fast", "pack", str(tmp_path / "s"), str(tmp_path / "p"), "--shard-size", "100"],
        stdout=subprocess.DEVNULL,
        stderr=slave,
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait() == 2
    text = out.decode()
    assert "pack s:" in text and "|" in text  # a bar was drawn: this is a terminal
    at = text.index("dali-fast pack: error:")
    assert at == 0 or text[at - 1] == "\n", repr(text[max(0, at - 120) : at + 60])
    assert not (tmp_path / "p").exists()


def test_stages_takes_what_bench_s_stages_honoured_and_nothing_else():
    """`stages` has exactly the options its fixed rows use (the refusal list `bench --stages` needed is gone)."""
    from dali_fast.cli_options import build_parser

    stages = build_parser().commands["stages"]
    taken = {a.option_strings[0] for a in stages._actions if a.option_strings}  # noqa: SLF001
    assert taken == {
        "-h",
        "--images",
        "--batch-size",
        "--image-size",
        "--epochs",
        "--model",
        "--cache-bytes",
        "--out",
        "--progressive",
        "--total-epochs",
        "--total-images",
        "--cache-dir",  # data at a URL
        "--cache-limit",
        "--storage-option",
        "--classes",  # the class map, as every command that opens data takes it
    }
