"""This process's place in a job: `distributed_context` joins torchrun's process group (nccl on GPUs, gloo
on CPUs) and names the rank, world size and CUDA device; `gather` and `broadcast` move small objects."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..machine import cuda_usable, local_device_index


@dataclass(frozen=True)
class DistContext:
    """This process's place in a job: rank ``rank`` of ``world_size``, local rank ``local_rank``, driving
    CUDA device ``device_index`` (``local_rank``, or ``local_rank % device_count()`` where the launcher
    shows each process fewer GPUs than there are local ranks)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device_index: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@contextlib.contextmanager
def distributed_context(timeout_s: float = 1800) -> Iterator[DistContext]:
    """This process's `DistContext`, joining torchrun's process group when started with WORLD_SIZE > 1
    (nccl on GPUs, gloo on CPUs) and leaving it on exit; a group made by the caller is used and kept.

    Each process drives the GPU `local_device_index` gives (``LOCAL_RANK``, modulo the visible devices
    when a launcher such as SLURM shows each process its own); outside torchrun it is a single process.
    """
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    device = local_device_index() if cuda_usable() else 0
    if dist.is_available() and dist.is_initialized():
        yield DistContext(dist.get_rank(), dist.get_world_size(), local, str(dist.get_backend()), device)
        return
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        yield DistContext(local_rank=local, device_index=device)
        return
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
    if cuda_usable():
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield DistContext(dist.get_rank(), dist.get_world_size(), local, backend, device)
    finally:
        dist.destroy_process_group()


def gather(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank (so only rank 0 needs to see the checkpoint folder)."""
    if not ctx.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
