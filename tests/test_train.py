import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from contract import each_once

from dali_fast.checkpoint import load_checkpoint, read_index_records
from dali_fast.data.base import split
from dali_fast.data.open import open_dataset
from dali_fast.data.synthetic import make_synthetic
from dali_fast.data.writer import pack
from dali_fast.train import run_train
from dali_fast.transforms.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_synthetic(root / "images", images=120, classes=3, seed=1, progress=False)
    pack(root / "images", root / "packed", progress=False)
    return open_dataset(root / "packed")


@pytest.fixture(scope="module")
def odd_set(tmp_path_factory) -> Path:
    """121 images: a 97-image training split, which 2 ranks cannot share evenly (1 padded sample)."""
    root = tmp_path_factory.mktemp("dist")
    make_synthetic(root / "images", images=121, classes=3, seed=2, progress=False)
    pack(root / "images", root / "packed", progress=False)
    return root / "packed"


def _train_small(reader, loader: str, **kw) -> tuple[list[dict], list[str]]:
    """Four epochs of resnet_tiny at 48 px, batch 16; (rows, printed lines)."""
    lines: list[str] = []
    rows = run_train(
        reader,
        loader=loader,
        epochs=4,
        model="resnet_tiny",
        batch_size=16,
        image_size=48,
        lr=0.05,
        num_workers=0 if loader != "baseline" else 1,
        emit=lines.append,
        **kw,
    )
    return rows, lines


@pytest.mark.parametrize("loader", ["baseline", "torch", "dali"])
def test_loss_falls_with_each_loader(learnable, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    rows, lines = _train_small(learnable, loader)
    assert len(rows) == 4 and len(lines) == 5
    assert rows[-1]["train_loss"] < 0.7 * rows[0]["train_loss"], [r["train_loss"] for r in rows]
    assert rows[-1]["val_acc"] > 0.6  # 3 classes: chance is 0.33


@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_a_modern_recipe_still_drives_the_held_out_loss_down(learnable, loader):
    """RandAugment + mixup/cutmix (soft targets) + label smoothing + random erasing, through the CLI's
    own path: the held-out loss (plain cross-entropy on un-augmented crops) still falls."""
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    recipe = Recipe(image_size=48, auto_augment="randaugment", magnitude=5, random_erasing=0.25)
    rows, lines = _train_small(learnable, loader, recipe=recipe, mixup=0.2, cutmix=1.0, label_smoothing=0.1)
    assert (
        "augment=randaugment, alpha_mixup=0.2, alpha_cutmix=1.0, label_smoothing=0.1, random_erasing=0.25" in lines[0]
    )
    val = [r["val_loss"] for r in rows]
    assert min(val[1:]) < 0.7 * val[0] and val[-1] < val[0], val
    assert rows[-1]["val_acc"] > 0.6, [r["val_acc"] for r in rows]


def test_controller_decisions_printed(learnable):
    pytest.importorskip("nvidia.dali")
    lines = []
    rows = run_train(
        learnable,
        loader="dali",
        epochs=2,
        model="resnet_tiny",
        batch_size=16,
        image_size=32,
        controller=True,
        emit=lines.append,
    )
    assert rows[0]["decision"] is not None and "controller:" in lines[1]
    assert "peak" in rows[0]["decision"]["reason"]  # a real host-memory reading


def test_evaluation_reads_the_device_once_not_per_batch():
    """Evaluation sums loss and hits on the device and reads them back once. On the `meta` device any
    read back fails, as it would stall a GPU: the read comes only after the last batch."""
    from dali_fast.train import Trainer

    trainer = Trainer("resnet_tiny", 3, amp=False)
    trainer.module.to("meta")
    trainer.device = torch.device("meta")
    served = []

    def batches():
        for k in range(3):
            served.append(k)
            yield torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])

    with pytest.raises(RuntimeError, match="meta"):
        trainer.evaluate(batches())
    assert served == [0, 1, 2]  # all three batches went through before the one read


def test_mixup_training_step_reads_nothing_back_from_the_device():
    """A training step with mixup/cutmix (the label check included) reads no value back: on the `meta`
    device, where any read fails, the steps run."""
    from dali_fast.train import Trainer
    from dali_fast.transforms.mix import MixupCutmix

    trainer = Trainer("resnet_tiny", 3, amp=False, mix=MixupCutmix(num_classes=3, seed=0))
    trainer.module.to("meta")
    trainer.device = torch.device("meta")
    modes = set()
    for _ in range(6):
        loss = trainer.step(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0]))
        assert loss.device.type == "meta"
        modes.add(trainer.mix.last["mode"])
    assert modes == {"mixup", "cutmix"}


@pytest.mark.gpu
def test_gpu_mixup_steps_and_evaluation_do_not_stop_the_gpu():
    """torch's sync debug mode raises at any operation that waits for the GPU: mixup/cutmix steps run
    through it, and evaluation reaches its one read only after the last batch."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dali_fast.train import Trainer
    from dali_fast.transforms.mix import MixupCutmix

    trainer = Trainer("resnet_tiny", 3, mix=MixupCutmix(num_classes=3, seed=0))
    x = torch.randn(8, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 3, (8,), device="cuda")
    trainer.step(x, y)  # the first step picks cudnn's kernels
    torch.cuda.synchronize()
    served = []

    def batches():
        for k in range(3):
            served.append(k)
            yield x, y

    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            trainer.step(x, y)
        with pytest.raises(RuntimeError, match="synchroniz"):
            trainer.evaluate(batches())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert served == [0, 1, 2]


def test_labels_outside_the_classes_stop_training_before_any_step():
    from conftest import IndexReader, jpeg_bytes

    reader = IndexReader([jpeg_bytes() for _ in range(6)], classes=4)  # labels 0..5 (the index), 4 classes
    with pytest.raises(ValueError, match=r"^record 4 \(mem://4.jpg\) has label 4"):
        run_train(reader, loader="torch", epochs=1, model="resnet_tiny", batch_size=2, image_size=16, num_workers=0)


def test_each_rank_drives_a_visible_gpu_when_the_launcher_shows_it_only_its_own(monkeypatch):
    """SLURM --gpus-per-task=1: WORLD_SIZE=2, LOCAL_RANK=1, one visible GPU. Device 1 does not exist."""
    import torch.distributed as dist

    import dali_fast.system as system
    import dali_fast.train as tr

    monkeypatch.setattr(system, "cuda_usable", lambda: True)  # what local_device_index asks
    monkeypatch.setattr(tr, "cuda_usable", lambda: True)  # what distributed_context asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: chosen.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with tr.distributed_context() as ctx:
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.device_index) == (1, 2, 1, 0)
    assert chosen == [0, "nccl"]


def test_resume_refuses_other_settings(learnable, tmp_path):
    pytest.importorskip("nvidia.dali")
    kw = dict(loader="dali", epochs=1, model="resnet_tiny", batch_size=16, image_size=32, checkpoint=tmp_path)
    run_train(learnable, **kw)
    for key, other in (("model", "resnet18"), ("seed", 1), ("image_size", 48)):
        with pytest.raises(ValueError) as e:
            run_train(learnable, **{**kw, key: other}, resume=True)
        assert str(e.value) == (
            f"{tmp_path / 'checkpoint.pt'}: saved with {key}={kw.get(key, 0)!r}, this run has {key}={other!r}; "
            "resume with the same settings or use a new --checkpoint folder"
        )
    # another recipe or batch mixing is another run; the defaults stay out of the config (older checkpoints resume)
    aug = Recipe(image_size=32, auto_augment="randaugment")
    for extra, key in (({"recipe": aug}, "recipe"), ({"mixup": 0.2}, "mix"), ({"label_smoothing": 0.1}, "mix")):
        with pytest.raises(ValueError) as e:
            run_train(learnable, **kw, **extra, resume=True)
        assert str(e.value).startswith(f"{tmp_path / 'checkpoint.pt'}: saved with {key}=None, this run has {key}={{")
    other_root = tmp_path / "other"
    make_synthetic(other_root / "images", images=120, classes=3, seed=7, progress=False)
    pack(other_root / "images", other_root / "packed", progress=False)
    other = open_dataset(other_root / "packed")  # the same size, other images
    with pytest.raises(ValueError) as e:
        run_train(other, **kw, resume=True)
    assert "saved with fingerprint='packed:120:" in str(e.value) and "\n" not in str(e.value)
    lines = []
    rows = run_train(learnable, **{**kw, "epochs": 2, "batch_size": 8}, resume=True, emit=lines.append)
    assert [r["epoch"] for r in rows] == [0, 1] and lines[0].startswith("resumed from")
    assert lines[1] == "batch size 16 → 8 as given" and [r["batch_size"] for r in rows] == [16, 8]


# ---------------------------------------------------------------- real processes: torchrun and SIGKILL


def _skip_without_enough_gpus(nproc: int) -> None:
    """On a GPU host each rank needs its own GPU (nccl); on a CPU host ranks share the CPU (gloo)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"{nproc} ranks need {nproc} GPUs; this host has {torch.cuda.device_count()}")


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _command(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "dali_fast", *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, "-m", "dali_fast", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _train_args(data: Path, loader: str, tmp: Path, tag: str, epochs: int = 2) -> list[str]:
    return [
        "train", str(data), "--loader", loader, "--epochs", str(epochs), "--model", "resnet_tiny",
        "--image-size", "32", "--batch-size", "5", "--num-workers", "0", "--no-drop-last",
        "--record-indices", str(tmp / f"{tag}.jsonl"),
    ]  # fmt: skip


def _records(tmp: Path, tag: str, nproc: int) -> dict[int, list[dict]]:
    if nproc == 1:
        return {0: read_index_records(tmp / f"{tag}.jsonl")}
    return {r: read_index_records(tmp / f"{tag}.jsonl.rank{r}") for r in range(nproc)}


def _train_indices(data: Path) -> list[int]:
    train, _ = split(open_dataset(data), 0.2, 0)
    return [int(i) for i in train.indices]


def _check_epoch_cover(per_rank: dict[int, list[int]], train: list[int], nproc: int) -> None:
    """Each rank's samples once; together the training split once, plus the documented padding."""
    for rank, got in per_rank.items():
        each_once(got, set(got), what=f"rank {rank}")  # no sample twice on one rank
    padded = math.ceil(len(train) / nproc) * nproc - len(train)
    everything = [i for got in per_rank.values() for i in got]
    each_once(everything, train, padding=padded)
    assert len(everything) == len(train) + padded  # the padding wraps around: `padded` samples twice


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["torch"])  # DALI under torchrun: the 2-rank SIGKILL/resume test below
def test_torchrun_two_ranks_shard_each_epoch_exactly_once(odd_set, tmp_path, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    _skip_without_enough_gpus(2)
    args = _train_args(odd_set, loader, tmp_path, "idx") + ["--out", str(tmp_path / "out")]
    proc = subprocess.run(_command(2, args), env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only rank 0 prints and writes.
    lines = proc.stdout.splitlines()
    assert sum(x.startswith("epoch 0:") for x in lines) == 1 and sum(x.startswith("epoch 1:") for x in lines) == 1
    assert f"2 ranks ({_backend()})" in proc.stdout and "replicas in sync after training: yes" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.json"]
    recs, train = _records(tmp_path, "idx", 2), _train_indices(odd_set)
    orders = []
    for epoch in (0, 1):
        per_rank = {r: [i for x in recs[r] if x["epoch"] == epoch for i in x["indices"]] for r in recs}
        batches = {r: sum(x["epoch"] == epoch for x in recs[r]) for r in recs}
        assert batches[0] == batches[1] == math.ceil(math.ceil(97 / 2) / 5)  # 49 samples in batches of 5
        _check_epoch_cover(per_rank, train, 2)
        orders.append(per_rank[0])
    assert orders[0] != orders[1]  # reshuffled per epoch


def _process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_at_first_checkpoint(cmd: list[str], ckpt: Path, timeout: float = 600) -> None:
    """Start ``cmd``; the moment ``ckpt`` appears, freeze every process of the run, then SIGKILL them all."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    tree: list[int] = []
    try:
        while not ckpt.exists():
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                pytest.fail(f"training ended (rc {proc.returncode}) before its first checkpoint:\n{out[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint before the timeout")
            time.sleep(0.005)
        tree = _process_tree(proc.pid)
        _signal_all(tree, signal.SIGSTOP)  # no rank takes another step or writes another checkpoint
        tree = _process_tree(proc.pid)
        _signal_all(tree, signal.SIGKILL)  # no chance to clean up, as on a preempted node
    finally:
        _signal_all(tree or [proc.pid], signal.SIGKILL)
        proc.wait(timeout=60)
        if proc.stdout:
            proc.stdout.close()
    end = time.monotonic() + 60
    while not all(_gone(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(_gone(p) for p in tree) and proc.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "loader"), [(1, "torch"), (2, "dali")])  # each backend, each rank count
def test_sigkill_then_resume_sees_each_sample_once(odd_set, tmp_path, nproc, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    _skip_without_enough_gpus(nproc)
    ck = tmp_path / "ck"
    extra = ["--checkpoint", str(ck), "--checkpoint-every", "3"]
    _kill_at_first_checkpoint(
        _command(nproc, _train_args(odd_set, loader, tmp_path, "before") + extra), ck / "checkpoint.pt"
    )
    state = load_checkpoint(ck / "checkpoint.pt")
    cut = int(state["step"])
    per_rank_len = math.ceil(97 / nproc)
    assert not state["epoch_done"]
    positions = [r["loader"]["sampler"]["position"] for r in state["ranks"]]
    assert len(set(positions)) == 1 and 0 < positions[0] < per_rank_len, positions  # killed mid-epoch

    proc = subprocess.run(
        _command(nproc, _train_args(odd_set, loader, tmp_path, "after") + extra + ["--resume"]),
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ck / 'checkpoint.pt'}: epoch {state['epoch']}, step {cut}" in proc.stdout
    before, after = _records(tmp_path, "before", nproc), _records(tmp_path, "after", nproc)
    for r in range(nproc):
        assert min(x["step"] for x in after[r]) == cut + 1  # the resumed run starts at the next batch
    train = _train_indices(odd_set)
    for epoch in (0, 1):
        per_rank = {
            r: [i for x in before[r] if x["epoch"] == epoch and x["step"] <= cut for i in x["indices"]]
            + [i for x in after[r] if x["epoch"] == epoch for i in x["indices"]]
            for r in range(nproc)
        }
        _check_epoch_cover(per_rank, train, nproc)


def test_a_training_step_does_not_sync_with_the_host(monkeypatch):
    """The loss stays on the device (on a GPU, reading it each step would wait for the step to finish)."""
    from dali_fast.train import Trainer

    trainer = Trainer("resnet_tiny", 3)
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 1])

    def no_sync(*_a, **_k):
        raise AssertionError("a host synchronization in the training step")

    for name in ("item", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    losses = [trainer.step(images, labels) for _ in range(3)]
    monkeypatch.undo()
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in losses)
    assert float(losses[-1]) < float(losses[0]) * 1.5  # it trains (same batch three times)


def test_a_mixed_step_trains_on_the_soft_targets():
    """With mixup/cutmix the step's loss is soft-target cross-entropy on the mixed batch (not the labels)."""
    from dali_fast.train import Trainer
    from dali_fast.transforms.mix import MixupCutmix, soft_target_cross_entropy

    torch.manual_seed(0)
    trainer = Trainer("resnet_tiny", 3, mix=MixupCutmix(alpha_mixup=1.0, alpha_cutmix=1.0, num_classes=3, seed=4))
    twin = MixupCutmix(alpha_mixup=1.0, alpha_cutmix=1.0, num_classes=3, seed=4)
    images, labels = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2])
    for _ in range(3):
        mixed, targets = twin(images, labels)
        trainer.model.train()
        with torch.no_grad():
            expected = soft_target_cross_entropy(trainer.model(mixed), targets)
        assert float(trainer.step(images, labels)) == pytest.approx(float(expected), rel=1e-5)
        assert trainer.mix.last == twin.last
