"""``bench --ranks N`` and bench under torchrun: every row runs as N ranks of a ``torch.distributed``
group (gloo), each rank loading its shard, and after every step the ranks wait for each other as DDP's
gradient all-reduce makes them, so a step lasts as long as the slowest rank's. Rank 0 merges the ranks'
figures into one row.

``--ranks N`` starts N processes on this machine (the calling process only waits); under
``torchrun --nproc-per-node N -m dali_fast bench ...`` the launcher's processes are the ranks.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(minutes=10)  # a rank that died without a word ends the others' wait


class RankFailed(RuntimeError):
    """Another rank's row failed: this rank's row stops too, at the same step."""


def launched() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (torchrun) started this process as one of several ranks."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return (rank, world) if world > 1 else None


def current() -> tuple[int, int] | None:
    """(rank, world size) of the initialised process group of several ranks, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def join_launched() -> tuple[int, int]:
    """Start the gloo group of a torchrun launch (MASTER_ADDR and the rest from its environment)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


class StepSync:
    """What DDP's all-reduce does to a step's time: each rank waits until every rank has finished the
    step. It carries one flag: a rank whose row failed says so (`fail`), and the others raise `RankFailed`
    at that step instead of waiting for steps that will never come."""

    def __init__(self) -> None:
        self.failed_elsewhere = False

    def __call__(self) -> None:
        import torch.distributed as dist

        flag = torch.zeros(1)
        dist.all_reduce(flag)
        if flag.item() > 0:
            self.failed_elsewhere = True
            raise RankFailed("another rank's row failed at this step")

    def fail(self) -> None:
        """This rank's row failed: tell the others at their next step (unless they told this one)."""
        import torch.distributed as dist

        if not self.failed_elsewhere:
            dist.all_reduce(torch.ones(1))
        self.failed_elsewhere = False


def shard(n: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s share of ``n`` records, every ``world``-th, padded by repeats to the same length on
    every rank (as `DistributedSampler` pads), so every rank runs the same number of steps."""
    padded = -(-n // world) * world
    order = [i % n for i in range(padded)]
    return order[rank::world]


def barrier() -> None:
    """Wait until every rank is here."""
    import torch.distributed as dist

    dist.barrier()


def gather(value: Any) -> list[Any] | None:
    """Every rank's ``value`` on rank 0 (in rank order); None on the other ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _max_by_step(per_rank: Sequence[list[list[float]]]) -> list[list[float]]:
    """Each epoch's step times, each the slowest rank's."""
    epochs = min(len(r) for r in per_rank)
    return [[max(steps) for steps in zip(*(r[e] for r in per_rank), strict=False)] for e in range(epochs)]


def merge(rows: Sequence[dict[str, Any]], tails: Callable[[list[list[float]]], dict[str, Any]]) -> dict[str, Any]:
    """One row from each rank's figures of it: images summed, each epoch as long as its slowest rank,
    each step's time the slowest rank's (then ``tails`` of those), memory per rank (the largest shown),
    CPU utilization summed over the ranks' process trees (GPU: their mean), cache counts summed."""
    failed = [(k, r) for k, r in enumerate(rows) if "error" in r]
    if failed:
        own = [(k, r) for k, r in failed if not r["error"].startswith("RankFailed")] or failed
        k, r = own[0]
        return {**r, "error": f"rank {k}: {r['error']}"}
    out = dict(rows[0])
    times = [max(ts) for ts in zip(*(r["epoch_times"] for r in rows), strict=True)]
    counts = [sum(cs) for cs in zip(*(r["epoch_counts"] for r in rows), strict=True)]
    out.update(epoch_times=times, epoch_counts=counts, img_per_s=sum(counts) / sum(times))
    out.update(epoch_s=sum(times) / len(times), images_per_epoch=counts[0])
    out.update(tails(_max_by_step([r["batch_times"] for r in rows])))
    out["batch_times_by_rank"] = [r["batch_times"] for r in rows]
    pss = [r.get("pss_peak_bytes") for r in rows]
    out["pss_peak_bytes_by_rank"] = pss
    out["pss_peak_bytes"] = max((p for p in pss if p is not None), default=None)
    utils = [r["util_mean"] for r in rows if isinstance(r.get("util_mean"), float)]
    if utils:
        out["util_mean"] = min(100.0, sum(utils)) if out["util_kind"] == "cpu" else sum(utils) / len(utils)
    caches = [r.get("cache") for r in rows]
    if all(c is not None for c in caches):
        hits, misses = sum(c["hits"] for c in caches), sum(c["misses"] for c in caches)
        out["cache"] = {**caches[0], "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses or 1)}
    out["ranks"] = len(rows)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    import multiprocessing

    import torch.distributed as dist

    # A spawned process inherits "spawn" as its default start method, and DataLoader workers would then be
    # fresh interpreters, each with its own copy of torch; a training script's workers are forked (the
    # platform's default), sharing the main process's pages. Back to the default, as a user's process has.
    multiprocessing.set_start_method(None, force=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"rank {rank}: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        target(**{**kwargs, "progress": bool(kwargs.get("progress")) and rank == 0})
    finally:
        dist.destroy_process_group()


def spawn(world: int, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Run ``target(**kwargs)`` as ``world`` ranks of a gloo group on this machine, each a fresh process;
    this process waits. A rank's error comes back as a RuntimeError with that rank's last line."""
    import torch.multiprocessing as mp

    port = _free_port()
    try:
        mp.start_processes(_rank_main, (world, port, target, kwargs), nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        lines = [x for x in str(e).splitlines() if x.strip()]
        raise RuntimeError(f"a bench rank failed: {lines[-1].strip() if lines else e}") from None
    except mp.ProcessExitedException as e:
        raise RuntimeError(f"a bench rank exited: {e}") from None
