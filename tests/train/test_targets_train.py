"""Training on multi-hot and float targets: mixup and cutmix mix the rows with the images' lambda, label
smoothing acts per class, mAP is the step-wise area under each class's precision-recall curve, and
`train --target multihot` on a synthetic multi-label set drives the loss down and the mAP up."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from builders import one_line

from dali_fast import MixupCutmix, make_synthetic, open_dataset
from dali_fast.train.metrics import average_precision, mean_average_precision
from dali_fast.train.run import run_train
from dali_fast.train.trainer import Trainer
from dali_fast.transforms.mix import smooth_multihot


@pytest.fixture(scope="module")
def tags(tmp_path_factory):
    """160 images, each with a random subset of 4 classes (a patch of each class's colour), and labels.csv."""
    root = tmp_path_factory.mktemp("tags") / "tags"
    make_synthetic(root, images=160, classes=4, seed=1, progress=False, multi_label=True)
    return root


def _batch(n: int = 6, k: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, 10, 10).contiguous()  # image i is i
    rows = (torch.rand(n, k, generator=g) < 0.4).float()
    return images, rows


# ---------------------------------------------------------------------------------------------- mixing


def test_mixup_mixes_multihot_rows_with_the_images_lambda():
    images, rows = _batch()
    mix = MixupCutmix(alpha_mixup=0.8, alpha_cutmix=0.0, label_smoothing=0.0, num_classes=5, seed=3, target="multihot")
    for _ in range(3):
        mixed, targets = mix(images, rows)
        lam = mix.last["lam"]
        assert mix.last["mode"] == "mixup" and 0 < lam < 1
        torch.testing.assert_close(mixed, lam * images + (1 - lam) * images.flip(0))
        torch.testing.assert_close(targets, lam * rows + (1 - lam) * rows.flip(0))
        # linear: each target row is the same blend of the two rows as its image is of the two images
        share = (mixed[:, 0, 0, 0] - images.flip(0)[:, 0, 0, 0]) / (images - images.flip(0))[:, 0, 0, 0]
        torch.testing.assert_close(share[share == share], torch.full_like(share[share == share], lam))


def test_cutmix_mixes_the_rows_by_the_area_it_pastes():
    images, rows = _batch(n=4)
    mix = MixupCutmix(alpha_mixup=0.0, alpha_cutmix=1.0, label_smoothing=0.0, num_classes=5, seed=11, target="multihot")
    mixed, targets = mix(images, rows)
    lam = mix.last["lam"]
    assert mix.last["mode"] == "cutmix"
    pasted = (mixed[0, 0] == 3).float().mean().item()  # image 0 is 0 except where image 3 was pasted
    assert pasted == pytest.approx(1 - lam) and 0 < pasted < 1
    torch.testing.assert_close(targets, lam * rows + (1 - lam) * rows.flip(0))


def test_label_smoothing_acts_per_class_on_multihot_rows():
    _, rows = _batch()
    mix = MixupCutmix(alpha_mixup=0.0, alpha_cutmix=0.0, label_smoothing=0.2, num_classes=5, target="multihot")
    _, targets = mix(torch.zeros(6, 3, 4, 4), rows)
    assert mix.last == {"mode": "none", "lam": 1.0, "box": None}
    torch.testing.assert_close(targets, torch.where(rows > 0, torch.tensor(0.9), torch.tensor(0.1)))
    torch.testing.assert_close(smooth_multihot(rows, 0.2), targets)
    assert smooth_multihot(rows, 0.0) is rows
    both = MixupCutmix(alpha_mixup=1.0, alpha_cutmix=0.0, label_smoothing=0.2, num_classes=5, seed=2, target="multihot")
    _, mixed = both(torch.zeros(6, 3, 4, 4), rows)
    lam = both.last["lam"]
    smoothed = rows * 0.8 + 0.1
    torch.testing.assert_close(mixed, lam * smoothed + (1 - lam) * smoothed.flip(0))  # smoothing and mixing commute


def test_float_rows_mix_but_are_not_smoothed_and_shapes_are_checked():
    images, _ = _batch()
    values = torch.randn(6, 3)
    mix = MixupCutmix(alpha_mixup=0.5, alpha_cutmix=0.0, label_smoothing=0.0, num_classes=3, seed=1, target="float")
    _, targets = mix(images, values)
    lam = mix.last["lam"]
    torch.testing.assert_close(targets, lam * values + (1 - lam) * values.flip(0))
    with pytest.raises(ValueError) as e:
        MixupCutmix(label_smoothing=0.1, num_classes=3, target="float")
    assert one_line(e) == "label_smoothing=0.1: float targets have no classes to smooth towards; use 0"
    with pytest.raises(ValueError) as e:
        MixupCutmix(num_classes=3, target="tags")
    assert one_line(e) == "target='tags': use 'class', 'multihot' or 'float'"
    multihot = MixupCutmix(num_classes=5, target="multihot")
    with pytest.raises(ValueError) as e:
        multihot(images, torch.zeros(6, dtype=torch.int64))
    assert one_line(e) == (
        "target='multihot' mixes float rows (N, 5), got torch.int64 (6,): open the data set with "
        "target='multihot' (and num_classes)"
    )
    with pytest.raises(ValueError, match=r"got torch.float32 \(6, 4\)"):
        multihot(images, torch.zeros(6, 4))


# ---------------------------------------------------------------------------------------------- mAP


def _ap_oracle(scores: np.ndarray, positive: np.ndarray) -> float:
    """scikit-learn's definition, written out: sum over thresholds (distinct scores, high to low) of the
    recall gained there times the precision there."""
    total = positive.sum()
    if total == 0:
        return math.nan
    ap, recall_before = 0.0, 0.0
    for t in sorted(set(scores.tolist()), reverse=True):
        chosen = scores >= t
        precision = positive[chosen].sum() / chosen.sum()
        recall = positive[chosen].sum() / total
        ap += (recall - recall_before) * precision
        recall_before = recall
    return ap


def test_average_precision_by_hand_and_against_the_definition():
    ap = average_precision(torch.tensor([[0.9, 0.1], [0.8, 0.9], [0.7, 0.9]]), torch.tensor([[1, 0], [0, 1], [1, 0]]))
    assert ap.dtype == torch.float64
    # class 0: positives ranked 1st and 3rd: (1 + 2/3) / 2; class 1: its positive ties with a negative at the top: 1/2
    assert ap.tolist() == pytest.approx([5 / 6, 0.5])
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 6, size=(40, 7)).astype(np.float32)  # many ties
    targets = (rng.random((40, 7)) < 0.3).astype(np.float32)
    targets[:, 6] = 0  # a class without a positive
    got = average_precision(torch.from_numpy(scores), torch.from_numpy(targets)).tolist()
    want = [_ap_oracle(scores[:, k], targets[:, k] > 0.5) for k in range(7)]
    assert got[:6] == pytest.approx(want[:6]) and math.isnan(got[6]) and math.isnan(want[6])
    assert mean_average_precision(torch.from_numpy(scores), torch.from_numpy(targets)) == pytest.approx(
        np.mean(want[:6])
    )
    assert math.isnan(mean_average_precision(torch.zeros(3, 2), torch.zeros(3, 2)))
    assert math.isnan(average_precision(torch.zeros(0, 2), torch.zeros(0, 2))[0])
    with pytest.raises(ValueError) as e:
        average_precision(torch.zeros(3, 2), torch.zeros(3, 1))
    assert one_line(e) == "scores (3, 2) and targets (3, 1): both must be (N, K)"


# ---------------------------------------------------------------------------------------------- training


def test_the_trainer_losses_and_metrics_per_target_kind():
    torch.manual_seed(0)
    images = torch.randn(8, 3, 16, 16)
    rows = (torch.rand(8, 4) < 0.5).float()
    multihot = Trainer("resnet_tiny", 4, amp=False, label_smoothing=0.2, target="multihot")
    logits = torch.randn(8, 4)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, rows * 0.8 + 0.1)
    torch.testing.assert_close(multihot.train_loss(logits, rows), expected)
    loss, metric = multihot.evaluate([(images[:5], rows[:5]), (images[5:], rows[5:])])
    with torch.no_grad():
        multihot.module.eval()
        out = multihot.module(images)
    assert loss == pytest.approx(torch.nn.functional.binary_cross_entropy_with_logits(out, rows).item(), rel=1e-5)
    assert metric == pytest.approx(mean_average_precision(out, rows))
    floats = Trainer("resnet_tiny", 4, amp=False, target="float")
    torch.testing.assert_close(floats.train_loss(logits, rows), torch.nn.functional.mse_loss(logits, rows))
    assert floats.evaluate([(images, rows)])[1] is None
    with pytest.raises(ValueError) as e:
        Trainer("resnet_tiny", 4, label_smoothing=0.1, target="float")
    assert one_line(e) == "label_smoothing=0.1: float targets have no classes to smooth; use 0"
    with pytest.raises(ValueError, match="target='tags': use 'class', 'multihot' or 'float'"):
        Trainer("resnet_tiny", 4, target="tags")


@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_train_multihot_the_loss_falls_and_the_map_rises(tags, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    lines: list[str] = []
    reader = open_dataset(tags, target="multihot", num_classes=4)
    rows = run_train(
        reader, loader=loader, epochs=4, model="resnet_tiny", batch_size=16, image_size=48, lr=0.05,
        num_workers=0 if loader == "torch" else None, emit=lines.append,
    )  # fmt: skip
    assert ", evaluating on 32 held out of it, multi-hot targets of 4 classes, loader=" in lines[0]
    assert all(" mAP " in line and " acc " not in line for line in lines[1:5])
    assert all("val_acc" not in r for r in rows)
    losses, maps = [r["train_loss"] for r in rows], [r["val_map"] for r in rows]
    assert losses[-1] < 0.85 * losses[0], losses
    # chance is about the share of positives, 0.4; on 32 held-out images one epoch's mAP moves by several
    # hundredths when the pixels move by a level, so the rise is read over the last two epochs
    assert sum(maps[-2:]) / 2 > maps[0] + 0.1 and maps[-1] > 0.75, maps


def test_train_float_targets_with_mse(tags, tmp_path):
    """Float targets (here each class's presence as a number): MSE falls; no accuracy or mAP is claimed."""
    import shutil

    root = tmp_path / "floats"
    shutil.copytree(tags, root)
    lines = (tags / "labels.csv").read_text().splitlines()[1:]
    out = ["path,presence"]
    for line in lines:
        path, classes = line.split(",")
        present = {int(c) for c in classes.split()}
        out.append(",".join([path, *("1" if k in present else "0" for k in range(4))]))
    (root / "labels.csv").write_text("\n".join(out) + "\n")
    shown: list[str] = []
    rows = run_train(
        open_dataset(root, target="float"), loader="torch", epochs=3, model="resnet_tiny", batch_size=16,
        image_size=48, lr=0.05, num_workers=0, mixup=0.2, emit=shown.append,
    )  # fmt: skip
    assert "float targets of 4 numbers" in shown[0] and "alpha_mixup=0.2" in shown[0]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and all(
        "val_map" not in r and "val_acc" not in r for r in rows
    )
    assert " mAP " not in shown[1] and " acc " not in shown[1]
    with pytest.raises(ValueError, match="float targets have no classes to smooth"):
        run_train(
            open_dataset(root, target="float"), loader="torch", epochs=1, model="resnet_tiny", label_smoothing=0.1
        )


def test_a_checkpoint_resumes_only_with_the_same_targets(tags, tmp_path):
    from dali_fast import pack

    kw = {"loader": "torch", "epochs": 1, "model": "resnet_tiny", "batch_size": 32, "image_size": 32, "num_workers": 0}
    pack(tags, tmp_path / "packed", target="multihot", num_classes=4, progress=False)
    reader = open_dataset(tmp_path / "packed")
    run_train(reader, checkpoint=tmp_path / "ck", emit=lambda _: None, **kw)
    lines: list[str] = []
    run_train(reader, checkpoint=tmp_path / "ck", resume=True, emit=lines.append, **{**kw, "epochs": 2})
    assert lines[0].startswith(f"resumed from {tmp_path / 'ck' / 'checkpoint.pt'}: epoch 0")
    with pytest.raises(ValueError) as e:
        run_train(
            open_dataset(tmp_path / "packed", target="class"), checkpoint=tmp_path / "ck", resume=True,
            emit=lambda _: None, **{**kw, "epochs": 3},
        )  # fmt: skip
    assert one_line(e) == (
        f"{tmp_path / 'ck' / 'checkpoint.pt'}: saved with target='multihot:4', this run has target=None; resume "
        "with the same settings or use a new --checkpoint folder"
    )


def test_the_command_line_trains_on_multihot_targets(tags, capsys):
    from dali_fast.cli import main

    argv = ["train", str(tags), "--target", "multihot", "--num-classes", "4", "--loader", "torch",
            "--model", "resnet_tiny", "--epochs", "1", "--batch-size", "16", "--image-size", "32", "--num-workers", "0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "multi-hot targets of 4 classes" in out[0] and " mAP " in out[1]
    assert main(["train", "--target", "multihot", "--num-classes", "4", "--epochs", "1"]) == 2
    assert capsys.readouterr().err == (
        "dali-fast train: error: --target multihot needs a DATASET with targets (the default synthetic set has one "
        "class per image); make one with `dali-fast make-synthetic OUT --multi-label`\n"
    )


def test_bench_carries_the_targets(tags, tmp_path):
    from dali_fast.tools.bench import run_bench

    reader = open_dataset(tags, target="multihot", num_classes=4)
    result = run_bench(
        reader, loaders=["baseline", "torch"], epochs=1, batch_size=16, image_size=32, model="resnet_tiny",
        out=tmp_path / "b", progress=False, limit=False, mix={"alpha_mixup": 0.2, "alpha_cutmix": 0.0, "label_smoothing": 0.1},
    )  # fmt: skip
    assert [(r["loader"], r.get("error")) for r in result["rows"]] == [("baseline", None), ("torch", None)]
    assert all(r["images_per_epoch"] == 160 for r in result["rows"])  # training, so the partial batch counts


def test_make_synthetic_multi_label_from_the_command_line(tmp_path, capsys):
    from dali_fast.cli import main

    assert main(["make-synthetic", str(tmp_path / "t"), "--images", "6", "--classes", "3", "--multi-label"]) == 0
    assert (
        capsys.readouterr().out
        == f"wrote 6 images in 3 classes to {tmp_path / 't'} (targets in {tmp_path / 't' / 'labels.csv'})\n"
    )
    lines = (tmp_path / "t" / "labels.csv").read_text().splitlines()
    assert lines[0] == "path,labels" and [x.split(",")[0] for x in lines[1:]] == [
        f"images/img_{i:07d}.jpg" for i in range(6)
    ]
    again = tmp_path / "again"
    make_synthetic(again, images=6, classes=3, progress=False, multi_label=True)  # the same seed: the same bytes
    assert (again / "labels.csv").read_text() == (tmp_path / "t" / "labels.csv").read_text()
    assert (again / "images" / "img_0000004.jpg").read_bytes() == (
        tmp_path / "t" / "images" / "img_0000004.jpg"
    ).read_bytes()
    reader = open_dataset(tmp_path / "t", target="multihot", num_classes=3)
    assert len(reader) == 6 and reader.targets.rows(range(6)).sum() == sum(
        len(x.split(",")[1].split()) for x in lines[1:]
    )
