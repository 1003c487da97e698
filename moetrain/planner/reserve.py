"""GPU memory taken before and besides any tensor: the CUDA context, NCCL's buffers for each
communicator the run creates, and the caching allocator's fragmentation.

``reserve = context + sum over communicators of NCCL memory + fragmentation * dynamic memory``

Per communicator (``P_in`` peers on the rank's node, ``P_out`` on other nodes, ``g`` GPUs per node):

- one that runs all-reduces (DDP over the world, the expert-data-parallel group):
  ``nccl_collective`` (rings and trees keep two connections whatever the size, and the figure no
  longer grows beyond two nodes, NVIDIA/nccl #986);
- one that runs all-to-alls (the EP group; with the 2-D algorithm its intra-node and inter-node
  groups as well): ``nccl_all_to_all_node * P_in / (g - 1) + nccl_net_peer * min(P_out, 8)`` (the
  network buffers are one pool shared by the remote peers) plus, for a communicator of only remote
  peers, ``nccl_collective`` for its set-up.

The figures per GPU type (:data:`RESERVE_FIGURES`) and their sources are next to the constants;
where no public measurement exists they are scaled from one that does, as stated. Fragmentation is
measured (:data:`FRAGMENTATION`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MB = 10**6
MiB = 2**20

# The CUDA context with PyTorch's kernels loaded lazily (the default since CUDA 12.2 / torch 1.13):
# 287 MB measured (eager loading: 667 MB), pytorch/pytorch PR #86509; plus cuBLAS/cuDNN handles and
# workspaces and this package's kernels: 512 MiB assumed for every GPU type.
CUDA_CONTEXT_BYTES = 512 * MiB
# NCCL_BUFFSIZE (4 MiB, NCCL environment-variable documentation) for each direction on each of the
# 2 channels NCCL opens per remote peer for send/receive (NCCL_NCHANNELS_PER_NET_PEER = 2). NCCL
# shares one pool of network buffers between all remote peers (NCCL_NET_SHARED_BUFFERS, on by
# default: "constant memory usage instead of increasing linearly with the number of remote
# peers"); its size is not documented: assumed as large as NET_POOL_PEERS peers' buffers.
NCCL_NET_PEER_BYTES = 2 * 2 * 4 * MiB
NET_POOL_PEERS = 8
# What torch's caching allocator reserved beyond the allocated peak, as a share of the step's
# dynamic memory (step peak + all-to-all buffers). Measured on one H100 (torch 2.11, 2026-11-26),
# the 0.57B-parameter LM of scripts/gpu_check.sh (bf16 autocast, 32 x 512 tokens, torch AdamW):
# 3.84 GiB = 0.43 of 9.0 GiB without recompute, 1.52 GiB = 0.36 of the planned 4.26 GiB with full
# recompute (after the engine released the recompute profile's blocks). The larger is taken; the
# GPU check measures both again (`moetrain plan --calibrate`, "fragmentation").
FRAGMENTATION = 0.43


@dataclass(frozen=True)
class ReserveFigures:
    """Bytes per GPU: ``nccl_collective`` for one all-reduce communicator, ``nccl_all_to_all_node``
    for one all-to-all communicator across all ``g`` GPUs of a node (NVLink)."""

    nccl_collective: int
    nccl_all_to_all_node: int
    assumed: str = ""  # which figures no public measurement gives (printed with the plan)


# - A100: 688 MB per communicator of more than 2 GPUs after an all-reduce, 4 x A100 with NVLink
#   (NVIDIA/nccl #964); H100: 1.06 GB after set-up (#1685), and 1.6 GB for one communicator on an
#   unnamed GPU (#864): 1.06 GB taken for H100; V100 and P100 have fewer NVLinks and channels:
#   512 MiB assumed.
# - all-to-all inside one 8 x H100 node: NCCL's memory went from 1.06 to 4.34 GB per GPU (3.28 GB
#   more; 32 channels to every peer, #1685). Memory is linear in the channels (#986), which follow
#   the NVLinks per GPU: A100 12, V100 6, P100 4 against H100's 18, so 3.28 GB x 12/18, 6/18, 4/18
#   (an assumption until measured).
# Measured: both H100 figures, A100's collective. ASSUMED (no public measurement): A100's all-to-all
# and every V100 and P100 figure, the collective's 512 MiB and the all-to-all scaled from H100's.
RESERVE_FIGURES: dict[str, ReserveFigures] = {
    "H100-SXM5-80GB": ReserveFigures(nccl_collective=1060 * MB, nccl_all_to_all_node=3280 * MB),  # measured
    "A100-SXM4-80GB": ReserveFigures(
        nccl_collective=688 * MB,  # measured
        nccl_all_to_all_node=3280 * MB * 12 // 18,
        assumed="A100 all-to-all figure assumed: H100's x 12/18 NVLinks",
    ),
    "V100-SXM2-32GB": ReserveFigures(  # the M6-1T plan's GPUs
        nccl_collective=512 * MiB,
        nccl_all_to_all_node=3280 * MB * 6 // 18,
        assumed="V100 NCCL figures assumed: 512 MiB per all-reduce group, H100's all-to-all x 6/18 NVLinks",
    ),
    "P100-SXM2-16GB": ReserveFigures(
        nccl_collective=512 * MiB,
        nccl_all_to_all_node=3280 * MB * 4 // 18,
        assumed="P100 NCCL figures assumed: 512 MiB per all-reduce group, H100's all-to-all x 4/18 NVLinks",
    ),
}
DEFAULT_FIGURES = RESERVE_FIGURES["H100-SXM5-80GB"]  # GPUs without figures: the largest known


def figures_for(gpu_name: str) -> ReserveFigures:
    """The figures of ``gpu_name``; a GPU without any gets H100's, marked as assumed."""
    if gpu_name in RESERVE_FIGURES:
        return RESERVE_FIGURES[gpu_name]
    return replace(DEFAULT_FIGURES, assumed=f"no NCCL figures for {gpu_name}: H100's assumed")


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator of a rank: its ``name``, what it runs (``"all_reduce"`` or
    ``"all_to_all"``) and the rank's peers in it on its node and on other nodes."""

    name: str
    runs: str
    intra_peers: int
    inter_peers: int


def nccl_bytes(communicator: Communicator, figures: ReserveFigures, gpus_per_node: int) -> int:
    """NCCL memory of one communicator on one GPU (see the module docstring)."""
    if communicator.runs == "all_reduce":
        return figures.nccl_collective
    node_share = communicator.intra_peers / max(gpus_per_node - 1, 1)
    remote = NCCL_NET_PEER_BYTES * min(communicator.inter_peers, NET_POOL_PEERS)
    total = round(figures.nccl_all_to_all_node * node_share) + remote
    if communicator.intra_peers == 0:
        total += figures.nccl_collective
    return total


def reserve_terms(
    gpu_name: str, gpus_per_node: int, communicators: list[Communicator], dynamic_bytes: int
) -> dict[str, int]:
    """The reserve of one GPU by term: ``cuda_context``, ``nccl_<name>`` per communicator,
    ``fragmentation`` (of ``dynamic_bytes``, the memory allocated and freed during a step)."""
    figures = figures_for(gpu_name)
    terms = {"cuda_context": CUDA_CONTEXT_BYTES}
    for communicator in communicators:
        terms[f"nccl_{communicator.name}"] = nccl_bytes(communicator, figures, gpus_per_node)
    terms["fragmentation"] = round(FRAGMENTATION * dynamic_bytes)
    return terms
