"""What tests build their data from: small encoded images, a photo-like pixel array, image folders, in-memory readers, WebDataset
shards, Parquet tables in the Hugging Face layout, the JPEG markers of hand-made records, and two small checks
(a pass's first batch, a one-line error)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def jpeg_bytes(w: int = 64, h: int = 48, color=(200, 30, 60), quality: int = 90, **save) -> bytes:
    """A ``w`` x ``h`` JPEG of ``color`` with a little noise (the same bytes for the same size); ``save`` goes to Pillow."""
    rng = np.random.default_rng(w * 1000 + h)
    arr = np.clip(np.array(color, np.float32) + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "JPEG", quality=quality, **save)
    return out.getvalue()


def jpeg_files(folder: Path, n: int = 6) -> list[str]:
    """``n`` distinct small JPEG files ``0.jpg``... in ``folder`` (made if missing): their paths as text, as
    Hugging Face's ``Image`` feature takes them."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"{i}.jpg"
        p.write_bytes(jpeg_bytes(10 + i, 8))
        paths.append(str(p))
    return paths


def hf_table(images: list, labels: list, names: list[str] | None):
    """The Hugging Face layout as a pyarrow table: ``image: struct<bytes, path>`` (None: a null image),
    ``label: int64`` with a ClassLabel feature of ``names`` in the schema's metadata (None: no ClassLabel)."""
    pa = pytest.importorskip("pyarrow")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [None if b is None else {"bytes": b, "path": f"img{k}.jpg"} for k, b in enumerate(images)]
    features = {"image": {"decode": True, "_type": "Image"}}
    if names is not None:
        features["label"] = {"names": names, "_type": "ClassLabel"}
    table = pa.table({"image": pa.array(rows, image_type), "label": pa.array(labels, pa.int64())})
    return table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})


def photo(h: int = 370, w: int = 470, seed: int = 0) -> np.ndarray:
    """uint8 (h, w, 3) pixels: gradients plus uniform noise of +-50 levels per pixel, deterministic."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x * y) % 256], -1)
    return np.clip(base + rng.integers(-50, 50, (h, w, 3)), 0, 255).astype(np.uint8)


def png_bytes(w: int = 40, h: int = 30, mode: str = "RGBA") -> bytes:
    """A flat ``w`` x ``h`` PNG in ``mode``."""
    arr = np.full((h, w, len(mode)), 120, np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(out, "PNG")
    return out.getvalue()


def make_folder(root: Path, per_class: dict[str, list[bytes]], ext: str = ".jpg") -> Path:
    """An ImageFolder at ``root``: one folder per class, its images named 000, 001, ... (PNGs as .png)."""
    for cls, items in per_class.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(items):
            suffix = ".png" if data.startswith(b"\x89PNG") else ext
            name = f"{i:03d}{suffix}"
            (root / cls / name).write_bytes(data)
    return root


class IndexReader:
    """A data set whose label is the record's index, so a batch of labels names its records; or, with
    ``reversed_labels``, record i of n has label n - 1 - i (a test then tells labels from indices)."""

    reversed_labels = False  # a subclass that sets its own items keeps the index labels

    def __init__(self, items: list[bytes], classes: int | None = None, reversed_labels: bool = False):
        self.items = [np.frombuffer(b, np.uint8) for b in items]
        self.classes = [str(i) for i in range(classes or len(items))]
        self.reversed_labels = reversed_labels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], int(self.labels[i])

    @property
    def labels(self):
        return np.arange(len(self.items), dtype=np.int64)[:: -1 if self.reversed_labels else 1].copy()

    def source(self, i):
        return f"mem://{i}.jpg"


def first_batch(loader):
    """The loader's first batch, its pass then left and closed at once (not whenever the garbage collector
    reaches the generator: a pass finalized later, in the middle of other code, runs its cleanup there)."""
    batches = iter(loader)
    try:
        return next(batches)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def one_line(excinfo) -> str:
    """The message of a raised error, which must be one line."""
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- WebDataset shards

N_SHARDS, PER_SHARD = 3, 7


def write_shards(root: Path, *, label: str = "cls", extra: dict | None = None) -> list[tuple[bytes, int]]:
    """Shards root/train-000000.tar ...; returns (image bytes, label) of every sample in order (skips the test
    without the webdataset package)."""
    wds = pytest.importorskip("webdataset")
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


# ----------------------------------------------------------------------------- JPEG markers


def jpeg_segment(marker: int, body: bytes) -> bytes:
    """A JPEG marker segment: the marker, its length field, then ``body``."""
    return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


SOI, EOI = b"\xff\xd8", b"\xff\xd9"
APP0 = jpeg_segment(0xE0, b"JFIF\x00" + bytes(9))
SOS = jpeg_segment(0xDA, bytes(10))


def tar_of(path: Path, members: list[tuple[str, bytes]], fmt: int | None = None) -> Path:
    """A tar at ``path`` of ``members`` ((name, bytes)) in that order, as `tarfile` writes it (``fmt``: its
    format, default tarfile's): what a shard written by hand holds (webdataset's writer cannot write a key
    twice, or a name without a key)."""
    import tarfile

    with tarfile.open(path, "w", format=fmt if fmt is not None else tarfile.DEFAULT_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path
