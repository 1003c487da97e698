"""ParallelContext: the process groups and node topology of a run, created once and passed explicitly.

World = DP x EP for expert layers. Groups (all built here, never read from global state elsewhere):

- ``dp_group``: every rank; dense parameters are averaged over it.
- ``ep_group``: the ``ep_size`` ranks that exchange tokens and split the experts; EP rank ``i``
  holds global experts ``[i * E / ep_size, (i + 1) * E / ep_size)``.
- ``expert_dp_group``: the ``world / ep_size`` ranks holding copies of the same experts (same EP
  rank); expert gradients are reduced only over it.
- ``intra_node_group`` / ``inter_node_group``: inside an EP group, its members on this node, and
  its members with this node-local index on every node: the two stages of the 2-D all-to-all
  and of the node-deduplicating dispatch (``all_to_all="node_dedup"``).

Ranks are numbered node-major (rank = node * local_world_size + local_rank), as torchrun and
SLURM do, so an EP group's ranks sorted by number are also node-major.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from moetrain.config import ParallelConfig

DEFAULT_MASTER_PORT = 29500
NODE_GRID_ALGORITHMS = ("hierarchical", "node_dedup")  # need ep_node_grid and the two node subgroups


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r} is not a node list like 'node[01-04],gpu7'")
    prefix, ranges = match.group(1), match.group(2)
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges)[0]


def tasks_per_node(value: str) -> int:
    """First node's task count from ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"`` -> 4)."""
    match = re.match(r"(\d+)", value or "")
    if not match:
        raise ValueError(f"SLURM_TASKS_PER_NODE {value!r} is not like '4(x2)'")
    return int(match.group(1))


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits, read from torchrun's or SLURM's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"
    agent_store: bool = False  # torchrun's agent serves the rendezvous store (workers are its clients)
    restart_count: int = 0  # torchrun's restart of the workers (keys of earlier attempts are kept apart)
    store: object = None  # the rendezvous store once init_distributed made it (heartbeats use it)


def read_launch_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT; under
    ``srun`` (one task per GPU) SLURM sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the node
    list, from which the first host becomes the master (port: MASTER_PORT, else 29500). Neither:
    a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return LaunchEnvironment(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            launcher="torchrun",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
        return LaunchEnvironment(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=tasks_per_node(per_node),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            launcher="slurm",
        )
    return LaunchEnvironment(0, 1, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "single")


def _with_deadline(connect, seconds: float, failure: str):
    """``connect()`` on a helper thread, given ``seconds``: a TCP store client that reached a port
    held by something other than a store waits forever inside the handshake, and only a deadline
    of our own turns that into an error."""
    box: dict = {}

    def attempt() -> None:
        try:
            box["value"] = connect()
        except Exception as error:  # noqa: BLE001 - re-raised below on the calling thread
            box["error"] = error

    thread = threading.Thread(target=attempt, name="moetrain-rendezvous", daemon=True)
    thread.start()
    thread.join(seconds + 5)
    if "value" in box:
        return box["value"]
    cause = f" ({' '.join(str(box['error']).split())[:200]})" if "error" in box else ""
    raise RendezvousError(failure + cause)


class RendezvousError(RuntimeError):
    """The ranks could not meet: a port in use, an unreachable rank 0, ranks missing."""


def rendezvous_store(launch: LaunchEnvironment, timeout_s: float):
    """The TCP store all ranks meet through, at ``MASTER_ADDR:MASTER_PORT``: rank 0 serves it (or
    torchrun's agent does), the others connect. Failures are one-line :class:`RendezvousError`s:
    a port in use on rank 0, rank 0 unreachable within ``timeout_s``."""
    address = f"{launch.master_addr}:{launch.master_port}"
    timeout = timedelta(seconds=timeout_s)
    serve = launch.rank == 0 and not launch.agent_store
    if serve:
        try:
            store = dist.TCPStore(
                launch.master_addr, launch.master_port, launch.world_size, True, timeout=timeout,
                wait_for_workers=False,
            )  # fmt: skip
        except (RuntimeError, dist.DistError) as error:
            in_use = "EADDRINUSE" in str(error) or "address already in use" in str(error).lower()
            reason = (
                "the port is already in use (another job?): choose a free MASTER_PORT"
                if in_use
                else str(error)
            )
            raise RendezvousError(
                f"rank 0 cannot serve the rendezvous on port {launch.master_port}: {reason}"
            ) from None
    else:
        store = _with_deadline(
            lambda: dist.TCPStore(
                launch.master_addr, launch.master_port, launch.world_size, False, timeout=timeout
            ),
            timeout_s,
            f"rank {launch.rank} could not reach the rendezvous at {address} within {timeout_s:.0f} s: is "
            "rank 0 running, and are MASTER_ADDR / MASTER_PORT right (is the port held by something else)?",
        )
    return dist.PrefixStore(f"moetrain/{launch.restart_count}", store)


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> LaunchEnvironment:
    """Initialises ``torch.distributed`` from the launcher's environment (see
    :func:`read_launch_environment`) unless it already is, or there is a single process.
    ``backend``: None picks nccl when CUDA is available, else gloo. ``timeout_s``: of the
    rendezvous and of every collective of the default group. Returns the launch environment, with
    the rendezvous store when this call made it."""
    launch = read_launch_environment()
    if launch.world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)
        store = rendezvous_store(launch, timeout_s)
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("default_pg", store),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        except (RuntimeError, dist.DistError) as error:
            raise RendezvousError(
                f"rank {launch.rank}: the {launch.world_size} ranks did not all meet within "
                f"{timeout_s:.0f} s ({' '.join(str(error).split())[:160]}); a rank that did not start, or "
                "ranks started with different WORLD_SIZE?"
            ) from None
        launch = replace(launch, store=store)
    return launch


def _local_world_size_from_env(world_size: int) -> int:
    launch = read_launch_environment()
    return launch.local_world_size if launch.world_size == world_size else world_size


def ep_group_ranks(world_size: int, ep_size: int, layout: str) -> list[list[int]]:
    """The expert-parallel groups: consecutive ranks (packed) or one every world/ep (spread)."""
    dp = world_size // ep_size
    if layout == "packed":
        return [list(range(g * ep_size, (g + 1) * ep_size)) for g in range(dp)]
    return [[d + i * dp for i in range(ep_size)] for d in range(dp)]


def node_grid(ranks: list[int], local_world_size: int) -> tuple[int, int] | None:
    """(nodes M, members per node L) of a sorted rank list if every node holds the same number of
    its members; None otherwise (the 2-D all-to-all needs a full M x L grid)."""
    per_node: dict[int, int] = {}
    for rank in ranks:
        per_node[rank // local_world_size] = per_node.get(rank // local_world_size, 0) + 1
    sizes = set(per_node.values())
    return (len(per_node), sizes.pop()) if len(sizes) == 1 else None


class ParallelContext:
    """Process groups and topology. ``ParallelContext()`` is the single-process context; with
    ``torch.distributed`` initialised, it builds every group (a collective call: all ranks must
    construct the same context in the same order). ``timeout_s``: the timeout of every subgroup
    (None: torch's default); give the one the world group was initialised with."""

    def __init__(self, config: ParallelConfig | None = None, *, timeout_s: float | None = None, **options):
        if config is None:
            config = ParallelConfig(**options)
        elif options:
            raise ValueError(
                f"pass either a ParallelConfig or keyword options, not both (got {sorted(options)})"
            )
        self.config = config
        self.timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        self.ep_size = config.ep_size
        if self.world_size % self.ep_size:
            raise ValueError(
                f"ep_size = {self.ep_size} must divide the world size = {self.world_size} "
                f"(possible: {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]})"
            )
        if self.world_size == 1 and not initialized and config.ep_size > 1:
            raise ValueError(
                f"ep_size = {config.ep_size} needs torch.distributed initialised with that many ranks"
            )
        self.local_world_size = config.local_world_size or _local_world_size_from_env(self.world_size)
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size = {self.local_world_size} (ranks per node) must divide the world size = "
                f"{self.world_size}"
            )
        self.num_nodes = self.world_size // self.local_world_size
        self.node = self.rank // self.local_world_size
        self.local_rank = self.rank % self.local_world_size
        self.expert_dp_size = self.world_size // self.ep_size

        groups = ep_group_ranks(self.world_size, self.ep_size, config.ep_layout)
        self.ep_ranks = next(g for g in groups if self.rank in g)
        self.ep_rank = self.ep_ranks.index(self.rank)
        self.expert_dp_ranks = [g[self.ep_rank] for g in groups]
        grid = node_grid(self.ep_ranks, self.local_world_size)
        uniform = all(node_grid(g, self.local_world_size) == grid for g in groups)
        self.ep_node_grid = grid if uniform else None
        self.all_to_all = self._choose_algorithm()

        self.dp_group = self.ep_group = self.expert_dp_group = None
        self.intra_node_group = self.inter_node_group = None
        if initialized:
            self.dp_group = dist.group.WORLD
            self.ep_group, _ = dist.new_subgroups_by_enumeration(groups, timeout=self.timeout)
            expert_dp = [[g[i] for g in groups] for i in range(self.ep_size)]
            self.expert_dp_group, _ = dist.new_subgroups_by_enumeration(expert_dp, timeout=self.timeout)
            if self.all_to_all in NODE_GRID_ALGORITHMS:
                self._build_node_groups(groups)

    def _choose_algorithm(self) -> str:
        choice = self.config.all_to_all
        grid = self.ep_node_grid
        spans_nodes = grid is not None and grid[0] > 1 and grid[1] > 1
        if choice in NODE_GRID_ALGORITHMS and self.ep_size > 1 and grid is None:
            raise ValueError(
                f"all_to_all = {choice!r} needs every expert-parallel group to hold the same number of "
                f"ranks on each of its nodes; ep_size = {self.ep_size}, layout = {self.config.ep_layout!r}, "
                f"{self.num_nodes} nodes x {self.local_world_size} ranks do not"
            )
        if choice == "auto":
            return "hierarchical" if spans_nodes else "flat"
        return choice

    def _build_node_groups(self, groups: list[list[int]]) -> None:
        nodes, per_node = self.ep_node_grid
        intra = [g[m * per_node : (m + 1) * per_node] for g in groups for m in range(nodes)]
        inter = [[g[m * per_node + l] for m in range(nodes)] for g in groups for l in range(per_node)]
        self.intra_node_group, _ = dist.new_subgroups_by_enumeration(intra, timeout=self.timeout)
        self.inter_node_group, _ = dist.new_subgroups_by_enumeration(inter, timeout=self.timeout)

    @property
    def ep_nodes(self) -> int | None:
        """Nodes the expert-parallel group spans (1 without expert parallelism): its ranks are
        node-major, so node m of the group holds the consecutive global experts of its ranks
        ``m*L .. (m+1)*L - 1``. None when its nodes hold different numbers of its ranks."""
        return None if self.ep_node_grid is None else self.ep_node_grid[0]

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds."""
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts = {num_experts} must be divisible by ep_size = {self.ep_size} "
                f"(each expert-parallel rank holds the same number of experts)"
            )
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.rank}/{self.world_size}, "
            f"nodes={self.num_nodes}x{self.local_world_size}, "
            f"ep_size={self.ep_size} ep_rank={self.ep_rank}, expert_dp_size={self.expert_dp_size}, "
            f"all_to_all={self.all_to_all!r})"
        )
