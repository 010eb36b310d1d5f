"""Data at scale, measured side by side in one run.

1. `pack` of N synthetic images with --workers 1 vs --workers 2 (img/s; the outputs are checked identical).
2. `open_dataset` on S WebDataset shards of M tiny members, and on P Parquet files of M rows: the first
   open (tar headers; footers and the label column) vs an open with the saved index.
3. Both loaders over the same images as an ImageFolder, a packed set, WebDataset shards and Parquet files
   (Hugging Face's layout: row groups of 100 rows), training order, img/s (median of the timed epochs).
   Parquet is read with the default order (a small set: random access, every row group kept), and as a
   set too large for the row-group cache would be: random access (a row group read for most samples)
   against the streaming order (each row group read once per pass).

    python scripts/photos.py /tmp/photos400 --images 400     # real photos (pip install scikit-image)
    python benchmarks/data_formats.py --photos /tmp/photos400 --shards 1000 --members 1000 --parquet-files 100
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from dali_fast import DALIIterator, TorchIterator, open_dataset, pack
from dali_fast.data.synthetic import make_synthetic

LOADERS = {"DALIIterator": (DALIIterator, {}), "TorchIterator": (TorchIterator, {"num_workers": 2})}


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


def tiny_parquet(root: Path, files: int, rows: int) -> None:
    """Parquet files of `rows` rows each in row groups of 100, Hugging Face's layout, 1-byte stand-in images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    meta = {"huggingface": '{"info": {"features": {"image": {"_type": "Image"}, "label": '
            '{"names": ["0","1","2","3","4","5","6","7","8","9"], "_type": "ClassLabel"}}}}'}  # fmt: skip
    image = pa.array(
        [{"bytes": b"\xff", "path": None}] * rows, pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    )
    table = pa.table({"image": image, "label": pa.array([k % 10 for k in range(rows)], pa.int64())})
    for f in range(files):
        pq.write_table(
            table.replace_schema_metadata(meta), root / f"train-{f:05d}-of-{files:05d}.parquet", row_group_size=100
        )


def to_parquet(src, root: Path, per_file: int = 100, group: int = 100, repeat: int = 1) -> None:
    """The reader's images (``repeat`` times over) as Hugging Face writes an image set: data/train-*.parquet,
    row groups of 100."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data").mkdir(parents=True)
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    meta = {"huggingface": json.dumps({"info": {"features": {
        "image": {"_type": "Image"}, "label": {"names": src.classes, "_type": "ClassLabel"}}}})}  # fmt: skip
    n = len(src) * repeat
    files = -(-n // per_file)
    for f in range(files):
        rows = [i % len(src) for i in range(f * per_file, min((f + 1) * per_file, n))]
        image = pa.array([{"bytes": bytes(src[i][0]), "path": f"{i}.jpg"} for i in rows], kind)
        table = pa.table({"image": image, "label": pa.array([int(src.labels[i]) for i in rows], pa.int64())})
        name = root / "data" / f"train-{f:05d}-of-{files:05d}.parquet"
        pq.write_table(table.replace_schema_metadata(meta), name, row_group_size=group)


def reader_reads(reader, batch: int) -> int:
    """Row groups one process reads in an epoch of the loaders' training order, batch by batch."""
    from dali_fast.loaders.order import make_order

    order = make_order(reader, seed=0, shuffle=True, rank=0, world_size=1, drop_last=False)
    order.set_epoch(1)
    idx = order.indices()
    for k in range(0, len(idx), batch):
        reader.read_batch_checked(idx[k : k + batch])
    return int(reader.cache_stats()["misses"])


def interleaved(readers: dict, batch: int, size: int, rounds: int) -> dict[str, list[float]]:
    """{name: [median img/s per loader]}: every loader made and warmed up first, then ``rounds`` rounds of
    one timed training epoch each, in turn, so that a change in the machine's load slows every row alike."""
    loaders = {(name, k): cls(r, batch, image_size=size, device="auto", **kw)
               for name, r in readers.items() for k, (cls, kw) in LOADERS.items()}  # fmt: skip
    for x in loaders.values():
        for _ in x:
            pass
    rates: dict = {key: [] for key in loaders}
    for epoch in range(1, rounds + 1):
        for key, x in loaders.items():
            x.set_epoch(epoch)
            t = time.perf_counter()
            n = sum(len(labels) for _, labels in x)
            rates[key].append(n / (time.perf_counter() - t))
    for x in loaders.values():
        x.close()
    return {name: [statistics.median(rates[(name, k)]) for k in LOADERS] for name in readers}


def epoch_rate(make, reader, batch: int, size: int, epochs: int = 3) -> float:
    """Median img/s of ``epochs`` timed training epochs after one warm-up epoch (page cache, pipeline)."""
    cls, kw = make
    loader = cls(reader, batch, image_size=size, device="auto", **kw)
    for _ in loader:
        pass
    rates = []
    for e in range(1, epochs + 1):
        loader.set_epoch(e)
        t = time.perf_counter()
        n = sum(len(labels) for _, labels in loader)
        rates.append(n / (time.perf_counter() - t))
    loader.close()
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--members", type=int, default=1000)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--photos", type=Path, help="an ImageFolder of real photos (scripts/photos.py) for part 3")
    ap.add_argument("--parquet-files", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timed epochs of each row, taken in turn")
    ap.add_argument("--large-repeat", type=int, default=10, help="the photos repeated, for the large-set rows")
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

        print(f"## open_dataset on {args.parquet_files} Parquet files x {args.members} rows (row groups of 100)\n")
        tiny_parquet(root / "tinypq", args.parquet_files, args.members)
        t = time.perf_counter()
        first = open_dataset(root / "tinypq")
        t_first = time.perf_counter() - t
        opens = []
        for _ in range(5):
            t = time.perf_counter()
            again = open_dataset(root / "tinypq")
            opens.append(time.perf_counter() - t)
        assert len(first) == len(again) == args.parquet_files * args.members
        print("| open | seconds |\n|---|---:|")
        print(f"| first (reads {args.parquet_files} footers and label columns) | {t_first:.2f} |")
        print(f"| with the saved index (median of 5) | {statistics.median(opens):.3f} |\n")

        import webdataset as wds  # the test extra: shards as the webdataset package writes them

        src = open_dataset(args.photos if args.photos else root / "folder")
        if args.photos:
            pack(args.photos, root / "packed-photos", workers=1, progress=False)
        (root / "wds").mkdir()
        per = 250
        for s in range(0, len(src), per):
            with wds.TarWriter(str(root / "wds" / f"train-{s // per:06d}.tar")) as sink:
                for i in range(s, min(s + per, len(src))):
                    data, label = src[i]
                    sink.write({"__key__": f"{i:07d}", "jpg": bytes(data), "cls": str(label).encode()})
        to_parquet(src, root / "pq")
        from dali_fast.data.parquet import ParquetReader

        default = open_dataset(root / "pq")
        readers = {
            "ImageFolder": src,
            "packed": open_dataset(root / ("packed-photos" if args.photos else "packed1")),
            "WebDataset": open_dataset(root / "wds"),
            f"Parquet, default order ({'streaming' if default.streaming else 'random access'})": default,
        }
        print(f"## {len(src)} {'photos' if args.photos else 'images'}, batch {args.batch_size}, {args.image_size}px, "
              f"training order; Parquet: {len(default.files)} files, {len(default.group_rows)} row groups\n")  # fmt: skip
        print("| data set | " + " | ".join(f"{k} img/s" for k in LOADERS) + " |")
        print("|---|" + "---:|" * len(LOADERS))
        rates = interleaved(readers, args.batch_size, args.image_size, args.rounds)
        wds_rates = rates["WebDataset"]
        for name, row in rates.items():
            cells = " | ".join(f"{v:.0f} ({v / w:.2f}x WDS)" for v, w in zip(row, wds_rates, strict=True))
            print(f"| {name} | {cells} |")

        # A set far larger than the row-group cache: the same photos repeated, the cache two row groups.
        to_parquet(src, root / "big", per_file=1000, repeat=args.large_repeat)

        probe = ParquetReader(root / "big")
        small = 2 * int(probe.group_bytes.max())
        print(f"\n## Parquet as a large set: {len(probe)} rows ({len(src)} photos x {args.large_repeat}), "
              f"{len(probe.group_rows)} row groups of 100, a row-group cache of 2 groups\n")  # fmt: skip
        print("| order | " + " | ".join(f"{k} img/s" for k in LOADERS) + " | row groups read per epoch |")
        print("|---|" + "---:|" * (len(LOADERS) + 1))
        for name, streaming in (("random access", False), ("streaming (window 1 row group)", True)):
            cells = []
            for make in LOADERS.values():
                reader = ParquetReader(root / "big", streaming=streaming, row_group_cache=small)
                cells.append(f"{epoch_rate(make, reader, args.batch_size, args.image_size, epochs=1):.0f}")
            reads = reader_reads(
                ParquetReader(root / "big", streaming=streaming, row_group_cache=small), args.batch_size
            )
            print(f"| {name} | {' | '.join(cells)} | {reads} |")


if __name__ == "__main__":
    main()
