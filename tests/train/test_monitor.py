import subprocess
import sys
import time

from dali_fast.train.monitor import UtilizationMonitor


def test_cpu_monitor_samples_phases_and_stops():
    mon = UtilizationMonitor(interval=0.02, gpu=False)
    assert mon.kind == "cpu"
    with mon:
        with mon.phase("busy"):  # a child process burns a core: the process tree's CPU counts it
            child = subprocess.Popen(
                [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.6: pass"]
            )
            child.wait()
        with mon.phase("idle"):
            time.sleep(0.4)
    assert mon._thread is None  # stopped
    busy, idle = mon.summary("busy"), mon.summary("idle")
    assert busy["samples"] >= 5 and idle["samples"] >= 5
    assert 0 <= idle["mean"] < busy["mean"] <= 100
    assert busy["p50"] <= busy["p95"] and busy["peak_mem"] > 0
    assert mon.summary("never")["mean"] == "n/a"


def test_missing_nvml_does_not_crash(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_pynvml(name, *a, **k):
        if name == "pynvml":
            raise ImportError("no pynvml")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    mon = UtilizationMonitor(interval=0.02)
    assert mon.kind == "cpu"
    with mon, mon.phase("x"):
        time.sleep(0.1)
    assert mon.summary("x")["kind"] == "cpu"


def test_a_phase_shorter_than_the_interval_still_has_a_figure():
    mon = UtilizationMonitor(interval=5.0, gpu=False)
    with mon:
        for k in range(3):
            with mon.phase(f"epoch{k}"):
                t = time.perf_counter()
                while time.perf_counter() - t < 0.05:
                    pass
    for k in range(3):
        s = mon.summary(f"epoch{k}")
        assert s["samples"] == 1 and 0 < s["mean"] <= 100, s


class OneGpuNvml:
    """NVML at its boundary: one GPU shared with another process."""

    def __init__(self, per_process=True):
        self.per_process = per_process

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 87})()

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": 100 * 2**30, "total": 141 * 2**30})()

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        import os

        if not self.per_process:
            raise RuntimeError("Not Supported")
        P = type("P", (), {})
        mine, other = P(), P()
        mine.pid, mine.usedGpuMemory = os.getpid(), 7 * 2**30  # torch + DALI's pool + outputs
        other.pid, other.usedGpuMemory = os.getpid() + 1, 93 * 2**30
        return [mine, other]


def test_gpu_memory_is_this_process_s_as_nvml_sees_it(monkeypatch):
    # The fake NVML knows indices only: look devices up as where torch reports no UUID (on a CUDA host
    # torch would report the real GPU's, which the fake does not know).
    monkeypatch.setattr("dali_fast.machine.cuda_device_uuid", lambda i: None)
    mon = UtilizationMonitor(interval=5.0, nvml=OneGpuNvml())
    assert mon.kind == "gpu"
    with mon, mon.phase("epoch0"):
        pass
    s = mon.summary("epoch0")
    assert s["mean"] == 87 and s["peak_mem"] == 7 * 2**30  # not the other process's 93 GiB
    fallback = UtilizationMonitor(interval=5.0, nvml=OneGpuNvml(per_process=False))
    with fallback, fallback.phase("e"):
        pass
    assert fallback.summary("e")["peak_mem"] == 100 * 2**30  # no per-process figures: the device's
