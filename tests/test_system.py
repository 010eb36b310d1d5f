from dali_fast.system import available_cpus, cpus_per_local_rank, read_proc_kib


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
