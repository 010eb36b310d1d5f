"""Ray: an ImageFolder written as WebDataset shards by a Ray Data job (`write_shards` once per batch of
files), then read with `DALIIterator` in the workers of a Ray Train `TorchTrainer`, which checkpoints
mid-epoch, stops, and resumes from that checkpoint at exactly the next sample.

    pip install 'dali-fast[ray]'
    python examples/ray_train.py data/train /tmp/ray_demo --workers 2

Each worker records the data set indices of every batch it trains on, in WORK/records/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any


def _write_partition(batch: dict, *, dst: str, root: str, classes: list[str], shard_size: int) -> dict:
    """One batch of files, written as one partition. Its prefix comes from its files' paths, so a retried
    task rewrites the same shards under the same names instead of adding copies."""
    from dali_fast import write_shards

    paths = [str(p) for p in batch["path"]]
    prefix = "part-" + hashlib.sha1("\n".join(paths).encode()).hexdigest()[:16]
    labels = [classes.index(Path(p).relative_to(root).parts[0]) for p in paths]
    report = write_shards(zip(batch["bytes"], labels, strict=True), dst, prefix=prefix, shard_size=shard_size)
    return {"prefix": [prefix], "shards": [len(report.shards)], "samples": [report.samples], "bytes": [report.bytes]}


def shard_with_ray(src: str, dst: str, *, files_per_partition: int = 1000, shard_size: int = 256 * 2**20) -> list[dict]:
    """Ray Data: read the ImageFolder ``src`` as encoded bytes and write it as shards in ``dst`` (a folder
    or a URL), one `write_shards` call per batch of ``files_per_partition`` files. Returns each call's report."""
    import ray

    root = str(Path(src).resolve())
    classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir() and not d.name.startswith("."))
    files = ray.data.read_binary_files(root, include_paths=True, file_extensions=["jpg", "jpeg", "png"])
    written = files.map_batches(
        _write_partition,
        fn_kwargs={"dst": dst, "root": root, "classes": classes, "shard_size": shard_size},
        batch_size=files_per_partition,
        batch_format="numpy",
    )
    return written.take_all()


def train_loop_per_worker(config: dict) -> None:
    """A Ray Train worker: `DALIIterator` over the shards, sharded by the process group Ray started;
    rank 0 checkpoints (model, optimizer, the loader's position) after ``checkpoint_at`` steps."""
    import ray.train
    import torch
    from ray.train.torch import prepare_model
    from torch.nn import functional as F  # noqa: N812

    from dali_fast import DALIIterator, open_dataset

    rank = ray.train.get_context().get_world_rank()
    loader = DALIIterator(open_dataset(config["shards"]), batch_size=config["batch_size"], image_size=32, seed=0)
    net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, config["classes"]))
    model = prepare_model(net)  # DistributedDataParallel over the group Ray started
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step, first_epoch = 0, 0
    checkpoint = ray.train.get_checkpoint()  # the run's latest one, when this run resumes
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # rank 0's position: in lockstep, every rank's
        step, first_epoch = state["step"], state["loader"]["sampler"]["epoch"]
    records = Path(config["records"]) / f"{config['run']}-rank{rank}.jsonl"
    records.parent.mkdir(parents=True, exist_ok=True)
    try:
        for epoch in range(first_epoch, config["epochs"]):
            loader.set_epoch(epoch)  # the epoch a resumed state is in keeps its position
            for images, labels in loader:
                loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                with records.open("a") as f:
                    f.write(json.dumps({"epoch": epoch, "step": step, "indices": loader.last_indices.tolist()}) + "\n")
                if step == config.get("checkpoint_at"):
                    _report_checkpoint(rank, step, float(loss), net, optimizer, loader)
                if step == config.get("stop_at"):
                    return  # preempted: the steps after the checkpoint are trained again by the resumed run
    finally:
        loader.close()


def _report_checkpoint(rank: int, step: int, loss: float, net: Any, optimizer: Any, loader: Any) -> None:
    import ray.train
    import torch

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}
            torch.save({**state, "step": step}, Path(folder) / "state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint)  # every rank reports: a barrier


def train(shards: str, work: str, *, run: str, workers: int = 2, **config: Any) -> Any:
    """Run a `TorchTrainer` of ``workers`` CPU workers on ``shards``. Runs under one name in ``work``
    resume: a run finds the latest checkpoint of the ones before it (`ray.train.get_checkpoint`)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dali_fast import open_dataset

    config = {"shards": shards, "records": f"{work}/records", "run": run, "epochs": 1, "batch_size": 32, **config}
    config.setdefault("classes", len(open_dataset(shards).classes))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name="dali_fast-ray", storage_path=str(Path(work, "ray_results").resolve())),
    )
    return trainer.fit()


def main(argv: list[str] | None = None) -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="an ImageFolder root")
    p.add_argument("work", help="a new folder: the shards, Ray's results and the records go here")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    ray.init(include_dashboard=False)
    shards = f"{args.work}/shards"
    reports = shard_with_ray(args.src, shards, files_per_partition=256)
    print(f"Ray Data wrote {sum(r['samples'] for r in reports)} samples in {len(reports)} partitions to {shards}")
    steps = -(-sum(r["samples"] for r in reports) // (args.workers * args.batch_size))
    kw = {"workers": args.workers, "batch_size": args.batch_size}
    train(shards, args.work, run="first", checkpoint_at=steps // 2, stop_at=steps // 2 + 1, **kw)
    result = train(shards, args.work, run="resumed", **kw)
    print(f"trained {steps} steps per worker: stopped after {steps // 2 + 1}, resumed from step {steps // 2}")
    print(f"results: {result.path}; records: {args.work}/records")


if __name__ == "__main__":
    main()
