"""Checkpoint files: atomic writes (also under SIGKILL mid-write), versions, refused resumes, the index audit."""

from __future__ import annotations

import hashlib
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dali_fast.train.checkpoint import (
    IndexRecorder,
    check_resume_classes,
    check_resume_config,
    load_checkpoint,
    read_index_records,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_write_is_atomic_and_versioned(tmp_path):
    path = tmp_path / "ck" / "checkpoint.pt"
    save_checkpoint(path, {"version": 2, "w": torch.arange(4)})
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(4))
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.pt"]  # no temporary left
    save_checkpoint(path, {"version": 7})
    with pytest.raises(ValueError, match="checkpoint version 7, this dali-fast reads version 2"):
        load_checkpoint(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a dali-fast checkpoint of this version"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        load_checkpoint(tmp_path / "nothing.pt")


CONFIG = {
    "model": "resnet_tiny",
    "loader": "dali",
    "image_size": 32,
    "seed": 0,
    "holdout": 0.2,
    "records": 120,
    "world_size": 1,
    "controller": False,
    "drop_last": True,
    "fingerprint": "packed:120:1234:0badcafe",
}


@pytest.mark.parametrize(
    "key, other",
    [
        ("model", "resnet18"),
        ("loader", "torch"),
        ("image_size", 64),
        ("seed", 1),
        ("holdout", 0.25),
        ("records", 121),
        ("world_size", 2),
        ("controller", True),
        ("drop_last", False),
        ("fingerprint", "packed:120:1234:00c0ffee"),
    ],
)
def test_resume_refused_for_each_setting_in_one_line(key, other):
    with pytest.raises(ValueError) as e:
        check_resume_config("ck/checkpoint.pt", CONFIG, {**CONFIG, key: other})
    assert str(e.value) == (
        f"ck/checkpoint.pt: saved with {key}={CONFIG[key]!r}, this run has {key}={other!r}; "
        "resume with the same settings or use a new --checkpoint folder"
    )


def test_resume_accepted_with_the_same_settings():
    check_resume_config("ck/checkpoint.pt", dict(CONFIG), dict(CONFIG))  # no error
    with pytest.raises(ValueError, match="saved with new_setting=None"):
        check_resume_config("ck/checkpoint.pt", CONFIG, {**CONFIG, "new_setting": "abc"})  # a key the old run lacks
    with pytest.raises(ValueError) as e:  # a key only the saved run has (an augmentation this run leaves out)
        check_resume_config("ck/checkpoint.pt", {**CONFIG, "recipe": {"auto_augment": "randaugment"}}, CONFIG)
    assert str(e.value).startswith(
        "ck/checkpoint.pt: saved with recipe={'auto_augment': 'randaugment'}, this run has recipe=None;"
    )


def test_a_refused_recipe_or_mix_names_the_field_and_both_values_on_one_line():
    """A recipe is some twenty fields: the refusal names the one that differs (recipe.random_erasing), not two
    whole dicts; a recipe or mix one side leaves out is compared with what leaving it out means."""
    from dali_fast.train.config import TrainConfig
    from dali_fast.transforms.recipe import Recipe

    plain, erasing = Recipe(image_size=32).describe(), Recipe(image_size=32, random_erasing=0.25).describe()
    tail = "; resume with the same settings or use a new --checkpoint folder"
    cases = [
        ({**CONFIG, "recipe": plain}, {**CONFIG, "recipe": erasing}, {}, "recipe.random_erasing=0.0", "0.25"),
        (CONFIG, {**CONFIG, "recipe": erasing}, {"recipe": plain}, "recipe.random_erasing=0.0", "0.25"),
        ({**CONFIG, "recipe": erasing}, CONFIG, {"recipe": plain}, "recipe.random_erasing=0.25", "0.0"),
        (
            {**CONFIG, "recipe": plain},
            {**CONFIG, "recipe": Recipe(image_size=32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)).describe()},
            {},
            "recipe.mean=[0.485, 0.456, 0.406]",
            "[0.5, 0.5, 0.5]",
        ),
        (
            CONFIG,
            {**CONFIG, "mix": TrainConfig(mixup=0.2).mix},
            {"mix": TrainConfig().mix},
            "mix.alpha_mixup=0.0",
            "0.2",
        ),
    ]
    for saved, current, defaults, was, now in cases:
        with pytest.raises(ValueError) as e:
            check_resume_config("ck/checkpoint.pt", saved, current, defaults)
        key = was.split("=")[0]
        assert str(e.value) == f"ck/checkpoint.pt: saved with {was}, this run has {key}={now}{tail}"
        assert "\n" not in str(e.value) and len(str(e.value)) < 200
    check_resume_config("ck/checkpoint.pt", CONFIG, {**CONFIG, "recipe": plain}, {"recipe": plain})  # the default


def test_index_recorder_names_per_rank_and_survives_a_cut_line(tmp_path):
    rec = IndexRecorder(tmp_path / "idx.jsonl", rank=1, world_size=2)
    rec.write(0, 1, [5, 3])
    rec.close()
    path = tmp_path / "idx.jsonl.rank1"
    with open(path, "a") as f:
        f.write('{"epoch": 0, "step": 2, "ra')  # what a SIGKILL mid-write leaves
    assert read_index_records(path) == [{"epoch": 0, "step": 1, "rank": 1, "indices": [5, 3]}]
    assert IndexRecorder(tmp_path / "r{rank}.jsonl", rank=3, world_size=4).path.name == "r3.jsonl"
    assert IndexRecorder(tmp_path / "one.jsonl", rank=0, world_size=1).path.name == "one.jsonl"


# A child that writes a large checkpoint (version N: a header with the payload's digest, then
# 24 MiB written in 256 KiB pieces) through the same atomic_write that save_checkpoint uses, and
# says "begin" once the write has started. Importing dali_fast.files is quick (no torch).
WRITER = """
import hashlib, sys
from dali_fast.files import atomic_write
path, version = sys.argv[1], int(sys.argv[2])
piece = hashlib.sha256(str(version).encode()).digest() * 8192
payload = piece * 96
def write(f):
    sys.stdout.write("begin\\n"); sys.stdout.flush()
    f.write(b"CKPT%08d" % version + hashlib.sha256(payload).digest())
    for i in range(0, len(payload), len(piece)):
        f.write(payload[i : i + len(piece)])
atomic_write(path, write, durable=True)
"""


def _whole_version(path: Path) -> int:
    """The version of the whole checkpoint at ``path``; fails the test if it is partial or corrupt."""
    blob = path.read_bytes()
    assert blob[:4] == b"CKPT", "the checkpoint file is not a checkpoint"
    version = int(blob[4:12])
    assert hashlib.sha256(blob[44:]).digest() == blob[12:44], f"checkpoint v{version} is partial or corrupt"
    return version


def _spawn(path: Path, version: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(version)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_sigkill_during_atomic_write_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "checkpoint.pt"
    first = _spawn(path, 0)
    assert first.stdout.readline() == "begin\n"
    t0 = time.perf_counter()
    assert first.wait(60) == 0
    write_time = time.perf_counter() - t0
    assert _whole_version(path) == 0
    rng = random.Random(12)
    version, mid_write = 0, 0
    for attempt in range(1, 21):
        child = _spawn(path, attempt)
        assert child.stdout.readline() == "begin\n"
        time.sleep(rng.uniform(0, write_time))
        child.send_signal(signal.SIGKILL)
        code = child.wait(60)
        child.stdout.close()
        if code == -signal.SIGKILL:
            mid_write += 1
        else:
            assert code == 0
        got = _whole_version(path)
        assert got in (version, attempt), f"attempt {attempt}: found v{got}, expected v{version} or v{attempt}"
        version = got
    assert mid_write >= 10, f"only {mid_write} of 20 kills landed during the write"
    # a killed writer's temporary file is removed by the next write to that path
    save_checkpoint(path, {"version": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_plain_turns_numpy_and_odd_values_into_plain_python(tmp_path):
    import numpy as np

    from dali_fast.train.checkpoint import plain

    value = {"n": np.int64(7), "f": np.float32(0.5), "t": (1, 2), "p": Path("a/b"), "nested": [{"x": np.bool_(True)}]}
    out = plain(value)
    assert out == {"n": 7, "f": 0.5, "t": [1, 2], "p": "a/b", "nested": [{"x": True}]}
    assert type(out["n"]) is int and type(out["f"]) is float
    save_checkpoint(tmp_path / "c.pt", {"version": 2, "rows": out})
    assert load_checkpoint(tmp_path / "c.pt")["rows"] == out  # loadable with weights_only


def test_a_checkpoint_with_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"version": 2, "obj": Path("x")})  # not plain data: loading it would run pickled code
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    assert str(e.value) == f"{path}: not a readable dali-fast checkpoint (UnpicklingError); delete it to start over"
    save_checkpoint(path, [1, 2])  # readable, but not a dali-fast checkpoint
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    assert str(e.value) == (
        f"{path}: checkpoint version None, this dali-fast reads version 2; "
        "resume with the version that wrote it or start a new --checkpoint folder"
    )


def test_a_checkpoint_with_a_flipped_byte_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"version": 2, "w": torch.arange(1000)})
    blob = bytearray(path.read_bytes())
    for at in (len(blob) // 2, len(blob) - 1):
        damaged = bytearray(blob)
        damaged[at] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(ValueError) as e:
            load_checkpoint(path)
        assert str(e.value) == f"{path}: checksum mismatch, the checkpoint is damaged; delete it to start over"
    torch.save({"version": 2}, path)  # a plain torch file, e.g. from an older dali-fast
    with pytest.raises(ValueError, match="not a dali-fast checkpoint of this version"):
        load_checkpoint(path)


def test_index_recorder_defaults_and_nested_folders(tmp_path):
    rec = IndexRecorder(tmp_path / "a" / "b" / "idx.jsonl")  # rank 0 of 1 by default; folders are made
    rec.write(2, 5, [1])
    rec.close()
    assert read_index_records(tmp_path / "a" / "b" / "idx.jsonl") == [
        {"epoch": 2, "step": 5, "rank": 0, "indices": [1]}
    ]


def test_index_records_skip_a_cut_line_anywhere(tmp_path):
    path = tmp_path / "idx.jsonl"
    path.write_text(
        '{"epoch": 0, "step": 1, "rank": 0, "indices": [1]}\n{"epo\n{"epoch": 0, "step": 2, "rank": 0, "indices": [2]}\n'
    )
    assert [r["step"] for r in read_index_records(path)] == [1, 2]


def test_a_file_that_is_not_a_checkpoint_is_named_in_one_line(tmp_path):
    path = tmp_path / "c.pt"
    path.write_bytes(b"PK\x03\x04 a zip, or anything else")
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    assert str(e.value) == (
        f"{path}: not a dali-fast checkpoint of this version (no DFCKPT header); "
        "resume with the version that wrote it, or delete it to start over"
    )


def test_a_field_only_one_side_s_setting_has_is_named_against_none():
    """A recipe saved before a field existed (or after one was dropped): the refusal names that field, the
    side without it standing for None."""
    saved = {**CONFIG, "recipe": {"image_size": 32}}
    current = {**CONFIG, "recipe": {"image_size": 32, "random_erasing": 0.25}}
    tail = "; resume with the same settings or use a new --checkpoint folder"
    with pytest.raises(ValueError) as e:
        check_resume_config("ck/checkpoint.pt", saved, current)
    was, now = "recipe.random_erasing=None", "recipe.random_erasing=0.25"
    assert str(e.value) == f"ck/checkpoint.pt: saved with {was}, this run has {now}{tail}"
    with pytest.raises(ValueError) as e:
        check_resume_config("ck/checkpoint.pt", current, saved)
    assert str(e.value) == f"ck/checkpoint.pt: saved with {now}, this run has {was}{tail}"


def test_a_resume_on_another_class_map_is_refused_naming_the_first_difference():
    tail = "; resume on data of the same classes (--classes FILE declares them) or use a new --checkpoint folder"
    check_resume_classes("ck/checkpoint.pt", None, ["cat", "dog"])  # saved before maps were kept
    check_resume_classes("ck/checkpoint.pt", ("cat", "dog"), ["cat", "dog"])  # a tuple and a list: the same map
    with pytest.raises(ValueError) as e:
        check_resume_classes("ck/checkpoint.pt", ["cat", "dog", "emu"], ["cat", "fox", "emu"])
    assert str(e.value) == "ck/checkpoint.pt: saved with another class map (class 1 was 'dog', this run calls it 'fox')" + tail
    with pytest.raises(ValueError) as e:
        check_resume_classes("ck/checkpoint.pt", ["cat", "dog"], ["cat", "dog", "emu"])
    assert str(e.value) == "ck/checkpoint.pt: saved with another class map (2 classes, this run has 3)" + tail
    with pytest.raises(ValueError) as e:
        check_resume_classes("ck/checkpoint.pt", ["dog", "cat"], ["cat", "dog"])
    assert "(class 0 was 'dog', this run calls it 'cat')" in str(e.value)
