"""How many CPUs a rank has, and the default thread and data-loader worker counts derived from it.

A rank may use the CPUs of its affinity mask (``os.sched_getaffinity``: what a container, SLURM or
a binding script allowed). Ranks of one node either share a mask (plain torchrun: every rank sees
every CPU) or each have their own (bound by ``torchrun --numa-binding`` or ``bind_rank.py``), so a
rank's share is its mask divided by the number of ranks on its host whose masks overlap its own
(:func:`cpus_per_rank`, one ``all_gather_object`` over the world when there are several ranks).

Defaults from a share of ``c`` CPUs (one rank, one training process, its loader workers):

- loader workers (:func:`default_num_workers`): 0 when ``c < 2`` (a worker would only compete
  with training for the one CPU), else ``min(8, max(1, c // 4))``: decoding a few hundred images
  per step needs a few processes, not one per core;
- torch threads (:func:`default_threads`): ``max(1, c - workers)``, so training threads and
  workers together do not oversubscribe the share (on a busy 2-CPU machine the tiny M6 model ran
  4-6x slower with torch's default 2 threads than with 1).
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def share_of_cpus(mine: tuple[str, set[int]], everyone: list[tuple[str, set[int]]]) -> int:
    """CPUs per rank for the rank with ``(host, cpus)`` = ``mine`` among ``everyone``'s: its CPUs
    divided by the ranks on its host whose CPUs overlap its own (itself included), at least 1."""
    host, cpus = mine
    sharing = sum(1 for other_host, other in everyone if other_host == host and other & cpus)
    return max(1, len(cpus) // max(1, sharing))


def cpus_per_rank(world_size: int = 1) -> int:
    """This rank's share of CPUs (see the module docstring). With ``world_size > 1`` this is a
    collective over the default process group: every rank must call it."""
    mine = (socket.gethostname(), usable_cpus())
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return share_of_cpus(mine, [mine])
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return share_of_cpus(mine, everyone)


def default_num_workers(cpus: int) -> int:
    """Loader worker processes for a rank with ``cpus`` CPUs: 0 below 2, else
    ``min(8, max(1, cpus // 4))``."""
    return 0 if cpus < 2 else min(8, max(1, cpus // 4))


def default_threads(cpus: int, num_workers: int) -> int:
    """torch threads for a rank with ``cpus`` CPUs and ``num_workers`` loader workers:
    ``max(1, cpus - num_workers)``."""
    return max(1, cpus - num_workers)
