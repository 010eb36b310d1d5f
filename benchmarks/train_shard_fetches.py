"""How many shard downloads one epoch of ``dali-fast train s3://...`` costs when the node's shard cache is
smaller than the data set, counted by the server (moto's S3 server, in its own process: each GET of a
shard in its request log; a shard under the 8 MiB range size is one GET).

The shards are indexed first (``dali-fast inspect``, a one-time cost per node, not counted), the cached
shards are then removed (the indexes stay), and one epoch of ``train`` runs: the training pass and the
evaluation of the held-out share. A streamed epoch downloads each shard about once; one that reads records
at random downloads a shard again each time it was evicted before its last record was read.

    python benchmarks/train_shard_fetches.py --shards 24 --cache-shards 9
    # another checkout's code: run from outside this one, or ``python -m`` finds this one's package first
    cd /tmp && PYTHONPATH=/path/to/other python /path/to/this/benchmarks/train_shard_fetches.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from object_storage import free_port, write_shards  # noqa: E402

BUCKET = "fetches"


@contextlib.contextmanager
def moto_server(log: Path):
    """moto's standalone S3 server in its own process, its request log (one line per request) in ``log``."""
    port = free_port()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=sink, stderr=sink
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start; pip install 'moto[server]'")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def upload(endpoint: str, folder: Path) -> None:
    from botocore.session import Session

    client = Session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    for f in sorted(folder.glob("*.tar")):
        client.put_object(Bucket=BUCKET, Key=f.name, Body=f.read_bytes())


def shard_gets(log: Path, start: int) -> Counter:
    """GETs of each shard in moto's request log from byte ``start`` on."""
    text = log.read_bytes()[start:].decode(errors="replace")
    return Counter(re.findall(rf"GET /{BUCKET}/(train-\d+\.tar)[^ ]* HTTP", text))  # colour codes around


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--per-shard", type=int, default=20, help="images per shard")
    ap.add_argument("--cache-shards", type=int, default=9, help="shards the node's cache holds")
    ap.add_argument("--loader", default="torch", choices=["torch", "dali"])
    ap.add_argument("--workers", type=int, default=0, help="--num-workers of the torch loader")
    args = ap.parse_args()
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from dali_fast.data.open import open_dataset
    from dali_fast.data.synthetic import make_synthetic

    tmp = Path(tempfile.mkdtemp(prefix="shard-fetches-"))
    try:
        make_synthetic(tmp / "images", images=args.shards * args.per_shard, classes=4, seed=1, progress=False)
        write_shards(open_dataset(tmp / "images"), tmp / "shards", args.per_shard)
        biggest = max(f.stat().st_size for f in (tmp / "shards").glob("*.tar"))
        log = tmp / "moto.log"
        with moto_server(log) as endpoint:
            upload(endpoint, tmp / "shards")
            url = f"s3://{BUCKET}/train-{{000000..{args.shards - 1:06d}}}.tar"
            common = [url, "--storage-option", f"endpoint_url={endpoint}", "--cache-dir", str(tmp / "cache")]
            common += ["--cache-limit", str(args.cache_shards * biggest)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cli = [sys.executable, "-m", "dali_fast"]
            subprocess.run([*cli, "inspect", *common], check=True, env=env, stdout=subprocess.DEVNULL)
            shutil.rmtree(tmp / "cache" / "shards")  # the indexes stay: the epoch starts with an empty cache
            start = log.stat().st_size
            train = [*cli, "train", *common, "--epochs", "1", "--loader", args.loader, "--model", "resnet_tiny"]
            train += ["--image-size", "32", "--batch-size", "16", "--num-workers", str(args.workers)]
            out = subprocess.run(train, check=True, env=env, capture_output=True, text=True).stdout
            gets = shard_gets(log, start)
        print(out.splitlines()[0])
        print(
            f"{args.shards} shards of {args.per_shard} images ({biggest} bytes at most), a cache of {args.cache_shards} "
            f"shards, loader {args.loader}: one epoch (training and evaluation) downloaded {sum(gets.values())} "
            f"shards, {len(gets)} distinct; the most downloads of one shard: {max(gets.values(), default=0)}"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
