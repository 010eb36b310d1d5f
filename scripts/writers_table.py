"""What dali_fast reads of files other tools write: a table of writer -> samples read and labels right, by both
loaders, on 1 and 2 ranks (exact evaluation: each sample once). Each writer writes with the tool itself
(webdataset's ShardWriter, tarfile, pandas, Polars, pyarrow, Hugging Face datasets, a folder as torchvision
reads it), and the truth is what that tool's own reader gives back.

    python scripts/writers_table.py [--out table.md]

Needs the test extras (webdataset, pyarrow, pandas, polars, datasets); DALI for the DALIIterator columns.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

N = 120  # samples per writer


def _jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (12 + i % 5, 16, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


NAMES = ["猫", "犬", "bird", "fish"]


def _key(i: int) -> str:
    """1 key in 10 over 100 bytes, class folders named in Japanese: what ShardWriter users write."""
    return ("n" * 100 + f"/{i:05d}") if i % 10 == 3 else f"{NAMES[i % 4]}/{i:05d}"


def shardwriter(root: Path) -> tuple[str, dict[str, int]]:
    import webdataset as wds

    root.mkdir()
    with wds.ShardWriter(str(root / "s-%06d.tar"), maxcount=50, verbose=0) as sink:
        for i in range(N):
            sink.write({"__key__": _key(i), "jpg": _jpeg(i), "cls": i % 4})
    spec = str(root / "s-{000000..000002}.tar")
    truth = {s["__key__"]: int(s["cls"]) for s in wds.WebDataset(spec, shardshuffle=False)}
    return spec, truth


def tar_format(fmt: int) -> Callable[[Path], tuple[str, dict[str, int]]]:
    def write(root: Path) -> tuple[str, dict[str, int]]:
        import webdataset as wds

        root.mkdir()
        path = root / "t.tar"
        with tarfile.open(path, "w", format=fmt, encoding="utf-8") as tf:
            for i in range(N):
                for ext, data in (("jpg", _jpeg(i)), ("cls", str(i % 4).encode())):
                    info = tarfile.TarInfo(f"{_key(i)}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        return str(path), {s["__key__"]: int(s["cls"]) for s in wds.WebDataset(str(path), shardshuffle=False)}

    return write


def pandas_strings(root: Path) -> tuple[str, dict[str, str]]:
    import pandas as pd

    root.mkdir()
    frame = pd.DataFrame({"image": [_jpeg(i) for i in range(N)], "label": [NAMES[i % 4] for i in range(N)]})
    frame.to_parquet(root / "train.parquet", row_group_size=40)
    return str(root / "train.parquet"), {str(i): NAMES[i % 4] for i in range(N)}


def pandas_categorical(root: Path) -> tuple[str, dict[str, str]]:
    import pandas as pd

    root.mkdir()
    labels = pd.Categorical([NAMES[i % 4] for i in range(N)], categories=["fish", "bird", "犬", "猫", "unused"])
    pd.DataFrame({"image": [_jpeg(i) for i in range(N)], "label": labels}).to_parquet(root / "c.parquet")
    codes = pd.read_parquet(root / "c.parquet")["label"].cat.codes.tolist()  # pandas' own numbering
    return str(root / "c.parquet"), {str(i): int(c) for i, c in enumerate(codes)}


def polars_enum(root: Path) -> tuple[str, dict[str, str]]:
    import polars as pl

    root.mkdir()
    frame = pl.DataFrame(
        {"image": [_jpeg(i) for i in range(N)], "label": pl.Series([NAMES[i % 4] for i in range(N)], dtype=pl.Enum(NAMES))}
    )
    frame.write_parquet(root / "e.parquet")
    codes = pl.read_parquet(root / "e.parquet")["label"].to_physical().to_list()  # Polars' own numbering
    return str(root / "e.parquet"), {str(i): int(c) for i, c in enumerate(codes)}


def hf_to_parquet(root: Path) -> tuple[str, dict[str, str]]:
    import datasets

    (root / "imgs").mkdir(parents=True)
    paths = []
    for i in range(N):
        (root / "imgs" / f"{i}.jpg").write_bytes(_jpeg(i))
        paths.append(str(root / "imgs" / f"{i}.jpg"))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    datasets.Dataset.from_dict({"image": paths, "label": [i % 4 for i in range(N)]}, features=features).to_parquet(
        str(root / "d.parquet")
    )
    return str(root / "d.parquet"), {str(i): i % 4 for i in range(N)}  # the ClassLabel's numbering


def torchvision_folder(root: Path) -> tuple[str, dict[str, str]]:
    """A folder with a dot-folder class, a linked class folder and torchvision's other extensions."""
    classes = [".hidden_class", "a", "b", "linked"]
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    truth = {}
    for i in range(N):
        cls = classes[i % 4]
        folder = outside if cls == "linked" else root / cls
        folder.mkdir(parents=True, exist_ok=True)
        ext = (".jpg", ".png", ".webp", ".bmp")[i % 3] if cls == "b" else ".jpg"
        data = _jpeg(i) if ext == ".jpg" else _reencode(_jpeg(i), ext)
        (folder / f"{i:05d}{ext}").write_bytes(data)
        truth[f"{i:05d}"] = cls
    (root / "linked").symlink_to(outside, target_is_directory=True)
    return str(root), truth


def _reencode(jpeg: bytes, ext: str) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(out, {".png": "PNG", ".webp": "WEBP", ".bmp": "BMP"}[ext])
    return out.getvalue()


WRITERS = {
    "webdataset ShardWriter (long, non-ASCII keys)": shardwriter,
    "tarfile USTAR": tar_format(tarfile.USTAR_FORMAT),
    "tarfile GNU": tar_format(tarfile.GNU_FORMAT),
    "tarfile PAX": tar_format(tarfile.PAX_FORMAT),
    "pandas, string labels": pandas_strings,
    "pandas Categorical": pandas_categorical,
    "Polars Enum": polars_enum,
    "datasets to_parquet (path references)": hf_to_parquet,
    "folder as torchvision reads it": torchvision_folder,
}


def _sample_id(source: str) -> str:
    """The writer's key of a record, from dali_fast's name for it."""
    if ".tar:" in source:
        return source.split(".tar:", 1)[1].rpartition(".")[0]
    if ".parquet:" in source:
        return source.rpartition(":")[2]
    return Path(source).stem


def read(spec: str, truth: dict[str, object], backend: str, world: int) -> tuple[int, int]:
    """(samples delivered over every rank, of them with the writer's label), each sample once or not counted."""
    from dali_fast import open_dataset
    from dali_fast.loaders.factory import make_loader

    reader = open_dataset(spec)
    delivered: dict[str, object] = {}
    for rank in range(world):
        kw = {"num_workers": 0} if backend == "torch" else {"device": "cpu", "num_threads": 1}
        loader = make_loader(reader, 16, backend=backend, train=False, image_size=16, rank=rank, world_size=world, **kw)
        for _, labels in loader:
            for i, label in zip(loader.last_indices.tolist(), labels.tolist(), strict=True):
                key = _sample_id(reader.source(i))
                if key in delivered:
                    return -1, -1  # a repeat: exact evaluation is broken
                delivered[key] = reader.classes[label] if isinstance(next(iter(truth.values())), str) else label
        loader.close() if hasattr(loader, "close") else None
    right = sum(1 for k, v in delivered.items() if truth.get(k) == v)
    return len(delivered), right


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = parser.parse_args()
    backends = ["torch", "dali"]
    rows = ["| writer | written | TorchIterator, 1 rank | 2 ranks | DALIIterator, 1 rank | 2 ranks |", "|---|---:|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("DALI_FAST_CACHE", str(Path(tmp) / "cache"))
        for k, (name, write) in enumerate(WRITERS.items()):
            spec, truth = write(Path(tmp) / f"w{k}")
            cells = []
            for backend in backends:
                for world in (1, 2):
                    try:
                        got, right = read(spec, truth, backend, world)
                    except Exception as e:  # noqa: BLE001 - a writer's file that fails to read is a cell of the table
                        cells.append(f"fails: {str(e).splitlines()[0][:100]}")
                        continue
                    cells.append("repeats" if got < 0 else f"{got} read, {right} labels right")
            rows.append(f"| {name} | {len(truth)} | " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
