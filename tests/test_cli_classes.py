"""``--classes FILE`` on the commands that open data: one class map for every split, from a file."""

from __future__ import annotations

import json

import pytest
from builders import jpeg_bytes, make_folder

from dali_fast.cli import main
from dali_fast.data.open import open_dataset

NAMES = ["bird", "cat", "dog", "fish"]


def test_inspect_and_pack_take_the_class_map_from_a_file(tmp_path, cache, capsys):
    make_folder(tmp_path / "val", {c: [jpeg_bytes()] for c in ("cat", "fish")})
    (tmp_path / "classes.txt").write_text("\n".join(NAMES) + "\n")
    assert main(["inspect", str(tmp_path / "val"), "--classes", str(tmp_path / "classes.txt")]) == 0
    assert "classes:  4 (bird, cat, dog, fish)" in capsys.readouterr().out
    assert main(["pack", str(tmp_path / "val"), str(tmp_path / "p"), "--classes", str(tmp_path / "classes.txt")]) == 0
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["classes"] == NAMES
    assert open_dataset(tmp_path / "p").labels.tolist() == [1, 3]


def test_a_class_list_that_cannot_serve_is_one_line_exit_2(tmp_path, cache, capsys):
    make_folder(tmp_path / "val", {c: [jpeg_bytes()] for c in ("cat", "frog")})
    (tmp_path / "classes.json").write_text(json.dumps(NAMES))
    assert main(["inspect", str(tmp_path / "val"), "--classes", str(tmp_path / "classes.json")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "class 'frog'" in err[0] and "is not among the 4 declared classes" in err[0]
    with pytest.raises(SystemExit) as e:  # a usage error: argparse's exit
        main(["inspect", str(tmp_path / "val"), "--classes", str(tmp_path / "none.txt")])
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "none.txt: no such class list" in err[0]


def test_train_takes_the_class_map_for_both_sets(tmp_path, cache, capsys):
    """train with --classes: both sets numbered by the file, a validation set without a class too."""
    make_folder(tmp_path / "train", {c: [jpeg_bytes(20 + i, 18) for i in range(3)] for c in ("cat", "fish")})
    make_folder(tmp_path / "val", {"fish": [jpeg_bytes(30, 18)]})
    (tmp_path / "classes.txt").write_text("\n".join(NAMES) + "\n")
    args = ["train", str(tmp_path / "train"), "--val", str(tmp_path / "val"), "--classes", str(tmp_path / "classes.txt")]
    args += ["--loader", "torch", "--epochs", "1", "--model", "resnet_tiny", "--batch-size", "2", "--image-size", "16"]
    args += ["--num-workers", "0", "--checkpoint", str(tmp_path / "ck")]
    assert main(args) == 0
    from dali_fast.train.checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "ck" / "checkpoint.pt")["classes"] == NAMES  # the map the run was trained on, kept with it
