"""One rank of the emulated-cluster test: flat and hierarchical all-to-all of deterministic rows on a
2 x 2 grid; rank r saves what it received to ``OUT/rank{r}.pt``. Run it under
benchmarks/emulated_cluster.py (torchrun's variables set) or call ``exchange(rank, world)``."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, exchange_counts
from moetrain.parallel import ParallelContext


def exchange(rank: int, world: int) -> dict:
    received = {}
    for algorithm in ("flat", "hierarchical"):
        ctx = ParallelContext(ep_size=world, all_to_all=algorithm, local_world_size=2)
        g = torch.Generator().manual_seed(rank)
        counts = torch.randint(0, 5, (world, 2), generator=g)
        x = torch.randn(int(counts.sum()), 6, generator=g)
        _, plan = exchange_counts(counts, ctx)
        rows = all_to_all(x, plan)
        received[algorithm] = rows
        received[f"{algorithm}_round_trip"] = torch.equal(all_to_all_reverse(rows, plan), x)
    return received


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result = exchange(rank, world)
    torch.save(result, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
