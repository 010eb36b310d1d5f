"""This process's place in a job: the rank, the world and the CUDA device a launcher gives it."""

from __future__ import annotations

import torch


def test_each_rank_drives_a_visible_gpu_when_the_launcher_shows_it_only_its_own(monkeypatch):
    """SLURM --gpus-per-task=1: WORLD_SIZE=2, LOCAL_RANK=1, one visible GPU. Device 1 does not exist."""
    import torch.distributed as dist

    import dali_fast.machine as system
    import dali_fast.train.distributed as distributed

    monkeypatch.setattr(system, "cuda_usable", lambda: True)  # what local_device_index asks
    monkeypatch.setattr(distributed, "cuda_usable", lambda: True)  # what distributed_context asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: chosen.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with distributed.distributed_context() as ctx:
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.device_index) == (1, 2, 1, 0)
    assert chosen == [0, "nccl"]
