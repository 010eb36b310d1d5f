"""A loader's place among ranks: where its rank and world size come from (`dist_rank_world`, and
`sharding_note` when the sources disagree), and its order as a `torch.utils.data.Sampler`
(`LoaderSampler`, what frameworks read). The orders themselves are `loaders.order`'s."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

log = logging.getLogger(__name__)


def _env_rank_world() -> tuple[int, int] | None:
    """What the launcher says (torchrun's ``RANK``/``WORLD_SIZE``), when it says anything."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _framework_rank_world() -> tuple[int, int, str] | None:
    """(rank, world_size, who) of the processes the training framework really runs: the initialised
    torch.distributed process group, else, when an Accelerate ``Accelerator`` was made without starting
    one, Accelerate's own count (one process: it synchronises nothing); None when neither says."""
    import torch.distributed as dist  # torch is imported here already (Sampler)

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), "torch.distributed"
    state_module = sys.modules.get("accelerate.state")  # only when the user imported Accelerate
    shared = getattr(getattr(state_module, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and "num_processes" in shared and "process_index" in shared:
        return int(shared["process_index"]), int(shared["num_processes"]), "Accelerate"
    return None


def dist_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values, else the process group the framework really uses (the
    initialised torch.distributed group; else Accelerate's processes when it runs without one), else
    ``RANK``/``WORLD_SIZE``, else 0/1. `sharding_note` says when these sources disagree."""
    if rank is None or world_size is None:
        found = _framework_rank_world()
        r, w = found[:2] if found is not None else (_env_rank_world() or (0, 1))
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, {world_size}) for world_size={world_size}")
    return rank, world_size


def sharding_note(rank: int | None = None, world_size: int | None = None) -> str | None:
    """One line when the launcher's ``RANK``/``WORLD_SIZE`` and what `dist_rank_world` shards by disagree
    (None when they agree, or when both ``rank`` and ``world_size`` are given): a process group of another
    shape, Accelerate running each process alone, or no process group at all while the launcher says
    several ranks (each process then trains on its shard with nothing synchronising the ranks). With no
    ``RANK``, a group of ``WORLD_SIZE`` ranks agrees."""
    if rank is not None and world_size is not None:
        return None
    env, found = _env_rank_world(), _framework_rank_world()
    if found is not None:
        r, w, who = found
        if env is None or env == (r, w) or ("RANK" not in os.environ and env[1] == w):
            return None  # Lightning's launcher gives the ranks it starts WORLD_SIZE, not RANK
        said = f"RANK/WORLD_SIZE say rank {env[0]} of {env[1]}, but {who} runs this process as rank {r} of {w}"
        if who == "torch.distributed":
            return f"{said}: sharding by the process group"
        return (
            f"{said} (no torch.distributed process group, so nothing synchronises the processes): sharding as "
            f"rank {r} of {w}, so each process reads all the data; on CPUs, make the Accelerator with cpu=True "
            "for distributed training"
        )
    if env is not None and env[1] > 1:
        return (
            f"RANK/WORLD_SIZE say rank {env[0]} of {env[1]}, but no torch.distributed process group is "
            f"initialised: sharding by them, so this process reads 1/{env[1]} of the data and nothing "
            "synchronises the processes; start the process group before the first pass, or pass "
            "rank=0, world_size=1 to read all of it"
        )
    return None


class LoaderSampler(Sampler[int]):
    """A loader's order as a `torch.utils.data.Sampler`: iterates this rank's shard of the current epoch;
    ``set_epoch`` is the loader's (safe to call from a framework)."""

    def __init__(self, loader: Any) -> None:  # a LoaderBase
        self.loader = loader

    @property
    def shuffle(self) -> bool:
        return self.loader.order.shuffle

    @property
    def epoch(self) -> int:
        return self.loader.order.epoch

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.loader.order.indices().tolist())

    def __len__(self) -> int:
        return len(self.loader.order)
