import logging
import os
import subprocess
import sys

import pytest
import torch

from dali_fast.files import atomic_dir, atomic_write, clean_stale, default_cache_dir
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


def test_atomic_write_never_exposes_a_partial_file(tmp_path):
    path = tmp_path / "sub" / "state.bin"
    atomic_write(path, lambda f: f.write(b"old contents"))
    seen_during_write = []

    def write(f):
        f.write(b"new ")
        f.flush()
        seen_during_write.append(path.read_bytes())  # a reader in the middle of the write
        f.write(b"contents")

    atomic_write(path, write, durable=True)
    assert seen_during_write == [b"old contents"]
    assert path.read_bytes() == b"new contents"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.bin"]


def test_atomic_write_failure_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


def test_atomic_write_removes_temporaries_of_dead_writers_only(tmp_path):
    path = tmp_path / "state.bin"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = tmp_path / f".state.bin.{int(dead.stdout)}.tmp"
    live_tmp = tmp_path / f".state.bin.{os.getppid()}.tmp"  # a writer that is still running
    dead_tmp.write_bytes(b"partial")
    live_tmp.write_bytes(b"in progress")
    atomic_write(path, lambda f: f.write(b"x"))
    assert not dead_tmp.exists() and live_tmp.exists()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def test_atomic_dir_shows_the_folder_only_when_complete(tmp_path):
    dst = tmp_path / "out"
    with atomic_dir(dst) as tmp:
        (tmp / "a").write_bytes(b"1")
        assert not dst.exists() and tmp.parent == tmp_path and tmp.name.startswith(".out.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (dst / "a").read_bytes() == b"1"
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty) as tmp:  # an empty folder is replaced
        (tmp / "b").write_bytes(b"2")
    assert (empty / "b").read_bytes() == b"2"


def test_a_failing_atomic_dir_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="disk full"), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_bytes(b"half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_appearing_meanwhile_is_named_and_kept(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(FileExistsError) as e, atomic_dir(dst, doing="packing", what="pack") as tmp:
        (tmp / "mine").write_bytes(b"1")
        dst.mkdir()
        (dst / "theirs").write_bytes(b"2")
    assert str(e.value) == f"{dst}: appeared while packing (another pack to the same place?); this pack is discarded"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and sorted(p.name for p in dst.iterdir()) == ["theirs"]


def test_clean_stale_removes_dead_runs_files_and_folders_only(tmp_path):
    dst, dead = tmp_path / "set", _dead_pid()
    left = [tmp_path / f".set.{dead}.tmp", tmp_path / f".set.{dead}-0a1b.tmp"]
    kept = [tmp_path / f".set.{os.getppid()}-0a1b.tmp", tmp_path / f".set.{os.getpid()}.tmp", tmp_path / ".set.x.tmp"]
    left[0].write_bytes(b"partial")
    left[1].mkdir()
    (left[1] / "data.bin").write_bytes(b"partial")
    for p in kept:
        p.mkdir()
    other = tmp_path / f".settings.{dead}.tmp"  # another path's temporary
    other.write_bytes(b"x")
    clean_stale(dst)
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept) and other.exists()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DALI_FAST_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DALI_FAST_CACHE")
    assert str(default_cache_dir()).endswith(".cache/dali_fast")


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
