"""The command line's options: every command listed, its help (defaults, inputs, the synopsis), usage
errors as one line with exit code 2."""

import pytest

from dali_fast.cli import main
from dali_fast.cli_options import build_parser

COMMANDS = ["make-synthetic", "pack", "inspect", "bench", "stages", "train", "doctor"]


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


def _option_help(command: str, capsys) -> dict[str, str]:
    """Each option of ``command --help``: its help entry, on one line."""
    import re

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + text)
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries if e.strip()}


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_shows_every_default(cmd, capsys):
    import argparse

    parser = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]  # noqa: SLF001
    entries = _option_help(cmd, capsys)
    missing = []
    for action in parser._actions:  # noqa: SLF001
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        if action.default is None or action.default is False:  # unset, or a switch that is off: nothing to show
            continue
        shown = ("on" if action.default else "off") if isinstance(action.default, bool) else str(action.default)
        if isinstance(action, argparse.BooleanOptionalAction):
            shown = "on" if action.default else "off"
        if f"default:{shown}".replace(" ", "") not in entries[action.option_strings[0]].replace(" ", ""):
            missing.append(f"{action.option_strings[0]}: {entries[action.option_strings[0]]}")
    assert not missing, missing


def test_pack_and_inspect_help_name_every_input_they_take(capsys):
    for cmd, inputs in (
        ("pack", ["ImageFolder", "WebDataset shards", ".tar", "folder of .tar files", "brace pattern"]),
        ("inspect", ["packed set", "ImageFolder", "WebDataset shards", "brace pattern", "of Parquet files", "s3://"]),
        ("train", ["packed set", "ImageFolder", "WebDataset shards", "URL of shards"]),
        ("bench", ["packed set", "ImageFolder", "WebDataset shards", "URL of shards"]),
    ):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert all(x in out for x in inputs), (cmd, [x for x in inputs if x not in out])


def test_the_top_level_help_has_a_complete_synopsis(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    synopsis = capsys.readouterr().out.split("synopsis:", 1)[1]
    for cmd, parser in next(a for a in build_parser()._actions if a.dest == "command").choices.items():  # noqa: SLF001
        assert f"dali-fast {cmd} " in synopsis
        for action in parser._actions:  # noqa: SLF001
            for option in action.option_strings:
                assert option in synopsis, (cmd, option)
