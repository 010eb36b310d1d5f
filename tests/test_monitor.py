import subprocess
import sys
import time

from dali_fast.monitor import UtilizationMonitor


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
