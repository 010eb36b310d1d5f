"""`dali-fast pack --format webdataset` (`pack_shards`): exact bytes and labels from every source kind,
byte-identical for any number of workers, verified as `pack` verifies, and its one-line refusals."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from builders import jpeg_bytes, make_folder, one_line

from dali_fast import open_dataset, pack, write_shards
from dali_fast.cli import main
from dali_fast.data.pack.webdataset import pack_shards

ROOT = Path(__file__).resolve().parents[2]


def source_items(root: Path) -> list[tuple[bytes, int, str]]:
    """(bytes, label, path) of every image of an ImageFolder, in its order."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    return [(f.read_bytes(), label, str(f)) for label, c in enumerate(classes) for f in sorted((root / c).iterdir())]


def shard_items(folder: Path) -> list[tuple[bytes, int]]:
    r = open_dataset(str(folder))
    return [(bytes(r[i][0]), r[i][1]) for i in range(len(r))]


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def pools(monkeypatch) -> list[int]:
    """The worker count of every process pool started (the packs' ordered pool makes one per pack)."""
    from dali_fast.data.pack import pool

    started: list[int] = []
    real = pool.ProcessPoolExecutor

    class Counted(real):
        def __init__(self, max_workers=None, *args, **kwargs):
            started.append(max_workers)
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(pool, "ProcessPoolExecutor", Counted)
    return started


def test_the_output_is_byte_identical_for_one_and_two_workers(photo_folder, tmp_path, cache, pools):
    outputs = {}
    for workers in (1, 2):
        report = pack_shards(
            photo_folder, tmp_path / f"w{workers}", shard_size=200 * 1024, workers=workers, progress=False
        )
        assert report.samples == 59 and len(report.shards) > 3
        assert [(Path(w).name, why) for w, why in report.skipped] == [
            (sorted(photo_folder.rglob("*.jpg"))[7].name, "truncated JPEG (ends inside its headers)")
        ]
        outputs[workers] = tree(tmp_path / f"w{workers}")
    assert outputs[1] == outputs[2] and list(outputs[1]) == [f"shard-{s:06d}.tar" for s in range(len(outputs[1]))]
    assert pools == [2]  # one pool, of two processes, for the second pack only


def test_verify_decodes_and_max_side_reencodes_alike_for_any_worker_count(photo_folder, tmp_path, cache):
    outputs = {}
    for workers in (1, 2):
        dst = tmp_path / f"w{workers}"
        report = pack_shards(photo_folder, dst, max_side=64, workers=workers, progress=False)
        assert report.samples == 59 and report.reencoded == 59
        outputs[workers] = tree(dst)
    assert outputs[1] == outputs[2]
    from PIL import Image

    r = open_dataset(str(tmp_path / "w1"))
    with Image.open(__import__("io").BytesIO(bytes(r[0][0]))) as im:
        assert max(im.size) == 64 and im.format == "JPEG"


def test_an_undecodable_image_that_passes_the_structural_check_is_left_out_by_verify(tmp_path, cache):
    good = jpeg_bytes()
    broken = bytearray(good)
    sos = good.index(b"\xff\xda")
    broken[sos + 20 : sos + 60] = b"\xff" * 40  # the headers and the end marker stay: only a decode finds it
    src = make_folder(tmp_path / "src", {"a": [good, bytes(broken)], "b": [good]})
    report = pack_shards(src, tmp_path / "out", workers=1, progress=False)
    no_verify = pack_shards(src, tmp_path / "nv", verify=False, workers=1, progress=False)
    assert no_verify.samples == 3
    assert report.samples == 2 and len(report.skipped) == 1
    assert report.skipped == [
        (str(src / "a" / "001.jpg"), "undecodable: OSError: broken data stream when reading image file")
    ]


def test_every_record_arrives_once_with_its_label_shuffled_or_in_order(photo_folder, tmp_path, cache):
    items = [(b, label) for b, label, _ in source_items(photo_folder) if len(b) != 500]
    kept = pack_shards(photo_folder, tmp_path / "kept", shuffle=False, workers=1, progress=False)
    assert shard_items(tmp_path / "kept") == items and kept.samples == 59
    pack_shards(photo_folder, tmp_path / "mixed", workers=1, progress=False)
    mixed = shard_items(tmp_path / "mixed")
    assert Counter(mixed) == Counter(items) and mixed != items
    order = np.random.default_rng(0).permutation(60)  # the fixed order, over the 60 files (one left out)
    truncated = next(i for i, (b, _, _) in enumerate(source_items(photo_folder)) if len(b) == 500)
    everything = [(b, label) for b, label, _ in source_items(photo_folder)]
    assert mixed == [everything[i] for i in order.tolist() if i != truncated]


def test_packed_sets_and_shards_convert_with_exact_bytes(small_folder, tmp_path, cache):
    items = [(b, label) for b, label, _ in source_items(small_folder)]
    pack(small_folder, tmp_path / "packed", progress=False)
    pack_shards(tmp_path / "packed", tmp_path / "from_packed", shuffle=False, progress=False)
    assert shard_items(tmp_path / "from_packed") == items
    write_shards(items, tmp_path / "wds", prefix="src", shard_size=4096)
    pack_shards(str(tmp_path / "wds"), tmp_path / "from_shards", shuffle=False, prefix="again", progress=False)
    assert shard_items(tmp_path / "from_shards") == items
    assert sorted(p.name for p in (tmp_path / "from_shards").iterdir()) == ["again-000000.tar"]


def test_files_of_other_kinds_in_the_folder_are_listed(small_folder, tmp_path, cache):
    (small_folder / "cat" / "notes.txt").write_text("not an image")
    report = pack_shards(small_folder, tmp_path / "out", progress=False)
    assert report.skipped == [(str(small_folder / "cat" / "notes.txt"), "not an image file (by its name)")]
    assert report.samples == 7


def test_refusals_are_one_line_before_any_work(small_folder, tmp_path):
    (tmp_path / "taken").mkdir()
    cases = [
        ((small_folder, tmp_path / "taken"), {}, f"{tmp_path / 'taken'}: already exists; remove it or choose another destination"),
        ((small_folder, small_folder / "out"), {}, f"{small_folder / 'out'}: inside the source {small_folder}; choose a destination outside it"),
        ((small_folder, tmp_path / "o"), {"prefix": "a b"}, "prefix='a b': use letters, digits, '_' and '-'"),
        ((small_folder, tmp_path / "o"), {"shard_size": 0}, "shard_size=0: a positive number of bytes"),
        ((small_folder, tmp_path / "o"), {"workers": 0}, "workers=0: must be 1 or more"),
        ((small_folder, tmp_path / "o"), {"max_side": 0}, "max_side=0: must be a positive number of pixels"),
    ]  # fmt: skip
    for args, kw, message in cases:
        with pytest.raises((ValueError, FileExistsError)) as e:
            pack_shards(*args, progress=False, **kw)
        assert one_line(e).startswith(message)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([small_folder.name, "taken"])


def test_a_failing_pack_leaves_no_destination(small_folder, tmp_path, monkeypatch):
    from dali_fast.data.pack import tar_writer as shard_writer

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_writer, "_write_sample", full)
    with pytest.raises(ValueError, match=r"out: out of room while packing \(No space left on device"):
        pack_shards(small_folder, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [small_folder.name]


# --------------------------------------------------------------------------------------------- the command


def test_the_command_writes_shards_and_says_what_it_did(small_folder, tmp_path, capsys, cache):
    argv = ["pack", str(small_folder), str(tmp_path / "out"), "--format", "webdataset", "--shard-size", "8K"]
    assert main([*argv, "--workers", "2", "--prefix", "train", "--no-shuffle"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(names) > 1 and names == [f"train-{s:06d}.tar" for s in range(len(names))]
    assert out.startswith(f"wrote 7 samples in {len(names)} shards (0.0 MiB) to {tmp_path / 'out'} in ")
    assert out.endswith("s; re-encoded 0, left out 0\n")
    assert all((tmp_path / "out" / n).stat().st_size <= 8192 for n in names)
    assert shard_items(tmp_path / "out") == [(b, label) for b, label, _ in source_items(small_folder)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prefix", "x"], "dali-fast pack: error: --prefix is for WebDataset shards; add --format webdataset"),
        (["--no-shuffle"], "dali-fast pack: error: --no-shuffle is for WebDataset shards; add --format webdataset"),
        (
            ["--format", "webdataset", "--shard-size", "0"],
            "dali-fast pack: error: --shard-size 0: shards need a size; give one such as 256M, or leave it out",
        ),
    ],
)
def test_the_command_refuses_what_it_would_ignore(small_folder, tmp_path, capsys, extra, message):
    assert main(["pack", str(small_folder), str(tmp_path / "out"), *extra]) == 2
    assert capsys.readouterr().err.strip() == message and not (tmp_path / "out").exists()


def test_the_default_format_is_still_the_packed_one(small_folder, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dali_fast", "pack", str(small_folder), str(tmp_path / "p")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "DALI_FAST_CACHE": str(tmp_path / "c")},
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["data.bin", "index.bin", "meta.json", "paths.bin"]


# --------------------------------------------------------------------------------------------- a URL


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from object_store import S3Server

    server = S3Server()
    yield server
    server.stop()


def test_a_url_destination_gets_the_shards_and_an_occupied_prefix_is_refused(s3_server, small_folder, tmp_path, cache):
    s3_server.reset()
    s3_server.client.create_bucket(Bucket="out")
    opts = {"endpoint_url": s3_server.endpoint}
    report = pack_shards(small_folder, "s3://out/set", shard_size=8192, storage_options=opts, progress=False)
    local = pack_shards(small_folder, tmp_path / "local", shard_size=8192, progress=False)
    for name in local.shards:
        assert (
            s3_server.client.get_object(Bucket="out", Key=f"set/{name}")["Body"].read()
            == (tmp_path / "local" / name).read_bytes()
        )
    assert report.shards == local.shards
    with pytest.raises(FileExistsError) as e:
        pack_shards(small_folder, "s3://out/set", storage_options=opts, progress=False)
    assert one_line(e) == (
        "s3://out/set: already holds shards of prefix 'shard' (shard-000000.tar, ...); remove them, or choose "
        "another URL or --prefix"
    )
    other = pack_shards(small_folder, "s3://out/set", prefix="more", storage_options=opts, progress=False)
    assert other.samples == 7
