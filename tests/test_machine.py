"""The machine's readings (`dali_fast.machine`): CPUs per local rank, /proc, which GPU a process uses and
its NVML handle (fakes at NVML's boundary; the real device under `gpu`)."""

import logging

import pytest
import torch

from dali_fast.machine import available_cpus, cpus_per_local_rank, read_proc_kib


def test_cpus_are_shared_between_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpus_per_local_rank() == available_cpus()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(available_cpus() * 4))
    assert cpus_per_local_rank() == 1  # never zero
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpus_per_local_rank() == max(1, available_cpus() // 2)


def test_read_proc_kib(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert read_proc_kib(str(status), "VmRSS") == 1024
    assert read_proc_kib(str(status), "VmSwap") is None
    assert read_proc_kib(str(tmp_path / "missing"), "VmRSS") is None


class EightGpuNvml:
    """NVML at its boundary on an 8-GPU node: handles are NVML indices; UUIDs GPU-uuid-0 ... GPU-uuid-7."""

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return int(i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.rsplit("-", 1)[1])

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": 80 * 2**30, "used": (h + 1) * 2**30})()


def test_nvml_device_follows_cuda_visible_devices(monkeypatch):
    from dali_fast.loaders.memory_probes import NvmlProbe
    from dali_fast.machine import nvml_handle

    # The fake NVML knows indices only: look devices up as where torch reports no UUID (on a CUDA host
    # torch would report the real GPU's, which the fake does not know).
    monkeypatch.setattr("dali_fast.machine.cuda_device_uuid", lambda i: None)
    nvml = EightGpuNvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    assert nvml_handle(nvml, 1) == 6  # rank 1 (LOCAL_RANK=1, CUDA device 1) is NVML device 6
    assert nvml_handle(nvml, 0) == 5
    probe = NvmlProbe(1, nvml=nvml)
    assert probe._used() == 7 * 2**30  # noqa: SLF001 - it reads GPU 6, not GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-uuid-3,MIG-uuid-4")
    assert nvml_handle(nvml, 0) == 3 and nvml_handle(nvml, 1) == 4
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_handle(nvml, 2) == 2


def test_nvml_device_by_the_uuid_torch_reports(monkeypatch):
    import torch

    from dali_fast.machine import nvml_handle

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # would say index 1; the UUID is what counts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": f"uuid-{5 + i}"})())
    assert nvml_handle(EightGpuNvml(), 1) == 6


class MigNvml(EightGpuNvml):
    """NVML on a MIG slice: the slice answers only to its "MIG-<uuid>" and has no index of its own."""

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "MIG-4f8d1c2e-aaaa-bbbb-cccc-0123456789ab":
            raise type("NVMLError_NotFound", (Exception,), {})("Not Found")
        return "mig-slice"


def test_nvml_finds_a_mig_slice_by_its_mig_uuid(monkeypatch):
    import torch

    from dali_fast.machine import cuda_device_uuid, nvml_handle

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = type("P", (), {"uuid": "4f8d1c2e-aaaa-bbbb-cccc-0123456789ab"})()  # torch's spelling: no prefix
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert cuda_device_uuid(0) == "4f8d1c2e-aaaa-bbbb-cccc-0123456789ab"
    assert nvml_handle(MigNvml(), 0) == "mig-slice"
    props.uuid = "MIG-4f8d1c2e-aaaa-bbbb-cccc-0123456789ab"  # a torch that spells it as NVML does
    assert nvml_handle(MigNvml(), 0) == "mig-slice"


@pytest.mark.gpu
def test_gpu_nvml_handle_is_the_cuda_device():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import pynvml

    from dali_fast.machine import cuda_device_uuid, nvml_handle

    pynvml.nvmlInit()
    for i in range(torch.cuda.device_count()):
        uuid = pynvml.nvmlDeviceGetUUID(nvml_handle(pynvml, i))
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        assert uuid.split("-", 1) in (["GPU", cuda_device_uuid(i)], ["MIG", cuda_device_uuid(i)])


def test_local_rank_picks_the_gpu(monkeypatch):
    import dali_fast.machine as system

    monkeypatch.setattr(system, "cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert system.local_device_index() == 3  # torchrun's process on the node's fourth GPU → DALI device_id 3


def test_one_visible_gpu_per_process_is_device_0_whatever_the_local_rank(monkeypatch, caplog):
    """SLURM's --gpus-per-task=1 (and other launchers) show each process only its own GPU through
    CUDA_VISIBLE_DEVICES: device LOCAL_RANK does not exist there ("invalid device ordinal")."""
    import dali_fast.machine as system

    monkeypatch.setattr(system, "cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(system, "_SAID", set())
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level(logging.INFO, logger="dali_fast.machine"):
        assert system.local_device_index() == 0
        assert system.local_device_index() == 0
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "LOCAL_RANK=3 of 4 local ranks sees 1 CUDA device(s) (the launcher set CUDA_VISIBLE_DEVICES per process): "
        "using CUDA device 0 (LOCAL_RANK % 1)"
    ]  # once, not per loader
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with caplog.at_level(logging.INFO, logger="dali_fast.machine"):
        assert system.local_device_index() == 1  # 4 ranks on 2 visible GPUs: they share, and the log warns
    assert (
        caplog.records[-1].levelno == logging.WARNING and "several ranks share a GPU" in caplog.records[-1].getMessage()
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert system.local_device_index() == 0  # no LOCAL_WORLD_SIZE: rank 3 still cannot be device 3 of 1


@pytest.mark.parametrize(
    "visible, remapped",
    [
        (None, False),
        ("", False),
        ("0", False),
        ("0,1,2,3", False),
        ("1", True),  # CUDA device 0 is NVML device 1
        ("4,5,6,7", True),
        ("1,0", True),
        ("GPU-8932f937-d72c", True),  # UUIDs: CUDA's numbering cannot be read as NVML's
    ],
)
def test_devices_are_remapped_when_cuda_visible_devices_renumbers_them(monkeypatch, visible, remapped):
    from dali_fast.machine import devices_remapped

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices_remapped() is remapped
