"""`run_train`: the loss falls with every loader, the settings are checked before any work, checkpoints
resume at the exact sample (under torchrun and after SIGKILL too)."""

import json
import math
import subprocess
from pathlib import Path

import pytest
from train_runs import (
    check_epoch_cover,
    dist_backend,
    index_records,
    kill_at_first_checkpoint,
    skip_without_enough_gpus,
    train_args,
    train_command,
    train_env,
    train_indices,
)

from dali_fast.data.open import open_dataset
from dali_fast.data.pack.packed import pack
from dali_fast.data.synthetic import make_synthetic
from dali_fast.train.checkpoint import load_checkpoint
from dali_fast.train.run import run_train
from dali_fast.transforms.recipe import Progressive, Recipe

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("loader", ["baseline", "torch", "dali"])
def test_a_resolution_ramp_still_drives_the_held_out_loss_down(learnable, loader):
    """Progressive resizing through train: each epoch at the ramp's size (said when it changes), evaluation
    at --image-size, and the held-out loss still falls."""
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    ramp = Progressive(32, 48, start_epoch=0, end_epoch=2, step=8)
    rows, lines = _train_small(learnable, loader, recipe=Recipe(image_size=48, resolution=ramp))
    assert "progressive=32:48:0:2:8 (eval at 48 px)" in lines[0]
    assert [r["image_size"] for r in rows] == [32, 40, 48, 48]
    assert [x for x in lines if " px, was " in x] == [
        "epoch 1: training at 40 px, was 32 px",
        "epoch 2: training at 48 px, was 40 px",
    ]
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


def test_the_controller_never_grows_past_a_rank_s_share(learnable, tmp_path):
    """With drop_last, a batch larger than a rank's share is dropped whole. The controller grew up to 8 times
    the batch size whatever the share: here 16 → 32 → 64 → 128 on 96 training images, and its last epoch
    trained on nothing (the preemption fuzz met it on 3 ranks of 12 images). It stops at the share."""
    record = tmp_path / "seen.jsonl"
    rows = run_train(
        learnable, loader="torch", epochs=4, model="resnet_tiny", batch_size=16, image_size=16, num_workers=0,
        controller=True, record_indices=record, emit=lambda _: None,
    )  # fmt: skip
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    per_epoch = [sum(len(x["indices"]) for x in seen if x["epoch"] == e) for e in range(4)]
    assert [r["batch_size"] for r in rows] == [16, 32, 64, 96] and per_epoch == [96, 96, 64, 96]  # 64 + 32 dropped


def test_labels_outside_the_classes_stop_training_before_any_step():
    from builders import IndexReader, jpeg_bytes

    reader = IndexReader([jpeg_bytes() for _ in range(6)], classes=4)  # labels 0..5 (the index), 4 classes
    with pytest.raises(ValueError, match=r"^record 4 \(mem://4.jpg\) has label 4"):
        run_train(reader, loader="torch", epochs=1, model="resnet_tiny", batch_size=2, image_size=16, num_workers=0)


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
    # another recipe or batch mixing is another run; the defaults stay out of the config (older checkpoints
    # resume); the refusal names the field that differs and both values, not two whole dicts
    aug = Recipe(image_size=32, auto_augment="randaugment")
    for extra, key, was, now in (
        ({"recipe": aug}, "recipe.auto_augment", None, "randaugment"),
        ({"mixup": 0.2}, "mix.alpha_mixup", 0.0, 0.2),
        ({"label_smoothing": 0.1}, "mix.label_smoothing", 0.0, 0.1),
    ):
        with pytest.raises(ValueError) as e:
            run_train(learnable, **kw, **extra, resume=True)
        assert str(e.value) == (
            f"{tmp_path / 'checkpoint.pt'}: saved with {key}={was!r}, this run has {key}={now!r}; "
            "resume with the same settings or use a new --checkpoint folder"
        )
    # another resolution schedule (or one where there was none) is refused, naming the schedule
    ramp = Recipe(image_size=32, resolution=Progressive(16, 32, 0, 2, step=8))
    with pytest.raises(ValueError) as e:
        run_train(learnable, **kw, recipe=ramp, resume=True)
    assert str(e.value) == (
        f"{tmp_path / 'checkpoint.pt'}: saved with resolution=None, this run has "
        "resolution={'progressive': '16:32:0:2:8'}; resume with the same settings or use a new --checkpoint folder"
    )
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


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["torch"])  # DALI under torchrun: the 2-rank SIGKILL/resume test below
def test_torchrun_two_ranks_shard_each_epoch_exactly_once(odd_set, tmp_path, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    skip_without_enough_gpus(2)
    args = train_args(odd_set, loader, tmp_path, "idx") + ["--out", str(tmp_path / "out")]
    proc = subprocess.run(train_command(2, args), env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only rank 0 prints and writes.
    lines = proc.stdout.splitlines()
    assert sum(x.startswith("epoch 0:") for x in lines) == 1 and sum(x.startswith("epoch 1:") for x in lines) == 1
    assert f"2 ranks ({dist_backend()})" in proc.stdout and "replicas in sync after training: yes" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.json"]
    recs, train = index_records(tmp_path, "idx", 2), train_indices(odd_set)
    orders = []
    for epoch in (0, 1):
        per_rank = {r: [i for x in recs[r] if x["epoch"] == epoch for i in x["indices"]] for r in recs}
        batches = {r: sum(x["epoch"] == epoch for x in recs[r]) for r in recs}
        assert batches[0] == batches[1] == math.ceil(math.ceil(97 / 2) / 5)  # 49 samples in batches of 5
        check_epoch_cover(per_rank, train, 2)
        orders.append(per_rank[0])
    assert orders[0] != orders[1]  # reshuffled per epoch


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "loader"), [(1, "torch"), (2, "dali")])  # each backend, each rank count
def test_sigkill_then_resume_sees_each_sample_once(odd_set, tmp_path, nproc, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    skip_without_enough_gpus(nproc)
    ck = tmp_path / "ck"
    extra = ["--checkpoint", str(ck), "--checkpoint-every", "3"]
    kill_at_first_checkpoint(
        train_command(nproc, train_args(odd_set, loader, tmp_path, "before") + extra), ck / "checkpoint.pt"
    )
    state = load_checkpoint(ck / "checkpoint.pt")
    cut = int(state["step"])
    per_rank_len = math.ceil(97 / nproc)
    assert not state["epoch_done"]
    positions = [r["loader"]["sampler"]["position"] for r in state["ranks"]]
    assert len(set(positions)) == 1 and 0 < positions[0] < per_rank_len, positions  # killed mid-epoch

    proc = subprocess.run(
        train_command(nproc, train_args(odd_set, loader, tmp_path, "after") + extra + ["--resume"]),
        env=train_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ck / 'checkpoint.pt'}: epoch {state['epoch']}, step {cut}" in proc.stdout
    before, after = index_records(tmp_path, "before", nproc), index_records(tmp_path, "after", nproc)
    for r in range(nproc):
        assert min(x["step"] for x in after[r]) == cut + 1  # the resumed run starts at the next batch
    train = train_indices(odd_set)
    for epoch in (0, 1):
        per_rank = {
            r: [i for x in before[r] if x["epoch"] == epoch and x["step"] <= cut for i in x["indices"]]
            + [i for x in after[r] if x["epoch"] == epoch for i in x["indices"]]
            for r in range(nproc)
        }
        check_epoch_cover(per_rank, train, nproc)


def test_the_settings_are_one_config_checked_before_any_work(tmp_path):
    from builders import IndexReader, jpeg_bytes

    from dali_fast.train.config import TrainConfig

    reader = IndexReader([jpeg_bytes() for _ in range(6)])
    for settings, says in (
        ({"loader": "jax"}, "loader 'jax': choose one of baseline, torch, dali"),
        ({"loader": "baseline", "controller": True}, "--controller needs --loader dali or torch"),
        ({"resume": True}, "resume needs a checkpoint folder: pass --checkpoint DIR with --resume"),
        ({"on_error": "ignore"}, "on_error='ignore': use 'raise' or 'skip'"),
        ({"checkpoint_every": 0}, "checkpoint_every=0: must be >= 1 step"),
    ):
        with pytest.raises(ValueError) as e:
            run_train(reader, **settings)
        assert str(e.value).startswith(says)
        with pytest.raises(ValueError):
            TrainConfig(**settings).checked()
    with pytest.raises(TypeError, match="epoch"):
        run_train(reader, epoch=3)  # a misspelt setting is not silently ignored
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        run_train(reader, TrainConfig(out=tmp_path / "file" / "out"))
    assert TrainConfig(out=str(tmp_path)).checked().out == tmp_path  # paths as paths, recipe resolved
    assert TrainConfig(image_size=32).checked().recipe.image_size == 32


def test_the_docs_name_every_setting_a_resume_must_match(learnable):
    """docs/distributed.md lists every setting a checkpoint must match: each key of the saved settings,
    each field of the recipe and of the batch mixing."""
    from types import SimpleNamespace

    from dali_fast.train.config import TrainConfig
    from dali_fast.train.run import _settings

    config = TrainConfig(image_size=32, mixup=0.2)
    recipe = Recipe(image_size=32, random_erasing=0.25)
    held, val = (SimpleNamespace(held_out=h, val=learnable) for h in ("records", "val"))
    run = SimpleNamespace(config=config, ctx=SimpleNamespace(world_size=1), recipe=recipe, sets=held)
    with_val = SimpleNamespace(**{**vars(run), "sets": val})
    settings = {**_settings(learnable, run, mixing=True), **_settings(learnable, with_val, mixing=True)}
    docs = (ROOT / "docs" / "distributed.md").read_text()
    section = docs[docs.index("A resume must match") :]
    section = section[: section.index("\n\n")]
    names = [*settings, *(f"recipe.{k}" for k in settings["recipe"]), *(f"mix.{k}" for k in settings["mix"])]
    missing = [n for n in names if f"`{n.split('.')[-1]}`" not in section]
    assert not missing, f"docs/distributed.md does not name {missing}"


def test_a_setting_the_loader_has_no_use_for_is_refused_or_said(caplog):
    from dali_fast.train.config import TrainConfig

    with pytest.raises(ValueError, match="--checkpoint-every needs a checkpoint folder"):
        TrainConfig(checkpoint_every=3).checked()
    with caplog.at_level("WARNING"):
        TrainConfig(loader="dali", num_workers=2).checked()
        TrainConfig(loader="torch", num_workers=2).checked()
    said = [m for m in caplog.messages if m.startswith("--num-workers 2:")]
    assert len(said) == 1 and "--loader dali decodes in its own threads" in said[0]
