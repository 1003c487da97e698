"""Which rank this is, and the agreement between ranks that keeps every checkpoint call collective.

Every function that can fail on one rank calls :func:`agree` before the next collective, so that
the other ranks raise the same error instead of waiting in a collective the failed rank never
enters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from moetrain.layers.experts import GroupedExperts


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, truncated, corrupt or unsafe (the message names the file),
    or a save could not be completed (the message names the path and the cause)."""


@dataclass(frozen=True)
class RankLayout:
    rank: int
    world_size: int
    ep_size: int
    distributed: bool  # torch.distributed initialised: collectives are used
    group: Any = None  # the process group of the checkpoint's collectives (None: the default group)
    tp_size: int = 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def rank_layout(parallel, model: nn.Module, group=None) -> RankLayout:
    """This process's place for a checkpoint call; checks ``parallel`` against torch.distributed."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if parallel is None:
        sharded = [m for m in model.modules() if isinstance(m, GroupedExperts) and m.first_expert != 0]
        if sharded:
            raise ValueError(
                "parallel must be given when the model's experts are sharded (a GroupedExperts module "
                f"has first_expert = {sharded[0].first_expert}); pass the model's ParallelContext"
            )
        return RankLayout(rank, world, 1, distributed, group)
    if parallel.world_size != world or parallel.rank != rank:
        raise ValueError(
            f"parallel describes rank {parallel.rank} of world {parallel.world_size}, but torch.distributed "
            f"says rank {rank} of world {world}; build the ParallelContext after init_process_group"
        )
    return RankLayout(rank, world, parallel.ep_size, distributed, group, parallel.tp_size)


_ERROR_TYPES = {
    "ValueError": ValueError,
    "CheckpointError": CheckpointError,
    "FileNotFoundError": FileNotFoundError,
}


def agree(error: BaseException | None, layout: RankLayout) -> None:
    """Raises on every rank when any rank had an error: its own, else the first failing rank's
    (same type, message prefixed with that rank). A collective."""
    if layout.distributed:
        mine = None if error is None else (type(error).__name__, str(error))
        gathered: list[Any] = [None] * layout.world_size
        dist.all_gather_object(gathered, mine, group=layout.group)
        failed = [(rank, item) for rank, item in enumerate(gathered) if item is not None]
        if error is None and failed:
            rank, (kind, message) = failed[0]
            raise _ERROR_TYPES.get(kind, RuntimeError)(f"rank {rank}: {message}")
    if error is not None:
        raise error


def broadcast(value: Any, layout: RankLayout) -> Any:
    """Rank 0's ``value`` on every rank (a small picklable object: names, paths, decisions)."""
    if not layout.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=layout.group)
    return box[0]


def all_gather(value: Any, layout: RankLayout) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    if not layout.distributed:
        return [value]
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, value, group=layout.group)
    return gathered


def barrier(layout: RankLayout) -> None:
    if layout.distributed:
        dist.barrier(group=layout.group)
