"""What runs in each rank process of the preemption fuzz, and the data it reads.

The data: the same `N` tiny images as every kind the fuzz covers (an ImageFolder, a pack of it, local
WebDataset shards, the same shards on moto's S3 server, Parquet files read at random and streamed by row
groups). Image ``i`` is a solid colour that encodes ``i`` (`colour`), so each delivered image says which
sample it is, whatever the crop, flip or size; its label is its class (`label`).

A rank (`run_rank`) makes a loader as its job says (backend, batch size, workers, prefetch, ``drop_last``,
``even``, a controller, a resolution schedule, its rank given as arguments or by ``RANK``/``WORLD_SIZE``),
loads the state it is given, and runs the epochs: it checks every image's colour, size and label against
``loader.last_indices``, logs each batch (one JSON line, flushed) and saves the loader's state (atomically)
every ``save_every`` batches and at each epoch's end; it SIGKILLs itself (and its workers) where its job says:
right after a batch, or between a state save and the next batch. `run_lightning` does the same inside a
Lightning ``Trainer.fit`` that checkpoints every ``save_every`` steps and restores with ``ckpt_path``.
"""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

N = 47  # samples (a prime: no world size or batch size divides it)
CLASSES = ("a", "b", "c")
SHARDS = (12, 12, 9, 8, 6)  # samples per WebDataset shard
GROUP = 4  # Parquet rows per row group
BUCKET = "fuzz"
END = 1 << 40  # the batch key of an epoch's end (`preemption_check.END`)


def label(i: int) -> int:
    """The class of sample ``i``: the first 16 are class 0, the next 16 class 1, the rest class 2."""
    return min(i // 16, 2)


def colour(i: int) -> tuple[int, int, int]:
    return 40 + 12 * (i % 16), 40 + 12 * (i // 16), 128


def nearest(r: float, g: float) -> int:
    """The sample whose colour is nearest (r, g); -1 when none is within 5 levels."""
    a, b = round((r - 40) / 12), round((g - 40) / 12)
    i = b * 16 + a
    if not (0 <= a < 16 and 0 <= i < N):
        return -1
    cr, cg, _ = colour(i)
    return i if abs(cr - r) <= 5 and abs(cg - g) <= 5 else -1


def jpeg(i: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (12, 10), colour(i)).save(out, "JPEG", quality=95)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- the data


def build(root: Path) -> None:
    """Every local kind under ``root``: ``folder``, ``packed``, ``shards`` (WebDataset) and ``parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    from dali_fast import pack

    images = [jpeg(i) for i in range(N)]
    for i, data in enumerate(images):
        folder = root / "folder" / CLASSES[label(i)]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:03d}.jpg").write_bytes(data)
    pack(root / "folder", root / "packed", progress=False)
    (root / "shards").mkdir()
    at = 0
    for s, count in enumerate(SHARDS):
        with wds.TarWriter(str(root / "shards" / f"train-{s:06d}.tar")) as sink:
            for i in range(at, at + count):
                sink.write({"__key__": f"s{i:05d}", "jpg": images[i], "cls": str(label(i)).encode()})
        at += count
    (root / "parquet").mkdir()
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for f, rows in enumerate((range(0, 18), range(18, 34), range(34, N))):
        table = pa.table(
            {
                "image": pa.array([{"bytes": images[i], "path": f"{i}.jpg"} for i in rows], image_type),
                "label": pa.array([label(i) for i in rows], pa.int64()),
            }
        )
        pq.write_table(table, root / "parquet" / f"train-{f:05d}.parquet", row_group_size=GROUP)


def upload(root: Path, endpoint: str) -> None:
    """The WebDataset shards into the bucket on moto's server."""
    from botocore.session import Session

    client = Session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    for f in sorted((root / "shards").glob("*.tar")):
        client.put_object(Bucket=BUCKET, Key=f.name, Body=f.read_bytes())


def kind_path(kind: str, root: Path) -> str:
    """What ``dali-fast`` and `open_dataset` are given for ``kind``."""
    last = f"{len(SHARDS) - 1:06d}"
    return {
        "folder": str(root / "folder"),
        "packed": str(root / "packed"),
        "wds": str(root / "shards" / f"train-{{000000..{last}}}.tar"),
        "s3": f"s3://{BUCKET}/train-{{000000..{last}}}.tar",
        "parquet": str(root / "parquet"),
        "parquet-stream": str(root / "parquet"),
    }[kind]


def open_kind(kind: str, root: Path, endpoint: str | None, cache: Path | None = None) -> Any:
    from dali_fast import open_dataset

    kw: dict[str, Any] = {}
    if kind == "s3":
        kw = {"storage_options": {"endpoint_url": endpoint}, "index_dir": root / "s3-index", "shuffle_window": 2}
        kw["cache_dir"] = cache if cache is not None else root / "s3-cache"
    elif kind == "parquet-stream":
        kw = {"streaming": True, "shuffle_window": 2}
    elif kind == "parquet":
        kw = {"streaming": False}
    return open_dataset(kind_path(kind, root), **kw)


def layout(kind: str, root: Path, endpoint: str | None) -> dict[str, Any]:
    """What the order of ``kind`` depends on: its length, and its shard bounds when it streams."""
    reader = open_kind(kind, root, endpoint)
    streams = bool(getattr(reader, "streaming", False))
    out = {
        "n": len(reader),
        "bounds": [int(b) for b in reader.shard_bounds] if streams else None,
        "window": int(reader.shuffle_window) if streams else None,
    }
    if hasattr(reader, "close"):
        reader.close()
    return out


# ---------------------------------------------------------------------------------------------- a rank


class FakeProbe:
    """A memory probe whose peaks follow a fixed pattern, the same on every rank: the controller then grows
    and shrinks the batch between epochs alike everywhere (as under DDP, where ranks decide together)."""

    def __init__(self, pattern: list[float]) -> None:
        self.pattern, self.calls = pattern, 0

    def reset_peak(self) -> None:
        pass

    def peak_fraction(self) -> float:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]


def loader_args(job: dict[str, Any]) -> dict[str, Any]:
    """The loader's keywords the job says (all but the data set, batch size and backend)."""
    import torch

    from dali_fast import BatchSizeController, Recipe
    from dali_fast.transforms.recipe import Progressive

    resolution = Progressive(8, 16, 0, 1, step=8) if job["progressive"] else None
    recipe = Recipe(image_size=8, dtype=torch.uint8 if job["uint8"] else torch.float32, resolution=resolution)
    kw: dict[str, Any] = {"recipe": recipe, "device": "cpu", "seed": job["seed"], "drop_last": job["drop_last"]}
    kw.update(even=job["even"], prefetch=job["prefetch"])
    if job["naming"] == "args":
        kw.update(rank=job["rank"], world_size=job["world"])
    if job["controller"]:
        probe = FakeProbe(job["pattern"])
        kw["controller"] = BatchSizeController(2, 16, multiple_of=1, probe=probe, sync_ranks=False, release=None)
    if job["backend"] == "torch":
        kw["num_workers"] = job["workers"]
    else:
        kw["num_threads"] = job["threads"]
    return kw


def make(job: dict[str, Any], reader: Any) -> Any:
    from dali_fast.loaders.factory import make_loader

    return make_loader(reader, job["batch"], backend=job["backend"], **loader_args(job))


def check(images: Any, labels: Any, ids: list[int], size: int, recipe: Any) -> int:
    """How many of a batch's images are not the samples ``ids`` say (colour, label), or not ``size`` px."""
    import torch

    if tuple(images.shape[1:]) != (3, size, size) or len(images) != len(ids):
        return len(ids) or 1
    x = images.float().mean(dim=(2, 3))
    if images.dtype != torch.uint8:
        x = x * torch.tensor(recipe.std_255) + torch.tensor(recipe.mean_255)
    bad = 0
    for (r, g, _), i, y in zip(x.tolist(), ids, labels.tolist(), strict=True):
        bad += nearest(r, g) != i or y != label(i)
    return bad


def die() -> None:
    """SIGKILL this rank and its worker processes at once (a preempted node gives no warning)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _save(folder: Path, loader: Any, epoch: int, key: int) -> None:
    state = {"loader": loader.state_dict(), "epoch": epoch, "k": key}
    tmp = folder / f".state-{epoch}-{key}.tmp"
    tmp.write_text(json.dumps(state, default=_plain))
    os.replace(tmp, folder / f"state-{epoch}-{key}.json")


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


def run_rank(job: dict[str, Any]) -> None:
    """One rank of one generation (see the module docstring). ``job["kill"]``: None, or ``[how, count]``:
    ``"batch"`` (after its count-th batch) or ``"save"`` (after the first state save from then on)."""
    if job["naming"] == "env":
        os.environ.update(RANK=str(job["rank"]), WORLD_SIZE=str(job["world"]), LOCAL_RANK=str(job["rank"]))
        os.environ["LOCAL_WORLD_SIZE"] = str(job["world"])
    root, out = Path(job["data"]), Path(job["out"])
    reader = open_kind(job["kind"], root, job["endpoint"], Path(job["cache"]) if job["cache"] else None)
    loader = make(job, reader)
    start, key0, kill = 0, 0, job["kill"]
    if job["state"] is not None:
        saved = json.loads(Path(job["state"]).read_text())
        loader.load_state_dict(saved["loader"])
        start, key0 = (saved["epoch"] + 1, 0) if saved["k"] == END else (saved["epoch"], saved["k"])
        if job["resume_batch"] is not None:
            loader.batch_size = job["resume_batch"]
    count = 0
    with open(out / "log.jsonl", "a") as log:
        for epoch in range(start, job["epochs"]):
            loader.set_epoch(epoch)
            key = key0 if epoch == start else 0
            size = loader.recipe.image_size
            log.write(json.dumps({"epoch": epoch, "batch": loader.batch_size}) + "\n")
            for images, labels in loader:
                key += 1
                count += 1
                ids = loader.last_indices.tolist()
                bad = check(images, labels, ids, size, loader.recipe)
                log.write(json.dumps({"e": epoch, "k": key, "ids": ids, "bad": bad}) + "\n")
                log.flush()
                if kill and kill[0] == "batch" and count >= kill[1]:
                    die()
                if key % job["save_every"] == 0:
                    _save(out, loader, epoch, key)
                    if kill and kill[0] == "save" and count >= kill[1]:
                        die()
            _save(out, loader, epoch, END)
            if kill and kill[0] == "save" and count >= kill[1]:
                die()
        log.write(json.dumps({"done": True}) + "\n")
    loader.close()


def run_lightning(job: dict[str, Any]) -> None:
    """One process of a Lightning run: ``fit`` with a `DaliFastDataModule` over the job's data, checkpointing
    every ``save_every`` steps (``last.ckpt``), restored from ``job["ckpt"]`` when given; each batch logged
    with its global step; SIGKILLed after its count-th batch, or between the checkpoint at that step and
    the next batch."""
    import pytorch_lightning as pl
    import torch

    from dali_fast.lightning import DaliFastDataModule

    root, out = Path(job["data"]), Path(job["out"])
    reader = open_kind(job["kind"], root, job["endpoint"], Path(job["cache"]) if job["cache"] else None)
    kill, made = job["kill"], []
    log = open(out / "log.jsonl", "a")  # noqa: SIM115 - closed at the end of fit

    class Data(DaliFastDataModule):
        def train_dataloader(self) -> Any:
            made.append(super().train_dataloader())
            return made[-1]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            images, _ = batch
            return self.layer(images.float().mean(dim=(2, 3))).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Recorder(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            log.write(json.dumps({"epoch": trainer.current_epoch, "batch": made[-1].batch_size}) + "\n")

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if kill and kill[0] == "save" and trainer.global_step >= kill[1] and (out / "ck" / "last.ckpt").exists():
                saved = torch.load(out / "ck" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"]
                if saved == trainer.global_step:  # the checkpoint of the step just done is written: die now
                    die()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            images, labels = batch
            loader = made[-1]
            ids = loader.last_indices.tolist()
            bad = check(images, labels, ids, loader.recipe.image_size, loader.recipe)
            log.write(json.dumps({"e": trainer.current_epoch, "k": trainer.global_step, "ids": ids, "bad": bad}) + "\n")
            log.flush()
            if kill and kill[0] == "batch" and trainer.global_step >= kill[1]:
                die()

    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=out / "ck", every_n_train_steps=job["save_every"], save_last=True, save_top_k=-1
    )
    trainer = pl.Trainer(
        max_epochs=job["epochs"], accelerator="cpu", devices=1, callbacks=[Recorder(), ckpt], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=out,
    )  # fmt: skip
    kw = loader_args(job)
    data = Data(
        train=reader, batch_size=job["batch"], backend=job["backend"], controller=kw.pop("controller", None), **kw
    )
    trainer.fit(Model(), datamodule=data, ckpt_path=job["ckpt"])
    log.write(json.dumps({"done": True}) + "\n")
    log.close()
