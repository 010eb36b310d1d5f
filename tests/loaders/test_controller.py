"""`BatchSizeController`'s decisions: grow, shrink or hold on the probe's readings, the ceilings it keeps,
the exact record of each decision, ranks that agree, its state; and the caches it releases between epochs."""

from __future__ import annotations

import logging

import pytest
import torch
from fakes import ScriptedProbe

from dali_fast.loaders.controller import BatchSizeController
from dali_fast.loaders.memory_probes import MaxProbe, NvmlProbe


class LinearProbe:
    """Peak = fixed + per_sample * batch, reading the controller's current batch size."""

    name = "linear"
    capacity_bytes = 2**30

    def __init__(self, fixed, per_sample):
        self.fixed, self.per_sample, self.controller = fixed, per_sample, None

    def reset_peak(self):
        pass

    def peak_fraction(self):
        return self.fixed + self.per_sample * self.controller.batch_size


def run(ctrl, epochs):
    sizes = []
    for e in range(epochs):
        ctrl.begin_epoch()
        sizes.append(ctrl.batch_size)
        ctrl.end_epoch(e)
    return sizes


def test_grow_shrink_hold_sequence(caplog):
    probe = ScriptedProbe([0.2, 0.35, 0.9, 0.45, 0.44])
    c = BatchSizeController(8, 4096, probe=probe)
    c.attach(256)
    with caplog.at_level(logging.INFO):
        sizes = run(c, 5)
    assert sizes == [256, 512, 1024, 512, 512]
    assert [h["decision"] for h in c.history] == ["grow", "grow", "shrink", "hold", "hold"]
    assert probe.resets == 5
    msg = caplog.records[0].getMessage()
    assert msg.startswith("epoch 0: peak 20% of 80 GiB") and "batch 256 → 512" in msg


def test_cautious_first_guess_and_linear_fit():
    c = BatchSizeController(8, 4096, probe=ScriptedProbe([0.40]))
    c.attach(256)
    run(c, 1)
    assert c.batch_size == 256  # 0.40 doubled = 0.80 > 0.85 - 0.05: hold
    probe = LinearProbe(0.30, 0.001)  # fixed 30% + 0.1% per sample
    c = BatchSizeController(8, 4096, probe=probe)
    probe.controller = c
    c.attach(64)
    sizes = run(c, 6)
    # 64: 0.364 → 128 predicted 0.728 (cautious) ok; 128: 0.428, fit predicts 0.556 at 256 → grow;
    # 256: 0.556 → 512 predicted 0.812 > 0.80 → hold
    assert sizes == [64, 128, 256, 256, 256, 256]
    assert c.predict(512) == pytest.approx(0.812)


def test_clamping_and_rounding():
    c = BatchSizeController(24, 100, probe=ScriptedProbe([0.01, 0.01, 0.01, 0.99, 0.99, 0.99]))
    c.attach(30)
    assert c.batch_size == 30
    assert run(c, 6) == [30, 56, 96, 96, 48, 24]
    assert c.history[2]["reason"].endswith("at max_batch 100")
    assert c.batch_size == 24 and c.history[-1]["decision"] == "hold"  # already at min_batch
    assert all(b % 8 == 0 for b in (56, 96, 48, 24))


def test_hysteresis_no_flip_flop():
    readings = [0.84, 0.86, 0.43, 0.44, 0.42, 0.43, 0.44, 0.42]
    c = BatchSizeController(8, 4096, probe=ScriptedProbe(readings))
    c.attach(512)
    sizes = run(c, len(readings))
    assert sizes == [512, 512, 256, 256, 256, 256, 256, 256]
    changes = sum(1 for a, b in zip(sizes, sizes[1:], strict=False) if a != b)
    assert changes == 1


def test_unreadable_probe_holds_and_logs_once(caplog):
    c = BatchSizeController(8, 4096, probe=ScriptedProbe([None, None, 0.1, None]))
    c.attach(64)
    with caplog.at_level(logging.WARNING, logger="dali_fast.loaders.controller"):
        assert run(c, 4) == [64, 64, 64, 128]
    assert c.batch_size == 128
    assert [h["decision"] for h in c.history] == ["hold", "hold", "grow", "hold"]
    assert c.history[0]["reason"] == "memory could not be read" and c.history[0]["peak_fraction"] is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["memory probe 'scripted' gave no reading at the end of epoch 0: batch size held at 64"]


def test_never_regrows_to_a_size_that_ran_out_of_memory():
    c = BatchSizeController(8, 4096, probe=ScriptedProbe([0.10] * 6))
    c.attach(512)
    sizes = []
    for e in range(6):
        c.begin_epoch()
        sizes.append(c.batch_size)
        if e == 0:
            c.report_oom(512)
        c.end_epoch(e)
    assert sizes == [512, 256, 256, 256, 256, 256]  # the peak reads low, but 512 ran out of memory
    assert c.history[1]["reason"] == "peak 10% of 80 GiB; batch 512 went over 85% before"


def test_never_regrows_to_a_size_that_went_over_the_target():
    c = BatchSizeController(8, 4096, probe=ScriptedProbe([0.90, 0.30, 0.30, 0.30]))
    c.attach(128)
    assert run(c, 4) == [128, 64, 64, 64]
    c2 = BatchSizeController(8, 4096, probe=ScriptedProbe([0.30, 0.30]))
    c2.attach(128)
    c2.load_state_dict(c.state_dict())  # the ceiling survives a resume
    c2.batch_size = 64
    assert run(c2, 2) == [64, 64]


def test_nvml_probe_unreadable_holds_once(caplog):
    class NoDriver:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    probe = NvmlProbe(nvml=NoDriver())
    c = BatchSizeController(8, 64, probe=probe)
    c.attach(16)
    with caplog.at_level(logging.WARNING):
        assert run(c, 3) == [16, 16, 16]
    warnings = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(warnings) == 1 and "Not Found" in warnings[0].getMessage()


def test_on_change_and_state_dict():
    changes = []
    c = BatchSizeController(8, 1024, probe=ScriptedProbe([0.1, 0.9]), on_change=lambda a, b: changes.append((a, b)))
    c.attach(64)
    run(c, 2)
    assert changes == [(64, 128), (128, 64)]
    d = BatchSizeController(8, 1024, probe=ScriptedProbe([]))
    d.load_state_dict(c.state_dict())
    assert d.batch_size == 64 and d.ceiling == 128 and len(d.history) == 2


def test_bad_arguments():
    for args, match in [((0, 8), "min_batch"), ((16, 8), "min_batch"), ((8, 16, 1.5), "target_fraction")]:
        with pytest.raises(ValueError, match=match):
            BatchSizeController(*args)


def test_iterator_driven_by_controller_six_epochs(index_reader):
    pytest.importorskip("nvidia.dali")
    from dali_fast import DALIIterator, TorchIterator

    for cls, extra in ((DALIIterator, {}), (TorchIterator, {"num_workers": 0})):
        c = BatchSizeController(2, 32, multiple_of=2, probe=ScriptedProbe([0.1, 0.1, 0.1, 0.95, 0.95, 0.5]))
        loader = cls(index_reader, 4, controller=c, image_size=16, device="cpu", **extra)
        sizes = []
        for epoch in range(6):
            loader.set_epoch(epoch)
            expected = len(loader)
            labels, batches = [], 0
            for _, y in loader:
                labels += y.tolist()
                batches += 1
            assert sorted(labels) == list(range(37)) and batches == expected
            sizes.append(c.history[-1]["batch_size"])
        assert sizes == [4, 8, 16, 32, 16, 8]


def _two_rank_decisions(rank: int, world: int, init_file: str, out_file: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Rank 0 reads low memory, rank 1 goes over the target in epoch 0; epoch 1 the reverse order.
        readings = [[0.20, 0.30], [0.95, None]][rank]
        ctrl = BatchSizeController(8, 256, target_fraction=0.85, probe=ScriptedProbe(readings))
        ctrl.attach(64)
        sizes = [ctrl.end_epoch(0), ctrl.end_epoch(1)]
        with open(f"{out_file}.{rank}", "w") as f:
            json.dump({"sizes": sizes, "peaks": [h["peak_fraction"] for h in ctrl.history]}, f)
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_batch_size(tmp_path):
    """Under torch.distributed every rank takes the worst rank's peak, so batch counts stay equal."""
    import json

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_two_rank_decisions, args=(r, 2, str(tmp_path / "init"), str(tmp_path / "out")))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert got[0] == got[1]
    # epoch 0: worst 0.95 > 0.85 → shrink 64→32 on both; epoch 1: worst 0.30 (rank 1's None ignored),
    # and 64 went over before → both hold at 32.
    assert got[0]["sizes"] == [32, 32] and got[0]["peaks"] == [0.95, 0.30]


def test_sync_ranks_off_without_process_group():
    ctrl = BatchSizeController(8, 256, probe=ScriptedProbe([0.95]))
    ctrl.attach(64)
    assert ctrl.end_epoch(0) == 32  # no process group: its own reading


def test_a_probe_with_only_the_two_documented_methods_works():
    class Minimal:  # the documented contract: reset_peak() and peak_fraction(), nothing else
        def reset_peak(self):
            pass

        def peak_fraction(self):
            return 0.2

    c = BatchSizeController(8, 1024, probe=Minimal())
    c.attach(64)
    assert run(c, 2) == [64, 128]
    assert c.history[0]["reason"] == "peak 20%, predicted 40% at 128 < 80%"
    assert MaxProbe([Minimal(), ScriptedProbe([0.5])]).peak_fraction() == 0.5
    assert MaxProbe([Minimal()]).capacity_bytes is None and MaxProbe([Minimal()]).name == "Minimal"


def test_every_decision_recorded_exactly(caplog):
    c = BatchSizeController(8, 256, probe=ScriptedProbe([0.10, 0.30, 0.95, None, 0.50, 0.20]))
    c.attach(64)
    with caplog.at_level(logging.INFO, logger="dali_fast.loaders.controller"):
        sizes = run(c, 3)
        c.begin_epoch()
        c.report_oom(64)
        c.end_epoch(3)
        sizes += run(c, 2)
    assert sizes == [64, 128, 128, 32, 32]
    cap = "of 80 GiB"
    assert c.history == [
        {"epoch": 0, "batch_size": 64, "peak_fraction": 0.10, "decision": "grow",
         "reason": f"peak 10% {cap}, predicted 20% at 128 < 80%", "next_batch_size": 128},
        {"epoch": 1, "batch_size": 128, "peak_fraction": 0.30, "decision": "hold",
         "reason": f"peak 30% {cap}, predicted 80% at 256 too close to 85%", "next_batch_size": 128},
        {"epoch": 2, "batch_size": 128, "peak_fraction": 0.95, "decision": "shrink",
         "reason": f"peak 95% {cap} > 85%", "next_batch_size": 64},
        {"epoch": 3, "batch_size": 64, "peak_fraction": None, "decision": "shrink",
         "reason": "out of memory during the epoch", "next_batch_size": 32},
        {"epoch": 0, "batch_size": 32, "peak_fraction": 0.50, "decision": "hold",
         "reason": f"peak 50% {cap}; batch 64 went over 85% before", "next_batch_size": 32},
        {"epoch": 1, "batch_size": 32, "peak_fraction": 0.20, "decision": "hold",
         "reason": f"peak 20% {cap}; batch 64 went over 85% before", "next_batch_size": 32},
    ]  # fmt: skip
    assert c.ceiling == 64 and c.observations == [(64, 0.10), (128, 0.30), (128, 0.95), (32, 0.50), (32, 0.20)]
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("WARNING", "out of memory at batch 64: the batch size shrinks at the next epoch") in messages
    assert ("INFO", f"epoch 2: peak 95% {cap} > 85% → batch 128 → 64 (shrink)") in messages


def test_a_peak_at_exactly_the_target_holds():
    c = BatchSizeController(8, 1024, target_fraction=0.5, probe=ScriptedProbe([0.5, 0.2]))
    c.attach(64)
    assert run(c, 2) == [64, 64]  # 0.5 is not over 0.5; growing would predict 1.0
    assert c.history[0]["decision"] == "hold" and c.ceiling is None
    edge = BatchSizeController(8, 1024, target_fraction=0.5, hysteresis=0.1, probe=ScriptedProbe([0.2]))
    edge.attach(64)
    edge.end_epoch(0)  # predicted 0.4 at 128: exactly target - hysteresis is not below it
    assert edge.history[0]["decision"] == "hold"
    assert edge.history[0]["reason"] == "peak 20% of 80 GiB, predicted 40% at 128 too close to 50%"


def test_a_shrink_below_min_or_growth_past_max_says_so():
    c = BatchSizeController(32, 64, probe=ScriptedProbe([0.95]))
    c.attach(32)
    c.end_epoch(0)
    assert c.history[0]["decision"] == "hold" and c.history[0]["reason"].endswith("> 85% (already at min_batch)")
    d = BatchSizeController(8, 15, multiple_of=8, probe=ScriptedProbe([0.1]))
    d.attach(8)
    d.end_epoch(0)
    assert d.batch_size == 8 and d.history[0]["reason"] == "peak 10% of 80 GiB; at max_batch 15"


def test_rounding_to_multiples_within_the_range():
    odd = BatchSizeController(5, 7, multiple_of=8, probe=ScriptedProbe([0.95]))  # no multiple of 8 inside
    odd.attach(7)
    odd.end_epoch(0)
    assert odd.batch_size == 5
    tight = BatchSizeController(5, 8, multiple_of=8, probe=ScriptedProbe([0.95]))  # only 8 inside
    tight.attach(8)
    tight.end_epoch(0)
    assert tight.batch_size == 8 and tight.history[0]["reason"].endswith("(already at max_batch)")
    ones = BatchSizeController(1, 100, multiple_of=1, probe=ScriptedProbe([0.95, 0.95]))
    ones.attach(3)
    assert run(ones, 2) == [3, 1]


def test_prediction_from_two_or_more_batch_sizes():
    c = BatchSizeController(8, 4096, probe=ScriptedProbe([]))
    assert c.predict(64) is None
    c.observations = [(64, 0.30), (128, 0.50)]  # fixed 0.10 + 0.003125 per sample
    assert c.predict(256) == pytest.approx(0.90)
    c.observations = [(64, 0.30), (128, 0.30)]  # flat: no slope to trust; the cautious guess from the last
    assert c.predict(256) == pytest.approx(0.60)
    c.observations = [(64, 0.30), (128, 0.30), (256, 0.90)]
    assert c.predict(512) == pytest.approx(12 / 7)  # least squares: 0.0 + 0.5 / 149.33 per sample


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"min_batch": 0, "max_batch": 8}, "min_batch=0, max_batch=8: need 1 <= min_batch <= max_batch"),
        ({"min_batch": 9, "max_batch": 8}, "min_batch=9, max_batch=8: need 1 <= min_batch <= max_batch"),
        ({"target_fraction": 0.0}, "target_fraction=0.0: must be in (0, 1]"),
        ({"target_fraction": 1.01}, "target_fraction=1.01: must be in (0, 1]"),
        ({"grow": 1.0}, "grow=1.0, shrink=0.5: need grow > 1 and 0 < shrink < 1"),
        ({"shrink": 0.0}, "grow=2.0, shrink=0.0: need grow > 1 and 0 < shrink < 1"),
        ({"shrink": 1.0}, "grow=2.0, shrink=1.0: need grow > 1 and 0 < shrink < 1"),
        ({"multiple_of": 0}, "multiple_of=0: must be >= 1"),
    ],
)
def test_bad_arguments_exact_message(kw, message):
    kw = {"min_batch": 8, "max_batch": 64, **kw}
    with pytest.raises(ValueError) as e:
        BatchSizeController(**kw)
    assert str(e.value) == message


def test_edge_arguments_accepted():
    for kw in ({"min_batch": 1, "max_batch": 1}, {"target_fraction": 1.0}, {"grow": 1.01, "shrink": 0.99}):
        c = BatchSizeController(**{"min_batch": 8, "max_batch": 64, **kw})
        assert c.batch_size == c.min_batch  # starts at min_batch until attached


def test_ranks_are_asked_to_agree_unless_told_not_to(monkeypatch):
    import dali_fast.loaders.controller as ctl

    asked = []

    def agree(frac, oom):
        asked.append((frac, oom))
        return 0.95, True  # another rank went over and ran out of memory

    monkeypatch.setattr(ctl, "agree_across_ranks", agree)
    c = BatchSizeController(8, 256, probe=ScriptedProbe([0.1]))
    c.attach(64)
    c.end_epoch(0)
    assert asked == [(0.1, False)] and c.batch_size == 32  # the worst rank decides
    alone = BatchSizeController(8, 256, probe=ScriptedProbe([0.1]), sync_ranks=False)
    alone.attach(64)
    alone.end_epoch(0)
    assert len(asked) == 1 and alone.batch_size == 128


def test_state_round_trip_and_minimal_state():
    c = BatchSizeController(8, 256, probe=ScriptedProbe([0.95, 0.1]))
    c.attach(128)
    run(c, 2)
    state = c.state_dict()
    assert state == {"batch_size": 64, "history": c.history, "observations": [(128, 0.95), (64, 0.1)], "ceiling": 128}
    d = BatchSizeController(8, 256, probe=ScriptedProbe([]))
    d.load_state_dict(state)
    assert (d.batch_size, d.history, d.observations, d.ceiling) == (64, c.history, c.observations, 128)
    assert d.predict(64) == c.predict(64)
    e = BatchSizeController(8, 256, probe=ScriptedProbe([]))
    e.load_state_dict({"batch_size": 16})
    assert (e.batch_size, e.history, e.observations, e.ceiling) == (16, [], [], None)


class CachingAllocatorProbe:
    """Models a GPU reading under a caching allocator: what the epoch needed, or more if the cache still
    holds an earlier epoch's larger blocks; the cache empties only when `release()` is called."""

    name = "caching"
    capacity_bytes = 80 * 2**30

    def __init__(self, need):
        self.need = need
        self.controller = None
        self.cached = 0.0
        self.releases = 0

    def release(self):
        self.cached = 0.0
        self.releases += 1

    def reset_peak(self):
        pass

    def peak_fraction(self):
        reading = max(self.need(self.controller.batch_size), self.cached)
        self.cached = reading  # freed blocks stay cached
        return reading


def _settle(release_calls: bool) -> list[int]:
    # Fits up to 96 samples; past that a larger workspace (another convolution algorithm) goes over.
    probe = CachingAllocatorProbe(lambda b: 0.05 + 0.003 * b + (0.5 if b > 96 else 0.0))
    c = BatchSizeController(8, 1024, probe=probe, release=probe.release if release_calls else None)
    probe.controller = c
    c.attach(32)
    return run(c, 8)


def test_controller_settles_under_a_caching_allocator_when_caches_are_released():
    sizes = _settle(release_calls=True)
    assert sizes[:4] == [32, 64, 128, 64]  # grow, grow, overshoot, shrink
    assert all(64 <= b <= 96 for b in sizes[3:]), sizes  # and it stays there, not at min_batch
    assert _settle(release_calls=False)[-1] == 8  # the bug this guards against: a stale cache only shrinks


def test_default_release_empties_torch_and_dali_caches(monkeypatch):
    import sys
    import types

    from dali_fast.loaders import memory_probes as probes

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("torch"))
    fake_backend = types.SimpleNamespace(ReleaseUnusedMemory=lambda: calls.append("dali"))
    fake_dali = types.ModuleType("nvidia.dali")
    fake_dali.backend = fake_backend
    monkeypatch.setitem(sys.modules, "nvidia.dali", fake_dali)
    monkeypatch.setitem(sys.modules, "nvidia.dali.backend", fake_backend)
    probe = ScriptedProbe([0.1])
    c = BatchSizeController(8, 64, probe=probe)
    c.begin_epoch()
    assert calls == ["torch", "dali"] and probe.resets == 1  # released before the peak is reset
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probes.release_unused_memory()
    assert calls == ["torch", "dali"]  # nothing to release without CUDA


class _FakeCuda:
    """torch.cuda at its boundary on a GPU whose DALI pipeline holds memory torch's allocator does not
    know: 60 of 80 GiB used device-wide, 2 GiB of it reserved by torch."""

    total, used, reserved = 80 * 2**30, 60 * 2**30, 2 * 2**30

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": self.total})()
        )
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.used, self.total))


def test_without_nvml_the_default_probe_still_sees_dali_s_memory(monkeypatch):
    """A container without the driver's `utility` capability has no NVML, and a MIG slice has no
    `GPU-` UUID: torch's allocator alone would read 2 of 80 GiB and let the batch grow until DALI runs
    out of memory. The device-wide reading (torch.cuda.mem_get_info) sees the 60 GiB."""
    import sys
    import types

    broken = types.ModuleType("pynvml")

    def no_library():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    _FakeCuda().install(monkeypatch)
    from dali_fast.loaders.memory_probes import default_probe

    probe = default_probe()
    probe.reset_peak()
    assert probe.peak_fraction() == pytest.approx(0.75)
    assert probe.capacity_bytes == 80 * 2**30
    c = BatchSizeController(64, 512, probe=probe, release=None, sync_ranks=False)
    c.attach(256)
    c.begin_epoch()
    assert c.end_epoch(0) == 256  # 75 % now, 150 % predicted at 512: held, not grown
