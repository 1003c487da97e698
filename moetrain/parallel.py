"""ParallelContext: the device mesh, process groups and node topology of a run, created once and
passed explicitly.

World = DP x EP x TP, one :class:`~torch.distributed.device_mesh.DeviceMesh` with the named
dimensions ``("dp", "ep", "tp")`` over the rank grid of :func:`rank_grid` (tp innermost, so a
tensor-parallel group sits on consecutive ranks, inside a node). Every group is derived from that
one grid (all built here, never read from global state elsewhere):

- ``tp_group`` (mesh dim ``tp``): the ``tp_size`` ranks that split the ``split`` layers; they see
  the same data.
- ``ep_group`` (mesh dim ``ep``): the ``ep_size`` ranks that exchange tokens and split the
  experts; EP rank ``i`` holds global experts ``[i * E / ep_size, (i + 1) * E / ep_size)``.
- ``dp_group`` = ``expert_dp_group`` (mesh dim ``dp``): the ``dp = world / (ep * tp)`` ranks
  holding copies of the same experts (and the same tensor-parallel shards); expert gradients are
  reduced only over it.
- ``dense_group``: the ``dp * ep`` ranks with this rank's tp index (the mesh's ``("dp", "ep")``
  submesh): replicated parameters are averaged over it; each of its ranks reads its own data
  (``data_index`` of ``data_count = dp * ep`` streams).
- ``intra_node_group`` / ``inter_node_group``: inside an EP group, its members on this node, and
  its members with this node-local index on every node: the two stages of the 2-D all-to-all
  and of the node-deduplicating dispatch (``all_to_all="node_dedup"``).

Ranks are numbered node-major (rank = node * local_world_size + local_rank), as torchrun and
SLURM do, so an EP group's ranks sorted by number are also node-major.

With ``pp_size > 1`` a ``pp`` (pipeline) dimension comes outermost: the mesh is
``("pp", "dp", "ep", "tp")``, stage ``s`` holds the consecutive ranks
``[s * world / pp, (s + 1) * world / pp)``, laid out inside as above (``grid`` is this rank's
stage's ``[dp, ep, tp]`` grid). Every dp / ep / tp / dense group lies inside one stage;
``pp_group`` links the ranks of one pipeline (same dp, ep, tp index), which read the same data
stream (``data_index`` does not depend on the stage); ``stage_group`` holds all ranks of a stage.
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
    """First host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``,
    ``"rack[1-2]-node[01-04]"`` -> ``"rack1-node01"`` (the first value of each bracket group of the
    first entry)."""
    text = nodelist.strip()
    match = re.match(r"[^,\[\]]+(?:[^,\[\]]|\[[^\[\]]+\])*", text)
    if not match or text[match.end() : match.end() + 1] not in ("", ","):
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r} is not a node list like 'node[01-04],gpu7'")
    return re.sub(r"\[([^\]]+)\]", lambda group: re.split(r"[-,]", group.group(1))[0], match.group(0))


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


def _env_int(
    env: Mapping[str, str], name: str, default: int, low: int, high: int | None = None, note: str = ""
) -> int:
    """The integer in ``env[name]`` (``default`` when unset), or ``ValueError`` naming ``name`` and
    the allowed range ``low..high`` (``high`` None: no upper bound; ``note`` appended to it)."""
    text = env.get(name)
    if text is None:
        return default
    allowed = (f"an integer >= {low}" if high is None else f"an integer in {low}..{high}") + note
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be {allowed}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {text!r}")
    return value


def _rank_and_world(env: Mapping[str, str], rank: str, world: str) -> tuple[int, int]:
    """``(rank, world size)`` from the variables named, checked: ``0 <= rank < world size``."""
    world_size = _env_int(env, world, 1, 1)
    return _env_int(env, rank, 0, 0, world_size - 1, f" ({world}={world_size})"), world_size


def read_launch_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT; under
    ``srun`` (one task per GPU) SLURM sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the node
    list, from which the first host becomes the master (port: MASTER_PORT, else 29500). Neither:
    a single process. A variable that is not an integer in its range is a ``ValueError`` naming it."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _rank_and_world(env, "RANK", "WORLD_SIZE")
        return LaunchEnvironment(
            rank=rank,
            world_size=world,
            local_rank=_env_int(env, "LOCAL_RANK", rank, 0),
            local_world_size=_env_int(env, "LOCAL_WORLD_SIZE", world, 1),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_env_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535),
            launcher="torchrun",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=_env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _rank_and_world(env, "SLURM_PROCID", "SLURM_NTASKS")
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
        return LaunchEnvironment(
            rank=rank,
            world_size=world,
            local_rank=_env_int(env, "SLURM_LOCALID", 0, 0),
            local_world_size=tasks_per_node(per_node),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=_env_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535),
            launcher="slurm",
        )
    return LaunchEnvironment(0, 1, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "single")


class DeadlineExceeded(TimeoutError):
    """A call given to :func:`call_with_deadline` that had not returned by its deadline."""


def call_with_deadline(call, seconds: float, name: str = "moetrain-deadline"):
    """``call()`` on a helper thread (daemon, named ``name``), given ``seconds``: its value, or its
    error re-raised here; :class:`DeadlineExceeded` when it has not returned by then (the helper is
    left blocked). A TCP store call whose server is gone, stopped, or not a store at all waits
    forever whatever the store's timeout; only a deadline of our own turns that into an error."""
    box: dict = {}

    def attempt() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - re-raised below on the calling thread
            box["error"] = error

    thread = threading.Thread(target=attempt, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise DeadlineExceeded(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _with_deadline(connect, seconds: float, failure: str):
    """``connect()`` within ``seconds`` (and 5 s of slack), else :class:`RendezvousError` with
    ``failure`` and the cause (a client that reached a port held by something other than a store
    waits forever inside the handshake)."""
    try:
        return call_with_deadline(connect, seconds + 5, "moetrain-rendezvous")
    except DeadlineExceeded:
        raise RendezvousError(failure) from None
    except Exception as error:  # noqa: BLE001 - any failure to connect is the rendezvous'
        raise RendezvousError(f"{failure} ({' '.join(str(error).split())[:200]})") from None


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


MESH_DIMS = ("dp", "ep", "tp")
PIPELINE_MESH_DIMS = ("pp", *MESH_DIMS)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_sizes(world_size: int, ep_size: int, tp_size: int = 1, pp_size: int = 1) -> None:
    """ValueError naming the numbers and the possible values when ``pp_size`` does not divide the
    world size, or ``ep_size * tp_size`` the ranks of one pipeline stage (``world / pp_size``)."""
    if pp_size > 1 and world_size % pp_size:
        possible = _divisors(world_size)
        raise ValueError(
            f"pp_size = {pp_size} must divide the world size = {world_size} (possible: {possible})"
        )
    stage = world_size // pp_size
    if stage % (ep_size * tp_size):
        ranks = (
            f"the world size = {world_size}"
            if pp_size == 1
            else f"the ranks of one pipeline stage = {stage} (world size {world_size} / pp_size {pp_size})"
        )
        if tp_size == 1:
            raise ValueError(f"ep_size = {ep_size} must divide {ranks} (possible: {_divisors(stage)})")
        raise ValueError(
            f"ep_size x tp_size = {ep_size} x {tp_size} = {ep_size * tp_size} must divide {ranks} "
            f"(divisors: {_divisors(stage)})"
        )


def rank_grid(world_size: int, ep_size: int, tp_size: int = 1, ep_layout: str = "packed") -> torch.Tensor:
    """The global rank at each mesh coordinate, an int64 tensor ``[dp, ep, tp]``: tp varies
    fastest (consecutive ranks), then ep, then dp (``"packed"``: ``rank = (d * ep + e) * tp + t``),
    or dp before ep (``"spread"``: ``rank = (e * dp + d) * tp + t``, an EP group spread over the
    world)."""
    check_sizes(world_size, ep_size, tp_size)
    dp = world_size // (ep_size * tp_size)
    ranks = torch.arange(world_size, dtype=torch.int64)
    if ep_layout == "packed":
        return ranks.view(dp, ep_size, tp_size)
    if ep_layout == "spread":
        return ranks.view(ep_size, dp, tp_size).transpose(0, 1).contiguous()
    raise ValueError(f"ep_layout must be 'packed' or 'spread', got {ep_layout!r}")


def grid_groups(grid: torch.Tensor) -> dict[str, list[list[int]]]:
    """Every group of a ``[dp, ep, tp]`` rank grid, each a list of rank lists partitioning the
    world: ``dp``, ``ep``, ``tp`` (one mesh dimension varying) and ``dense`` (dp and ep varying,
    sorted)."""
    dp, ep, tp = grid.shape
    return {
        "dp": [grid[:, e, t].tolist() for e in range(ep) for t in range(tp)],
        "ep": [grid[d, :, t].tolist() for d in range(dp) for t in range(tp)],
        "tp": [grid[d, e, :].tolist() for d in range(dp) for e in range(ep)],
        "dense": [sorted(grid[:, :, t].reshape(-1).tolist()) for t in range(tp)],
    }


def ep_group_ranks(world_size: int, ep_size: int, layout: str, tp_size: int = 1) -> list[list[int]]:
    """The expert-parallel groups of :func:`rank_grid` (with ``tp_size`` 1: consecutive ranks when
    packed, one every world/ep when spread)."""
    return grid_groups(rank_grid(world_size, ep_size, tp_size, layout))["ep"]


def node_grid(ranks: list[int], local_world_size: int) -> tuple[int, int] | None:
    """(nodes M, members per node L) of a sorted rank list if every node holds the same number of
    its members; None otherwise (the 2-D all-to-all needs a full M x L grid)."""
    per_node: dict[int, int] = {}
    for rank in ranks:
        per_node[rank // local_world_size] = per_node.get(rank // local_world_size, 0) + 1
    sizes = set(per_node.values())
    return (len(per_node), sizes.pop()) if len(sizes) == 1 else None


class ParallelContext:
    """The mesh, process groups and topology. ``ParallelContext()`` is the single-process context
    (no mesh); with ``torch.distributed`` initialised, it builds every group and the mesh (a
    collective call: all ranks must construct the same context in the same order). ``timeout_s``:
    the timeout of every group it creates (None: torch's default); give the one the world group
    was initialised with. ``device_type``: of the mesh (None: ``"cuda"`` under NCCL, else
    ``"cpu"``). :meth:`from_mesh` wraps an existing mesh instead."""

    def __init__(
        self,
        config: ParallelConfig | None = None,
        *,
        timeout_s: float | None = None,
        device_type: str | None = None,
        mesh=None,
        **options,
    ):
        if config is None:
            config = ParallelConfig(**options)
        elif options:
            raise ValueError(
                f"pass either a ParallelConfig or keyword options, not both (got {sorted(options)})"
            )
        self.config = config
        self.timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        initialized = dist.is_available() and dist.is_initialized()
        self._set_sizes(initialized)
        groups = self._set_rank_grid()
        self.mesh = None
        self.dp_group = self.ep_group = self.tp_group = self.expert_dp_group = self.dense_group = None
        self.intra_node_group = self.inter_node_group = self.pp_group = self.stage_group = None
        if not initialized:
            return
        self._create_groups(groups, mesh, device_type)

    def _set_sizes(self, initialized: bool) -> None:
        """World size and rank, the parallel sizes (checked against the world) and the node layout."""
        config = self.config
        self.world_size = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        self.ep_size, self.tp_size, self.pp_size = config.ep_size, config.tp_size, config.pp_size
        if not initialized and max(config.ep_size, config.tp_size, config.pp_size) > 1:
            raise ValueError(
                f"ep_size = {config.ep_size}, tp_size = {config.tp_size}, pp_size = {config.pp_size} need "
                "torch.distributed initialised with that many ranks"
            )
        check_sizes(self.world_size, self.ep_size, self.tp_size, self.pp_size)
        self.local_world_size = config.local_world_size or _local_world_size_from_env(self.world_size)
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size = {self.local_world_size} (ranks per node) must divide the world size = "
                f"{self.world_size}"
            )
        self.num_nodes = self.world_size // self.local_world_size
        self.node = self.rank // self.local_world_size
        self.local_rank = self.rank % self.local_world_size

    def _set_rank_grid(self) -> dict[str, list[list[int]]]:
        """This rank's place in the rank grid (its coordinates and the ranks of its groups) and the
        all-to-all algorithm; returns every group's ranks by dimension, for :meth:`_create_groups`."""
        stage_world = self.world_size // self.pp_size
        self.dp_size = stage_world // (self.ep_size * self.tp_size)
        self.expert_dp_size = self.dp_size
        self.pp_rank = self.rank // stage_world
        stage_grid = rank_grid(stage_world, self.ep_size, self.tp_size, self.config.ep_layout)
        self.pipeline_grid = torch.stack([stage_grid + s * stage_world for s in range(self.pp_size)])
        self.grid = self.pipeline_grid[self.pp_rank]
        groups = grid_groups(self.pipeline_grid[0])
        if self.pp_size > 1:  # every stage's groups (each is a collective over all ranks)
            groups = {
                dim: [[r + s * stage_world for r in g] for s in range(self.pp_size) for g in lists]
                for dim, lists in groups.items()
            }
            flat = self.pipeline_grid.reshape(self.pp_size, -1)
            groups["pp"] = [flat[:, i].tolist() for i in range(stage_world)]
            groups["stage"] = [row.tolist() for row in flat]
        self.dp_rank, self.ep_rank, self.tp_rank = (self.grid == self.rank).nonzero()[0].tolist()
        self.ep_ranks = self.grid[self.dp_rank, :, self.tp_rank].tolist()
        self.expert_dp_ranks = self.grid[:, self.ep_rank, self.tp_rank].tolist()
        self.tp_ranks = self.grid[self.dp_rank, self.ep_rank, :].tolist()
        self.dense_ranks = sorted(self.grid[:, :, self.tp_rank].reshape(-1).tolist())
        self.data_index = self.dense_ranks.index(self.rank)  # = this rank's rank in dense_group
        self.data_count = self.dp_size * self.ep_size
        grid = node_grid(self.ep_ranks, self.local_world_size)
        uniform = all(node_grid(g, self.local_world_size) == grid for g in groups["ep"])
        self.ep_node_grid = grid if uniform else None
        self.all_to_all = self._choose_algorithm()
        return groups

    def _create_groups(self, groups: dict[str, list[list[int]]], mesh, device_type: str | None) -> None:
        """The mesh (made from ``groups`` unless given) and every process group; a collective."""
        dims = PIPELINE_MESH_DIMS if self.pp_size > 1 else MESH_DIMS
        if mesh is None:
            made = {
                dim: dist.new_subgroups_by_enumeration(groups[dim], timeout=self.timeout)[0] for dim in dims
            }
            from torch.distributed.device_mesh import DeviceMesh

            if device_type is None:
                device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = DeviceMesh.from_group(
                [made[dim] for dim in dims],
                device_type,
                mesh=self.pipeline_grid if self.pp_size > 1 else self.grid,
                mesh_dim_names=dims,
            )
        self.mesh = mesh
        self.dp_group, self.ep_group, self.tp_group = (mesh.get_group(dim) for dim in MESH_DIMS)
        self.expert_dp_group = self.dp_group
        if self.pp_size > 1:
            self.pp_group = mesh.get_group("pp")
            self.stage_group, _ = dist.new_subgroups_by_enumeration(groups["stage"], timeout=self.timeout)
        if self.tp_size == 1 and self.pp_size == 1:
            self.dense_group = dist.group.WORLD
        else:
            self.dense_group, _ = dist.new_subgroups_by_enumeration(groups["dense"], timeout=self.timeout)
        if self.all_to_all in NODE_GRID_ALGORITHMS:
            self._build_node_groups(groups["ep"])

    @classmethod
    def from_mesh(cls, mesh, config: ParallelConfig | None = None, *, timeout_s: float | None = None):
        """Wraps an existing mesh whose dimensions are named ``("dp", "ep", "tp")`` in that order
        (sizes may be 1), over the ranks of the world (the node groups of the 2-D all-to-all and the
        dense group are created here). ``config`` gives the other options; its ``ep_size`` /
        ``tp_size`` are replaced by the mesh's. A collective."""
        names = tuple(mesh.mesh_dim_names or ())
        if names != MESH_DIMS:
            raise ValueError(f"mesh dimensions must be named {MESH_DIMS}, got {names or None}")
        sizes = dict(zip(MESH_DIMS, mesh.mesh.shape, strict=True))
        config = replace(config or ParallelConfig(), ep_size=sizes["ep"], tp_size=sizes["tp"])
        context = cls.__new__(cls)
        world = dist.get_world_size()
        for layout in ("packed", "spread"):
            if torch.equal(mesh.mesh.cpu(), rank_grid(world, sizes["ep"], sizes["tp"], layout)):
                config = replace(config, ep_layout=layout)
                break
        else:
            raise ValueError(
                "the mesh's rank grid must be one of moetrain.parallel.rank_grid's (packed or spread over "
                f"{world} ranks), got {mesh.mesh.tolist()}"
            )
        cls.__init__(context, config, timeout_s=timeout_s, mesh=mesh)
        return context

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

    def submesh(self, *dims: str):
        """The mesh restricted to ``dims`` (e.g. ``("dp", "ep")``); None without a mesh."""
        return None if self.mesh is None else self.mesh[dims if len(dims) > 1 else dims[0]]

    @property
    def data_leader(self) -> int:
        """The global rank whose data position this rank resumes from: tp index 0 of this rank's
        tensor-parallel group on its pipeline's first stage (``pipeline_grid[0, dp, ep, 0]``), so
        that the tensor-parallel group and every stage of the pipeline read one stream."""
        return int(self.pipeline_grid[0, self.dp_rank, self.ep_rank, 0])

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
            f"nodes={self.num_nodes}x{self.local_world_size}, dp={self.dp_size} "
            f"ep_size={self.ep_size} ep_rank={self.ep_rank} tp_size={self.tp_size}, "
            f"expert_dp_size={self.expert_dp_size}, all_to_all={self.all_to_all!r}"
            + (f", pp_size={self.pp_size} pp_rank={self.pp_rank})" if self.pp_size > 1 else ")")
        )
