"""WebDataset shards: brace patterns, the tar walk, and what a sample is (WebDataset's rules, per shard)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import jpeg_bytes, png_bytes

from dali_fast import open_dataset
from dali_fast.data.shards import expand_shards, scan_tar
from dali_fast.data.webdataset import WebDatasetReader

wds = pytest.importorskip("webdataset")


N_SHARDS, PER_SHARD = 3, 7


def write_shards(root: Path, *, label: str = "cls", extra: dict | None = None) -> list[tuple[bytes, int]]:
    """Shards root/train-000000.tar ...; returns (image bytes, label) of every sample in order."""
    root.mkdir(parents=True, exist_ok=True)
    samples = []
    for s in range(N_SHARDS):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar")) as sink:
            for k in range(PER_SHARD):
                i = s * PER_SHARD + k
                image = png_bytes(20 + i, 10 + k, "RGB") if i % 5 == 0 else jpeg_bytes(30 + i, 20 + k)
                lab = i % 4
                sample = {"__key__": f"sample{i:05d}", "jpg" if i % 5 else "png": image}
                if label == "cls":
                    sample["cls"] = str(lab).encode()
                else:
                    sample["json"] = json.dumps({"label": lab, "caption": f"image {i}"}).encode()
                sample.update((extra or {}).get(i, {}))
                sink.write(sample)
                samples.append((image, lab))
    return samples


def test_missing_labels_other_members_and_a_truncated_shard_are_counted_or_named(tmp_path, cache):
    extra = {3: {"cls": None}, 4: {"txt": b"a caption"}, 9: {"txt": b"x"}}
    root = tmp_path / "shards"
    root.mkdir()
    samples = []
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(10):
            image = jpeg_bytes(30 + i, 20)
            sample = {"__key__": f"s{i}", "jpg": image, **{k: v for k, v in extra.get(i, {}).items() if v is not None}}
            if i != 3:
                sample["cls"] = b"1"
            sink.write(sample)
            samples.append(image)
    with wds.TarWriter(str(root / "b.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"t{i}", "jpg": jpeg_bytes(40, 30 + i), "cls": b"2"})
    blob = (root / "b.tar").read_bytes()
    _, last_offset, last_size = scan_tar(root / "b.tar")[0][-1]
    (root / "b.tar").write_bytes(blob[: last_offset + last_size // 2])  # cut in the middle of the last image
    r = WebDatasetReader(root)
    assert len(r) == 9 + 3  # a.tar: all but the unlabelled s3; b.tar: the three whole samples
    where = dict(r.skipped)
    assert where[f"{root / 'a.tar'}:s3"] == "no label (.cls, or .json with the label key)"
    assert where[str(root / "b.tar")] == "truncated: member t3.jpg runs past the end"
    assert r.ignored == Counter({"txt": 2})
    assert [bytes(r[i][0]) for i in range(9)] == [samples[i] for i in range(10) if i != 3]
    with pytest.raises(ValueError) as e:
        WebDatasetReader(root / "a.tar", on_error="raise")
    assert str(e.value).startswith(f"{root / 'a.tar'}:s3: no label") and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        WebDatasetReader(root / "b.tar", on_error="raise")
    assert str(e.value).startswith(f"{root / 'b.tar'}: truncated")


def test_json_labels_under_another_key(tmp_path, cache):
    root = tmp_path / "shards"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"k{i}", "jpg": jpeg_bytes(), "json": json.dumps({"class_id": i + 5}).encode()})
    assert WebDatasetReader(root, label_key="class_id").labels.tolist() == [5, 6, 7]
    assert open_dataset(root, label_key="class_id").labels.tolist() == [5, 6, 7]  # open_dataset passes it on
    with pytest.raises(ValueError, match="no samples with an image and a label"):
        WebDatasetReader(root)  # the default key "label" is not there: every sample is left out, and said


def test_brace_patterns_and_missing_shards(tmp_path):
    for name in ("x-000.tar", "x-001.tar", "y-000.tar"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in expand_shards(str(tmp_path / "x-{000..001}.tar"))] == ["x-000.tar", "x-001.tar"]
    assert [p.name for p in expand_shards(str(tmp_path / "{x,y}-000.tar"))] == ["x-000.tar", "y-000.tar"]
    with pytest.raises(FileNotFoundError) as e:
        expand_shards(str(tmp_path / "x-{000..003}.tar"))
    assert str(e.value) == f"{tmp_path / 'x-002.tar'} and 1 more: no such shard"


def test_scan_tar_reads_member_offsets(tmp_path):
    import tarfile

    write_shards(tmp_path / "s")
    path = tmp_path / "s" / "train-000001.tar"
    ours = scan_tar(path)
    with tarfile.open(path) as tf:
        theirs = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
    assert ours == (theirs, None)
