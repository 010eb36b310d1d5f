"""`Trainer`: one training step and the evaluation, with no host sync per batch; and the step that survives an out-of-memory by running the batch as halves."""

from __future__ import annotations

import pytest
import torch
from fakes import ScriptedProbe

from dali_fast.loaders.controller import BatchSizeController
from dali_fast.train.trainer import oom_safe_step


def test_evaluation_reads_the_device_once_not_per_batch():
    """Evaluation sums loss and hits on the device and reads them back once. On the `meta` device any
    read back fails, as it would stall a GPU: the read comes only after the last batch."""
    from dali_fast.train.trainer import Trainer

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
    from dali_fast.train.trainer import Trainer
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
    from dali_fast.train.trainer import Trainer
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


def test_a_training_step_does_not_sync_with_the_host(monkeypatch):
    """The loss stays on the device (on a GPU, reading it each step would wait for the step to finish)."""
    from dali_fast.train.trainer import Trainer

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
    from dali_fast.train.trainer import Trainer
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


def test_oom_safe_step_runs_halves_each_sample_once():
    seen = []
    weights = []

    def step(x, y, w):
        if len(y) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test double)")
        seen.extend(y.tolist())
        weights.append((len(y), w))
        return float(y.float().mean())

    c = BatchSizeController(2, 64, probe=ScriptedProbe([0.5]))
    c.attach(10)
    zeroed = []
    loss = oom_safe_step(step, torch.zeros(10, 1), torch.arange(10), zero_grad=lambda: zeroed.append(1), controller=c)
    assert sorted(seen) == list(range(10))
    assert sum(w for _, w in weights) == pytest.approx(1.0)  # the halves' losses add up to the batch mean
    assert all(w == pytest.approx(n / 10) for n, w in weights)
    assert loss == pytest.approx(4.5) and zeroed == [1]
    c.end_epoch(0)
    assert c.batch_size == 8 and c.history[-1]["decision"] == "shrink"


def test_oom_retry_runs_after_the_failed_step_is_freed():
    """The halves must not run while the failed step's activations are kept alive by the traceback."""
    import weakref

    refs, alive_when_halves_ran = [], []

    def step(x, y, w):
        if len(y) > 4:
            activations = torch.ones(1000)  # what the failed forward had allocated
            refs.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test double)")
        alive_when_halves_ran.append(refs[0]() is not None)
        return 0.0

    oom_safe_step(step, torch.zeros(8, 1), torch.arange(8), zero_grad=lambda: None)
    assert alive_when_halves_ran == [False, False]


def oom_split_step(alloc, free: int, calls: list[int]):
    """The step of the out-of-memory split tests: a batch of more than 2 samples keeps 0.6 x ``free`` (its
    activations) and asks for 0.6 x ``free`` more, which cannot fit; a half keeps 0.5 x ``free``, which
    fits only once the failed step's memory is gone."""

    def step(x, y, w):
        calls.append(len(y))
        held = [alloc(int(free * 0.6))] if len(y) > 2 else []
        held.append(alloc(int(free * (0.6 if len(y) > 2 else 0.5))))  # the full batch runs out of memory here
        return torch.zeros((), device=x.device) * len(held)

    return step


class CountedDeviceMemory:
    """A device of ``free`` bytes whose blocks are freed when nothing refers to them any more (as torch's
    tensors are): an allocation that does not fit raises torch's out-of-memory error."""

    def __init__(self, free: int) -> None:
        self.free, self.live, self.peak = free, 0, 0

    def alloc(self, n: int) -> object:
        import weakref

        if self.live + n > self.free:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (modelled): {n} more with {self.live} held")
        block = type("Block", (), {})()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(block, self._release, n)
        return block

    def _release(self, n: int) -> None:
        self.live -= n


def test_oom_split_step_runs_out_of_memory_and_the_halves_fit_once_it_is_freed():
    """What the GPU test below claims, on a model of the device: the full batch's step really runs out
    of memory (its first allocation is kept), and the halves fit only because the failed step's memory
    was let go before they ran."""
    device, calls = CountedDeviceMemory(1000), []
    oom_safe_step(oom_split_step(device.alloc, 1000, calls), torch.zeros(4, 1), torch.arange(4), zero_grad=lambda: None)
    assert calls == [4, 2, 2] and device.live == 0 and device.peak == 600


@pytest.mark.gpu
def test_gpu_oom_split_frees_the_failed_step():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    calls: list[int] = []

    def alloc(n):
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    step = oom_split_step(alloc, free, calls)
    oom_safe_step(step, torch.zeros(4, 1, device="cuda"), torch.arange(4, device="cuda"), zero_grad=lambda: None)
    assert calls == [4, 2, 2]  # the whole batch ran out of memory; each half fitted
    torch.cuda.empty_cache()
