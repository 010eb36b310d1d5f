import pytest

from dali_fast.records import open_dataset, pack
from dali_fast.synthetic import make_synthetic
from dali_fast.train import run_train, split


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_synthetic(root / "images", images=120, classes=3, seed=1, progress=False)
    pack(root / "images", root / "packed", progress=False)
    return open_dataset(root / "packed")


@pytest.mark.parametrize("loader", ["baseline", "torch", "dali"])
def test_loss_falls_with_each_loader(learnable, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    lines = []
    rows = run_train(
        learnable,
        loader=loader,
        epochs=4,
        model="resnet_tiny",
        batch_size=16,
        image_size=48,
        lr=0.05,
        num_workers=0 if loader != "baseline" else 1,
        emit=lines.append,
    )
    assert len(rows) == 4 and len(lines) == 5
    assert rows[-1]["train_loss"] < 0.7 * rows[0]["train_loss"], [r["train_loss"] for r in rows]
    assert rows[-1]["val_acc"] > 0.6  # 3 classes: chance is 0.33


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


def test_split_disjoint_and_complete(learnable):
    a, b = split(learnable, 0.25)
    assert len(b) == 30 and sorted(list(a.indices) + list(b.indices)) == list(range(120))
