"""DALIIterator over WebDataset shards: local disk vs an S3 server (cold and warm shard cache), side by side.

The same shards are read from a local folder and from moto's S3 server (``moto[server]``, started here
as a separate process on 127.0.0.1). Each round times one epoch of each, in turn:

- ``local``: `open_dataset(folder)` (random access over the memory-mapped shards);
- ``s3 cold``: the remote reader after its shard cache was emptied (every shard downloaded during the
  epoch, ahead of use, while DALI decodes); its rate is also given from the first batch on ("once the
  first shards are in");
- ``s3 warm``: the same epoch again, every shard now in the cache.

The shard index is built before timing (a one-time cost per node, reported apart). Ratios are against
``local`` in the same round; the table gives the median over rounds.

    python scripts/photos.py build/photos --images 2000     # real photographs (pip install scikit-image)
    python benchmarks/object_storage.py --data build/photos --rounds 5
    python benchmarks/object_storage.py --images 2000          # synthetic images
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server():
    """moto's standalone S3 server in its own process; yields its endpoint."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start; pip install 'moto[server]'")
            time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def write_shards(src, out: Path, per_shard: int) -> None:
    import webdataset as wds

    out.mkdir()
    for s in range(0, len(src), per_shard):
        with wds.TarWriter(str(out / f"train-{s // per_shard:06d}.tar")) as sink:
            for i in range(s, min(s + per_shard, len(src))):
                data, label = src[i]
                sink.write({"__key__": f"{i:07d}", "jpg": bytes(data), "cls": str(label).encode()})


def timed_epoch(loader, epoch: int) -> tuple[float, float]:
    """(img/s over the epoch, img/s from the first batch on)."""
    loader.set_epoch(epoch)
    t0 = time.perf_counter()
    first, n, n_first = None, 0, 0
    for _, labels in loader:
        if first is None:
            first, n_first = time.perf_counter(), len(labels)
        n += len(labels)
    end = time.perf_counter()
    return n / (end - t0), (n - n_first) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="an ImageFolder to use (default: synthetic images)")
    ap.add_argument("--images", type=int, default=2000, help="synthetic images (without --data)")
    ap.add_argument("--per-shard", type=int, default=100, help="samples per shard")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--download-threads", type=int, default=4)
    args = ap.parse_args()

    from dali_fast import DALIIterator, open_dataset
    from dali_fast.data.synthetic import make_synthetic

    with tempfile.TemporaryDirectory() as d, moto_server() as endpoint:
        root = Path(d)
        os.environ["DALI_FAST_CACHE"] = str(root / "cache")
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto takes any credentials
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        folder = args.data or make_synthetic(root / "folder", images=args.images, classes=10, progress=False)
        write_shards(open_dataset(folder), root / "shards", args.per_shard)
        shards = sorted((root / "shards").iterdir())
        total = sum(p.stat().st_size for p in shards)

        import fsspec

        fs = fsspec.filesystem("s3", endpoint_url=endpoint)
        fs.mkdir("bench")
        for p in shards:
            fs.pipe(f"bench/{p.name}", p.read_bytes())
        spec = f"s3://bench/train-{{000000..{len(shards) - 1:06d}}}.tar"
        opts = {"storage_options": {"endpoint_url": endpoint}, "cache_dir": root / "s3cache"}

        t = time.perf_counter()
        remote = open_dataset(spec, download_threads=args.download_threads, **opts)
        t_index = time.perf_counter() - t
        local = open_dataset(root / "shards")
        assert len(local) == len(remote)

        kw = {"image_size": args.image_size, "device": "auto", "rank": 0, "world_size": 1}
        loaders = {
            "local": DALIIterator(local, args.batch_size, **kw),
            "s3": DALIIterator(remote, args.batch_size, **kw),
        }

        def empty_cache() -> None:
            remote.close()  # unpins and forgets its maps; the next epoch starts its downloads again
            for p in (root / "s3cache" / "shards").glob("*.tar"):
                p.unlink()

        for loader in loaders.values():  # warm-up: pipelines built, page cache filled
            timed_epoch(loader, 0)
        rows: dict[str, list[tuple[float, float]]] = {"local": [], "s3 cold": [], "s3 warm": []}
        for r in range(args.rounds):
            epoch = 1 + r
            rows["local"].append(timed_epoch(loaders["local"], epoch))
            empty_cache()
            before = remote.stats()["downloaded_bytes"]
            rows["s3 cold"].append(timed_epoch(loaders["s3"], epoch))
            fetched = remote.stats()["downloaded_bytes"] - before
            rows["s3 warm"].append(timed_epoch(loaders["s3"], epoch))
            cells = ", ".join(f"{k} {v[-1][0]:.0f}" for k, v in rows.items())
            print(f"round {r}: img/s {cells}; the cold epoch downloaded {fetched / 2**20:.1f} MiB")
        for loader in loaders.values():
            loader.close()
        remote.close()

        n = len(local)
        print(
            f"\n## DALIIterator: local shards vs moto's S3 server, {n} images in {len(shards)} shards "
            f"({total / 2**20:.1f} MiB), batch {args.batch_size}, {args.image_size}px, {args.rounds} rounds\n"
        )
        print(f"Index built once before timing (every shard fetched and walked): {t_index:.2f}s.\n")
        print("| source | img/s (epoch) | x local | img/s (from the first batch) | x local |")
        print("|---|---:|---:|---:|---:|")
        for name, vals in rows.items():
            ratio = statistics.median(v[0] / b[0] for v, b in zip(vals, rows["local"], strict=True))
            ratio_first = statistics.median(v[1] / b[1] for v, b in zip(vals, rows["local"], strict=True))
            print(
                f"| {name} | {statistics.median(v[0] for v in vals):.0f} | {ratio:.2f} | "
                f"{statistics.median(v[1] for v in vals):.0f} | {ratio_first:.2f} |"
            )
        shutil.rmtree(root / "s3cache", ignore_errors=True)


if __name__ == "__main__":
    main()
