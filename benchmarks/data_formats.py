"""Data at scale, measured side by side in one run.

1. `pack` of N synthetic images with --workers 1 vs --workers 2 (img/s; the outputs are checked identical).
2. `open_dataset` on S WebDataset shards of M tiny members: the first open (walks every tar header)
   vs an open with the saved index.
3. `DALIIterator` over the same images as an ImageFolder, a packed set and WebDataset shards (img/s).

    python benchmarks/data_formats.py --images 2000 --shards 1000 --members 1000
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
import time
from pathlib import Path

from dali_fast import DALIIterator, open_dataset, pack
from dali_fast.data.synthetic import make_synthetic


def tiny_shards(root: Path, shards: int, members: int) -> None:
    """Shards of `members` samples each: a 1-byte .jpg stand-in and a .cls (indexing reads headers only)."""
    root.mkdir()
    for s in range(shards):
        with tarfile.open(root / f"shard-{s:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for k in range(members):
                for ext, data in (("jpg", b"\xff"), ("cls", str(k % 10).encode())):
                    info = tarfile.TarInfo(f"s{k:06d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def epoch_rate(reader, batch: int, size: int) -> float:
    loader = DALIIterator(reader, batch, image_size=size, device="auto")
    for _ in loader:  # warm-up epoch (page cache, pipeline)
        pass
    loader.set_epoch(1)
    t = time.perf_counter()
    n = sum(len(labels) for _, labels in loader)
    loader.close()
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--members", type=int, default=1000)
    ap.add_argument("--image-size", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        os.environ["DALI_FAST_CACHE"] = str(root / "cache")
        make_synthetic(root / "folder", images=args.images, classes=10, progress=False)

        print(f"## pack {args.images} images (verify on)\n")
        print("| workers | img/s |\n|---:|---:|")
        outs = {}
        for w in (1, 2):
            t = time.perf_counter()
            pack(root / "folder", root / f"packed{w}", workers=w, progress=False)
            print(f"| {w} | {args.images / (time.perf_counter() - t):.0f} |")
            outs[w] = [(root / f"packed{w}" / f).read_bytes() for f in ("index.bin", "data.bin")]
        print(f"\nbyte-identical: {outs[1] == outs[2]}\n")

        print(f"## open_dataset on {args.shards} shards x {args.members} members\n")
        tiny_shards(root / "tiny", args.shards, args.members)
        t = time.perf_counter()
        first = open_dataset(root / "tiny")
        t_first = time.perf_counter() - t
        t = time.perf_counter()
        again = open_dataset(root / "tiny")
        t_cached = time.perf_counter() - t
        assert len(first) == len(again) == args.shards * args.members
        print("| open | seconds |\n|---|---:|")
        print(f"| first (walks {len(first):,} samples' tar headers) | {t_first:.2f} |")
        print(f"| with the saved index | {t_cached:.3f} |\n")

        import webdataset as wds  # the test extra: shards as the webdataset package writes them

        src = open_dataset(root / "folder")
        (root / "wds").mkdir()
        per = 250
        for s in range(0, len(src), per):
            with wds.TarWriter(str(root / "wds" / f"train-{s // per:06d}.tar")) as sink:
                for i in range(s, min(s + per, len(src))):
                    data, label = src[i]
                    sink.write({"__key__": f"{i:07d}", "jpg": bytes(data), "cls": str(label).encode()})
        readers = {
            "ImageFolder": src,
            "packed": open_dataset(root / "packed1"),
            "WebDataset": open_dataset(root / "wds"),
        }
        print(f"## DALIIterator, {args.images} images, batch 64, {args.image_size}px\n")
        print("| data set | img/s |\n|---|---:|")
        for name, reader in readers.items():
            print(f"| {name} | {epoch_rate(reader, 64, args.image_size):.0f} |")


if __name__ == "__main__":
    main()
