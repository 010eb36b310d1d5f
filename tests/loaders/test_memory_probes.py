"""Memory probes: real readings (NVML, the device, torch's allocator, RSS) against fakes at their boundary."""

from __future__ import annotations

import os

import pytest
import torch
from fakes import ScriptedProbe

from dali_fast.loaders.memory_probes import DeviceMemoryProbe, HostProbe, MaxProbe, NvmlProbe, TorchCudaProbe


def test_nvml_probe_reads_fake_handles(monkeypatch):
    # The fake NVML knows indices only: look devices up as where torch reports no UUID (on a CUDA host
    # torch would report the real GPU's, which the fake does not know).
    monkeypatch.setattr("dali_fast.machine.cuda_device_uuid", lambda i: None)

    class Mem:
        def __init__(self, used, total):
            self.used, self.total = used, total

    class FakeNvml:
        def __init__(self):
            self.used = [10, 30, 70, 20]

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByIndex(self, i):
            return ("handle", i)

        def nvmlDeviceGetMemoryInfo(self, handle):
            return Mem(self.used.pop(0) if len(self.used) > 1 else self.used[0], 100)

    probe = NvmlProbe(device_index=1, interval=0.01, nvml=FakeNvml())
    assert probe.capacity_bytes == 100
    probe.reset_peak()
    import time

    time.sleep(0.1)
    assert probe.peak_fraction() == pytest.approx(0.70)


def test_torch_probe_without_cuda_cannot_read():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    p = TorchCudaProbe()
    p.reset_peak()
    assert p.peak_fraction() is None


def test_max_probe():
    p = MaxProbe([ScriptedProbe([0.3]), ScriptedProbe([None]), ScriptedProbe([0.5])])
    p.reset_peak()
    assert p.peak_fraction() == 0.5
    assert MaxProbe([ScriptedProbe([None])]).peak_fraction() is None


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_host_probe_reads_real_numbers():
    p = HostProbe(interval=0.01)
    p.reset_peak()
    block = bytearray(200 * 2**20)  # touch 200 MiB
    block[::4096] = b"x" * len(block[::4096])
    frac = p.peak_fraction()
    del block
    assert p.capacity_bytes > 200 * 2**20
    assert frac is not None and 200 * 2**20 / p.capacity_bytes <= frac < 1


@pytest.mark.gpu
def test_real_gpu_probes_read():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for probe in (NvmlProbe(0), DeviceMemoryProbe(0), TorchCudaProbe(0)):
        probe.reset_peak()
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        frac = probe.peak_fraction()
        del x
        assert probe.capacity_bytes > 2**30 and frac is not None and 0 < frac < 1


def test_device_memory_probe_samples_the_epoch_s_peak():
    readings = iter([10, 70, 40] + [40] * 1000)  # used GiB, as (free, total) readings go
    probe = DeviceMemoryProbe(0, interval=0.01, mem_get_info=lambda d: (2**30 * (100 - next(readings)), 100 * 2**30))
    assert probe.capacity_bytes == 100 * 2**30 and probe.name == "cuda.mem_get_info"
    probe.reset_peak()
    import time

    time.sleep(0.05)
    assert probe.peak_fraction() == pytest.approx(0.70)

    def broken(d):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dead = DeviceMemoryProbe(0, mem_get_info=broken)
    dead.reset_peak()
    assert dead.capacity_bytes is None and dead.peak_fraction() is None


@pytest.mark.gpu
def test_gpu_release_lets_the_reading_fall_after_a_larger_epoch():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dali_fast.loaders.memory_probes import release_unused_memory

    probe = TorchCudaProbe(torch.cuda.current_device())
    probe.reset_peak()
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    del big
    large = probe.peak_fraction()
    release_unused_memory()
    probe.reset_peak()
    small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    del small
    assert probe.peak_fraction() < large / 10  # the cached 2 GiB no longer counts
