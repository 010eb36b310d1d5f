"""What the commands refuse before any work, and what they say about their inputs: outputs that cannot be
written, an empty data set path, more classes than images, things that are not images, and a resolution
schedule larger than the images."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
from builders import jpeg_bytes, make_folder

from dali_fast.cli import main
from dali_fast.data.open import open_dataset
from dali_fast.data.pack.packed import pack

# A folder no one can make files in, root included (permission bits do not stop root); Linux only.
NOWHERE = {"proc": Path("/proc/dali_fast_nowhere"), "sys": Path("/sys/dali_fast_nowhere")}
CANNOT = {
    "proc": "cannot write in /proc (No such file or directory)",
    "sys": "cannot write in /sys (Permission denied)",
}
linux = pytest.mark.skipif(sys.platform != "linux", reason="/proc and /sys are Linux's")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    return make_folder(root / "imgs", {"a": [jpeg_bytes(40, 30)] * 6, "b": [jpeg_bytes(30, 40)] * 6})


def error_lines(capsys) -> tuple[str, list[str]]:
    captured = capsys.readouterr()
    return captured.out, [x for x in captured.err.splitlines() if x.strip() and not x.startswith(("INFO", "WARNING"))]


TRAIN = [
    "train",
    "--loader",
    "torch",
    "--epochs",
    "1",
    "--model",
    "resnet_tiny",
    "--batch-size",
    "4",
    "--image-size",
    "16",
]


@linux
@pytest.mark.parametrize("where", ["proc", "sys"])
@pytest.mark.parametrize("flag", ["--out", "--checkpoint", "--record-indices"])
def test_train_outputs_that_cannot_be_written_are_exit_2_before_any_work(data, capsys, where, flag):
    target = NOWHERE[where] / ("r.jsonl" if flag == "--record-indices" else "")
    assert main([*TRAIN, str(data), flag, str(target)]) == 2
    out, err = error_lines(capsys)
    assert out == ""  # no "training ..." line, no epoch
    shown = NOWHERE[where] / "r.jsonl" if flag == "--record-indices" else NOWHERE[where]
    assert err == [f"dali-fast train: error: {flag} {shown}: {CANNOT[where]}; choose another path"]


def test_record_indices_naming_a_folder_is_exit_2_before_any_work(data, tmp_path, capsys):
    (tmp_path / "indices").mkdir()
    assert main([*TRAIN, str(data), "--record-indices", str(tmp_path / "indices")]) == 2
    out, err = error_lines(capsys)
    assert out == ""
    assert err == [
        f"dali-fast train: error: --record-indices {tmp_path / 'indices'}: is a folder, not a file; choose another path"
    ]


@linux
def test_bench_out_that_cannot_be_written_is_exit_2_before_any_work(tmp_path, capsys):
    """Found before the data set is even looked at: a missing one would be said first otherwise."""
    assert main(["bench", str(tmp_path / "no-such-data"), "--out", str(NOWHERE["sys"])]) == 2
    out, err = error_lines(capsys)
    assert out == "" and err == [
        f"dali-fast bench: error: --out {NOWHERE['sys']}: {CANNOT['sys']}; choose another path"
    ]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_folder_is_refused_for_a_user(data, tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o555)
    assert main([*TRAIN, str(data), "--out", str(tmp_path / "ro" / "out")]) == 2
    _, err = error_lines(capsys)
    assert err == [
        f"dali-fast train: error: --out {tmp_path / 'ro' / 'out'}: cannot write in {tmp_path / 'ro'} "
        "(Permission denied); choose another path"
    ]


@pytest.mark.parametrize("command", [["inspect", ""], ["inspect", "", "--verify"], ["train", ""], ["bench", ""]])
def test_an_empty_data_set_path_is_exit_2(tmp_path, capsys, monkeypatch, command):
    """'' is not the current folder (which inspect described as an ImageFolder)."""
    make_folder(tmp_path / "cwd", {"a": [jpeg_bytes()]})
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(command) == 2
    out, err = error_lines(capsys)
    assert out == ""
    assert err == [f"dali-fast {command[0]}: error: the data set is an empty path (''); name a folder, shards or a URL"]


def test_empty_paths_are_refused_by_the_api_too(tmp_path, monkeypatch):
    from dali_fast.data.open import open_dataset

    make_folder(tmp_path / "cwd", {"a": [jpeg_bytes()]})
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(ValueError) as e:
        open_dataset("")
    assert str(e.value) == "the data set is an empty path (''); name a folder, shards or a URL"
    with pytest.raises(ValueError, match=r"^src is an empty path \(''\); name a folder$"):
        pack("", tmp_path / "p")
    with pytest.raises(ValueError, match=r"^dst is an empty path \(''\); name a folder$"):
        pack(tmp_path / "cwd", "")


def test_more_classes_than_images_is_refused(tmp_path, capsys):
    assert main(["make-synthetic", str(tmp_path / "s"), "--images", "3", "--classes", "10"]) == 2
    out, err = error_lines(capsys)
    assert out == "" and err == [
        "dali-fast make-synthetic: error: images=3 is fewer than classes=10: 7 classes would have no image; "
        "make at least as many images as classes (--images 10) or fewer classes (--classes 3)"
    ]
    assert not (tmp_path / "s").exists()
    assert main(["make-synthetic", str(tmp_path / "s"), "--images", "3", "--classes", "3"]) == 0
    assert sorted(len(list(d.iterdir())) for d in (tmp_path / "s").iterdir()) == [1, 1, 1]


def test_the_default_set_of_few_images_has_as_many_classes(tmp_path, monkeypatch):
    from dali_fast.data.open import open_dataset
    from dali_fast.data.synthetic import default_dataset

    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path / "cache"))
    folder, packed = default_dataset(4, progress=False)
    assert open_dataset(packed).classes == ["class_0", "class_1", "class_2", "class_3"]


def test_pack_counts_what_is_not_an_image_apart_and_names_each(tmp_path, caplog, capsys):
    """A link that loops, one that leads nowhere and a text file are no records: named as not images, not
    counted as left out. A link to a folder is followed, as torchvision follows it: its images are records
    of the class. A TIFF cut short is named in its reason."""
    good = jpeg_bytes()
    src = make_folder(tmp_path / "src", {"a": [good, good], "b": [good]})
    (src / "a" / "loop.jpg").symlink_to(src / "a" / "loop.jpg")
    (src / "a" / "gone.jpg").symlink_to(src / "a" / "nothing.jpg")
    make_folder(tmp_path / "elsewhere", {"x": [good]})
    (src / "b" / "more").symlink_to(tmp_path / "elsewhere" / "x", target_is_directory=True)
    (src / "b" / "notes.txt").write_text("x")
    (src / "b" / "tiff.jpg").write_bytes(b"II*\x00" + bytes(60))  # a TIFF signature, and no directory
    with caplog.at_level(logging.WARNING, logger="dali_fast.data.pack.packed"):
        report = pack(src, tmp_path / "p", progress=False)
    assert report.records == 4
    packed = open_dataset(tmp_path / "p")  # sources relative to the pack's root, the link's path kept
    assert sorted(packed.source(i) for i in range(4)) == ["a/000.jpg", "a/001.jpg", "b/000.jpg", "b/more/000.jpg"]
    assert report.ignored == [
        (str(src / "a" / "gone.jpg"), "a link that loops or leads nowhere (No such file or directory)"),
        (str(src / "a" / "loop.jpg"), "a link that loops or leads nowhere (Too many levels of symbolic links)"),
        (str(src / "b" / "notes.txt"), "not an image file (by its name)"),
    ]
    assert report.skipped == [(str(src / "b" / "tiff.jpg"), "truncated TIFF (ends inside its first directory)")]
    assert report.summary().endswith("; re-encoded 0, left out 1; ignored 3 non-images")
    assert caplog.messages == [f"not an image, ignored: {p} ({what})" for p, what in report.ignored] + [
        f"left out {src / 'b' / 'tiff.jpg'}: truncated TIFF (ends inside its first directory)"
    ]


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_pillow_cannot_identify_is_named_in_its_reason(tmp_path, verify):
    """Not "cannot identify image file the record": the file's name."""
    import odd_images

    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(), odd_images.corrupt()["bad_precision_jpeg"]]})
    report = pack(src, tmp_path / "p", progress=False, verify=verify, max_side=None if verify else 16)
    assert report.skipped == [
        (
            str(src / "a" / "001.jpg"),
            f"undecodable: UnidentifiedImageError: cannot identify image file {src / 'a' / '001.jpg'}",
        )
    ]


def test_a_folder_reader_names_a_link_loop_and_keeps_a_broken_link_as_a_bad_record(tmp_path, caplog):
    """Reading a folder, a link named like an image that leads nowhere stays a record (the loaders name it
    when they read it, as a file that vanished); a link to a folder is followed, and one that leads back to
    a folder above it (a loop, which torchvision would follow until the path is too long) is named."""
    from dali_fast.data.folder import ImageFolderReader

    src = make_folder(tmp_path / "src", {"a": [jpeg_bytes(), jpeg_bytes()]})
    (src / "a" / "loop.jpg").symlink_to(src / "a" / "loop.jpg")
    (src / "a" / "sub.jpg").symlink_to(tmp_path / "src", target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="dali_fast.data.folder"):
        reader = ImageFolderReader(src)
    assert [reader.source(i) for i in range(len(reader))] == [
        str(src / "a" / n) for n in ("000.jpg", "001.jpg", "loop.jpg")
    ]
    loop = src / "a" / "sub.jpg" / "a"
    assert caplog.messages == [f"left out {loop}: a link back to a folder above it (a loop): not followed"]


def test_a_schedule_larger_than_most_images_warns_once(tmp_path, caplog):
    from dali_fast.data.open import open_dataset
    from dali_fast.train.run import run_train
    from dali_fast.transforms.recipe import Progressive, Recipe

    src = make_folder(tmp_path / "src", {c: [jpeg_bytes(30 + i, 24 + i) for i in range(6)] for c in "ab"})
    reader = open_dataset(src)
    kw = dict(
        loader="torch", model="resnet_tiny", batch_size=4, image_size=16, num_workers=0, amp=False, emit=lambda _: None
    )
    ramp = Recipe(image_size=16, resolution=Progressive(16, 40, 0, 1, step=8))
    with caplog.at_level(logging.WARNING, logger="dali_fast.train"):
        run_train(reader, epochs=2, recipe=ramp, **kw)
    said = [m for m in caplog.messages if "resolution schedule" in m]
    assert said == [
        "the resolution schedule 16:40:0:1:8 trains at 40 px (epoch 1), more than the shorter side of 12 of 12 "
        "images sampled (median 26 px): their crops are all upscaled, which costs time and adds no detail; end "
        "the schedule at 26 px or less"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dali_fast.train"):
        run_train(reader, epochs=1, recipe=ramp, **kw)  # this run stays at 16 px: nothing to say
        run_train(reader, epochs=2, recipe=Recipe(image_size=16, resolution=Progressive(16, 24, 0, 1, step=8)), **kw)
    assert [m for m in caplog.messages if "resolution schedule" in m] == []
