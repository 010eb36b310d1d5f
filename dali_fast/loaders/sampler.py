"""Per-epoch sample order, sharded across ranks, with a resumable (also elastic) cursor (`EpochSampler`);
where the rank and world size come from (`dist_rank_world`); and a loader's order as a
`torch.utils.data.Sampler` (`LoaderSampler`, what frameworks read)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .order import OrderCursor, per_rank

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
    several ranks (each process then trains on its shard with nothing synchronising the ranks)."""
    if rank is not None and world_size is not None:
        return None
    env, found = _env_rank_world(), _framework_rank_world()
    if found is not None:
        r, w, who = found
        if env is None or env == (r, w):
            return None
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


def ranks_for(n: int, rank: int | None, world_size: int | None, drop_last: bool) -> tuple[int, int]:
    """(rank, world size) of an order over ``n`` samples (`dist_rank_world`), refused in one line when
    ``drop_last`` would leave a rank without a sample."""
    rank, world_size = dist_rank_world(rank, world_size)
    if drop_last and n < world_size:
        raise ValueError(
            f"{n} samples cannot give each of {world_size} ranks one with drop_last=True; "
            "use drop_last=False or fewer ranks"
        )
    return rank, world_size


class EpochSampler(OrderCursor):
    """The order of one rank's samples for each epoch, and a cursor into it.

    The epoch's order is a permutation drawn from ``(seed, epoch)``, the same on every rank; rank ``r``
    takes every ``world_size``-th sample from position ``r``. Shards are disjoint. With ``even`` (the
    default; what training needs, so that DDP's ranks take the same number of steps) they are of equal
    length: without ``drop_last`` the permutation is padded by wrapping around to its first samples (at most
    ``world_size - 1`` samples appear twice in the epoch, as with torch's DistributedSampler); with
    ``drop_last`` the tail is cut instead. With ``even=False`` (evaluation) and no ``drop_last``, no sample
    is repeated: each is on exactly one rank, and the first ``n % world_size`` ranks have one more.

    A state saved by one rank of a lockstep run loads with another world size: each sample no rank had
    reached then comes once (`loaders.order` has the rule).

    Args:
        n: samples in the data set.
        seed: seeds the permutation, with the epoch.
        shuffle: permute (else the data set's order).
        rank: this rank (default: the process group's, see `dist_rank_world`).
        world_size: the number of ranks (default: the process group's).
        drop_last: cut the tail so that every rank has ``n // world_size`` samples.
        even: without ``drop_last``, give every rank the same count by padding; False: no repeats.

    >>> s = EpochSampler(10, seed=0, rank=1, world_size=2)
    >>> s.set_epoch(3); first = s.next_batch(4); rest = s.next_batch(100)
    >>> sorted(first.tolist() + rest.tolist()) == sorted(s.indices().tolist())
    True
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        even: bool = True,
    ) -> None:
        if n < 0:
            raise ValueError(f"n={n}: the number of samples must be >= 0")
        rank, world_size = ranks_for(n, rank, world_size, drop_last)
        super().__init__(
            n, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, drop_last=drop_last, even=even
        )

    def _sequence(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return np.arange(self.n)

    def _laid(self, seq: np.ndarray, world: int) -> np.ndarray:
        """``seq`` as the places ``world`` ranks take in turn: equal runs (the tail cut, or padded by
        wrapping around to its start), or as it is (``even=False``)."""
        if self.drop_last or self.even:
            return np.resize(seq, per_rank(len(seq), world, self.drop_last) * world)
        return seq

    def _deal(self, seq: np.ndarray, epoch: int, world: int, rank: int, part: int) -> np.ndarray:
        return self._laid(seq, world)[rank::world]

    def _split(
        self, seq: np.ndarray, epoch: int, world: int, position: int, part: int
    ) -> tuple[np.ndarray, np.ndarray]:
        laid = self._laid(seq, world)  # each rank at `position`: the first `position` rows of places taken
        return laid[: position * world], laid[position * world :]


# pragma: no mutate block (the sampler view of a loader: tested through the loaders)
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


def follow_process_group(loader: Any, starting: bool = False) -> None:
    """Give ``loader`` (a `LoaderBase`) the rank and world size of a process group started after it was made
    (Lightning and Accelerate start it after the user built the loader); explicit rank/world_size stay. A
    pass ``starting`` now restarts its epoch unless a state was loaded, so only a loaded mid-epoch position
    stands in the way then."""
    rank, world = dist_rank_world(loader._rank_arg, loader._world_arg)  # noqa: SLF001
    if (rank, world) == (loader.rank, loader.world_size):
        return
    mid_epoch = loader.order.position not in (0, len(loader.order))
    if (mid_epoch and (loader._resumed or not starting)) or (not starting and loader._pass_running()):  # noqa: SLF001
        raise RuntimeError(
            f"the process group says rank {rank} of {world}, but this loader is mid-epoch as rank "
            f"{loader.rank} of {loader.world_size}; make the loader after the process group starts"
        )
    epoch = loader.order.epoch
    loader.rank, loader.world_size = rank, world
    loader.order = loader._new_order(rank, world)  # noqa: SLF001
    loader.order.set_epoch(epoch)
    log.info("loader: now rank %d of %d (the process group started after the loader was made)", rank, world)
