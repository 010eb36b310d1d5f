"""Parquet vs WebDataset shards from the same S3 server, side by side in one run.

The same photos are written as Hugging Face Parquet files (row groups of 100 rows) and as WebDataset
shards of 100 samples, and put on moto's S3 server (a separate process on 127.0.0.1). Then:

1. **img/s**, both loaders, the streaming order with each reader's default window, one timed epoch of
   each row in turn per round (median of the rounds): ``cold`` (the node cache emptied first: every row
   group or shard downloaded during the epoch, ahead of use) and ``warm`` (the same epoch again, every
   one in the cache). Ratios are Parquet over WebDataset in the same round.
2. **Row groups by range vs whole files**: the seconds and bytes to fetch every row group's image column
   (what the reader does) against every file whole, through the same downloader.
3. **Opening 100 Parquet files** of 1,000 rows: the first open (footers and label columns fetched) and a
   second one with the saved index (median of 5).

    python scripts/photos.py /tmp/photos400 --images 400     # real photos (pip install scikit-image)
    python benchmarks/remote_parquet.py --photos /tmp/photos400 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from data_formats import tiny_parquet, to_parquet  # noqa: E402
from object_storage import moto_server, timed_epoch, write_shards  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=Path, help="an ImageFolder of photos (default: synthetic images)")
    ap.add_argument("--images", type=int, default=800, help="synthetic images (without --photos)")
    ap.add_argument("--repeat", type=int, default=1, help="the photos repeated, for a longer epoch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--open-files", type=int, default=100)
    ap.add_argument("--no-loaders", action="store_true", help="parts 2 and 3 only")
    args = ap.parse_args()

    from dali_fast import DALIIterator, TorchIterator, open_dataset
    from dali_fast.data.base import SubsetReader
    from dali_fast.data.remote.cache import ShardCache
    from dali_fast.data.remote.store import CHUNK_BYTES, ShardDownloader
    from dali_fast.data.synthetic import make_synthetic

    with tempfile.TemporaryDirectory() as d, moto_server() as endpoint:
        root = Path(d)
        os.environ["DALI_FAST_CACHE"] = str(root / "cache")
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        folder = args.photos or make_synthetic(root / "folder", images=args.images, classes=10, progress=False)
        base = open_dataset(folder)
        src = SubsetReader(base, [i % len(base) for i in range(len(base) * args.repeat)])
        write_shards(src, root / "wds", 100)
        to_parquet(src, root / "pq", per_file=200, group=100)
        tiny_parquet(root / "open", args.open_files, 1000)

        import fsspec

        fs = fsspec.filesystem("s3", endpoint_url=endpoint)
        fs.mkdir("bench")
        for p in [*(root / "wds").iterdir(), *(root / "pq" / "data").iterdir()]:
            fs.pipe(f"bench/{p.parent.name}/{p.name}", p.read_bytes())
        for p in (root / "open").iterdir():
            fs.pipe(f"bench/open/{p.name}", p.read_bytes())
        opts = {"storage_options": {"endpoint_url": endpoint}, "cache_dir": root / "s3cache"}
        specs = {"Parquet": "s3://bench/data/", "WebDataset": "s3://bench/wds/"}
        readers = {name: open_dataset(spec, **opts) for name, spec in specs.items()}
        n = len(readers["Parquet"])
        assert n == len(readers["WebDataset"]) == len(src)

        kw = {"image_size": args.image_size, "device": "auto", "rank": 0, "world_size": 1}
        makers = {"DALIIterator": (DALIIterator, {}), "TorchIterator": (TorchIterator, {"num_workers": 2})}
        loaders = {(f, k): cls(r, args.batch_size, **kw, **more) for f, r in readers.items()
                   for k, (cls, more) in makers.items()}  # fmt: skip
        for x in loaders.values() if not args.no_loaders else []:
            timed_epoch(x, 0)  # warm-up: pipelines and workers built, the page cache filled

        def empty_cache() -> None:
            for r in readers.values():
                r.close()  # unpins and forgets its maps: the next epoch downloads again
            for p in (root / "s3cache" / "shards").glob("*.tar"):
                p.unlink()

        rates: dict[tuple[str, str, str], list[float]] = {}
        for rnd in range(0 if args.no_loaders else args.rounds):
            epoch = 1 + rnd
            for (f, k), x in loaders.items():
                empty_cache()
                rates.setdefault((f, k, "cold"), []).append(timed_epoch(x, epoch)[0])
                rates.setdefault((f, k, "warm"), []).append(timed_epoch(x, epoch)[0])
            print(f"round {rnd}: " + ", ".join(f"{' '.join(key)} {v[-1]:.0f}" for key, v in rates.items()))
        for x in loaders.values():
            x.close()

        sizes = {
            f: sum(p.stat().st_size for p in (root / d).rglob("*.*"))
            for f, d in (("Parquet", "pq"), ("WebDataset", "wds"))
        }
        print(
            f"\n## {n} images ({args.image_size}px, batch {args.batch_size}) from moto's S3 server: Parquet "
            f"({sizes['Parquet'] / 2**20:.1f} MiB, row groups of 100) vs WebDataset ({sizes['WebDataset'] / 2**20:.1f} "
            f"MiB, shards of 100), streaming order, median of {args.rounds} rounds\n"
        )
        print("| loader | cache | Parquet img/s | WebDataset img/s | Parquet / WebDataset |")
        print("|---|---|---:|---:|---:|")
        for k in makers if rates else []:
            for state in ("cold", "warm"):
                p, w = rates[("Parquet", k, state)], rates[("WebDataset", k, state)]
                ratio = statistics.median(a / b for a, b in zip(p, w, strict=True))
                print(f"| {k} | {state} | {statistics.median(p):.0f} | {statistics.median(w):.0f} | {ratio:.2f} |")

        pq_reader = readers["Parquet"]
        empty_cache()
        t = time.perf_counter()
        for g in range(len(pq_reader.chunks)):
            pq_reader._fetch(g, pin=False)  # noqa: SLF001 - a download ahead (ranges, then a HEAD), one at a time
        t_ranged = time.perf_counter() - t
        ranged = int(pq_reader.chunk_bytes.sum())
        whole_cache = ShardCache(root / "whole-files")
        store = ShardDownloader(
            pq_reader.infos, opts["storage_options"], retry_seconds=60, timeout=60, chunk_bytes=CHUNK_BYTES
        )
        t = time.perf_counter()
        for k, info in enumerate(pq_reader.infos):  # as remote shards are: ranges of CHUNK_BYTES, crc32
            whole_cache.acquire(info.key(), info.size, lambda tmp, k=k: store.download(k, tmp, None), pin=False)
        t_whole = time.perf_counter() - t
        whole = sum(info.size for info in pq_reader.infos)
        print(
            f"\n## fetching the Parquet files' images into the cache: {len(pq_reader.chunks)} row groups of {len(pq_reader.infos)} files\n"
        )
        print("| how | MiB | seconds | MiB/s |\n|---|---:|---:|---:|")
        print(
            f"| each row group's image column, by range | {ranged / 2**20:.1f} | {t_ranged:.2f} | {ranged / 2**20 / t_ranged:.0f} |"
        )
        print(f"| each file whole | {whole / 2**20:.1f} | {t_whole:.2f} | {whole / 2**20 / t_whole:.0f} |")

        spec = f"s3://bench/open/train-{{00000..{args.open_files - 1:05d}}}-of-{args.open_files:05d}.parquet"
        t = time.perf_counter()
        first = open_dataset(spec, **opts)
        t_first = time.perf_counter() - t
        opens = []
        for _ in range(5):
            t = time.perf_counter()
            again = open_dataset(spec, **opts)
            opens.append(time.perf_counter() - t)
        assert len(first) == len(again) == args.open_files * 1000
        print(f"\n## open_dataset on {args.open_files} Parquet files x 1000 rows at s3:// (row groups of 100)\n")
        print("| open | seconds |\n|---|---:|")
        print(f"| first (fetches {args.open_files} footers and label columns) | {t_first:.2f} |")
        print(f"| with the saved index (median of 5: one listing) | {statistics.median(opens):.3f} |")
        for r in readers.values():
            r.close()
        shutil.rmtree(root / "s3cache", ignore_errors=True)


if __name__ == "__main__":
    main()
