"""This process's place in a job: `distributed_context` joins torchrun's process group (nccl on GPUs, gloo
on CPUs) and names the rank, world size and CUDA device; `gather` and `broadcast` move small objects;
`gather_outputs` collects every rank's per-sample outputs in data set order (exact distributed metrics)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
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
    timeout = timedelta(seconds=timeout_s)
    store = restart_store(timeout)
    dist.init_process_group(backend, timeout=timeout, **({} if store is None else {"store": store, **_ranks()}))
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


def gather_outputs(outputs: torch.Tensor, indices: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Every rank's per-sample ``outputs``, one row per data set index, in data set order, on every rank.

    Call it on every rank after an evaluation pass, with the rows this rank computed and the data set
    index of each (``loader.last_indices`` after each batch, concatenated). Ranks may hold different
    numbers of rows (an evaluation loader repeats no sample, so ranks differ by one): each rank's rows
    are padded to the longest, gathered (``all_gather``, on gloo or nccl, on the device the outputs are
    on) and trimmed. A sample that came twice (the padding of a loader with ``even=True``) is kept once,
    so a metric over the result (accuracy, mean average precision, AUC) equals the one-process number.
    Without a process group (or with one rank), the rows are only put in order.

    Args:
        outputs: ``(N, ...)`` this rank's rows (logits, scores, targets...); the trailing shape and dtype
            the same on every rank.
        indices: the ``N`` data set indices of the rows.

    Returns:
        ``(M, ...)``: the rows of every rank, sorted by data set index, each index once. Ranks whose rows
        differ in dtype or trailing shape all raise the same one-line `ValueError` (none is left waiting).
    """
    import torch.distributed as dist

    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64) if not torch.is_tensor(indices) else indices)
    idx = idx.to(device=outputs.device, dtype=torch.int64).reshape(-1)
    if len(idx) != len(outputs):
        raise ValueError(f"{len(outputs)} rows of outputs but {len(idx)} indices: give the data set index of each row")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shapes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shapes, (len(idx), str(outputs.dtype), tuple(outputs.shape[1:])))
        if len({s[1:] for s in shapes}) > 1:  # every rank sees the same list: every rank raises, none hangs
            said = ", ".join(f"rank {r}: {d} {list(t)}" for r, (_, d, t) in enumerate(shapes))
            raise ValueError(
                f"gather_outputs: the ranks' rows differ in dtype or shape ({said}); give every rank the same kind of rows"
            )
        sizes = [s[0] for s in shapes]
        boolean = outputs.dtype == torch.bool  # gathered as bytes: not every backend moves bools
        rows = outputs.to(torch.uint8) if boolean else outputs
        pad = max(sizes) - len(idx)
        rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))]).contiguous()
        padded_idx = torch.cat([idx, idx.new_full((pad,), -1)])
        all_rows = [torch.empty_like(rows) for _ in sizes]
        all_idx = [torch.empty_like(padded_idx) for _ in sizes]
        dist.all_gather(all_rows, rows)
        dist.all_gather(all_idx, padded_idx)
        outputs = torch.cat([r[:k] for r, k in zip(all_rows, sizes, strict=True)])
        outputs = outputs.bool() if boolean else outputs
        idx = torch.cat([i[:k] for i, k in zip(all_idx, sizes, strict=True)])
    order = torch.argsort(idx, stable=True)
    idx, outputs = idx[order], outputs[order]
    first = torch.ones(len(idx), dtype=torch.bool, device=idx.device)
    first[1:] = idx[1:] != idx[:-1]
    return outputs[first]


def restart_store(timeout: timedelta) -> Any:
    """The store a group restarted by torchrun's elastic agent (``--max-restarts``) joins through: the agent's
    own, which it keeps from one start of the group to the next, under a prefix of this start's count
    (``TORCHELASTIC_RESTART_COUNT``). Without one, a restarted rank could read the address a rank of the
    failed start had published there and fail to connect to it (pytorch/pytorch#135712: the restarted
    group never formed); None outside a restart of such a group (the default ``env://`` is used)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or count in ("", "0"):
        return None
    import torch.distributed as dist

    rank, world = _ranks().values()
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    return dist.PrefixStore(f"dali_fast/start{count}", store)  # keys "dali_fast/start1/default_pg/..."


def _ranks() -> dict[str, int]:
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}

