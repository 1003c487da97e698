"""Bytes each collective moves per rank, split into intra- and inter-node, and their alpha-beta time.

Ranks are numbered node-major (``rank = node * gpus_per_node + local``); groups are those
:class:`moetrain.ParallelContext` builds (:func:`moetrain.parallel.ep_group_ranks`). Legend: P
ranks in an EP group, M nodes it spans with L members on each (its grid), El experts per rank,
r rows a rank sends to each EP peer per exchange, w bytes per row on the wire.

All-to-all, per exchange (bytes a rank sends to *other* ranks; its own share never travels):

- flat (one ``all_to_all_single`` over the group): ``(L - 1) * r * w`` intra-node and
  ``(P - L) * r * w`` inter-node, in ``L - 1`` and ``P - L`` messages;
- hierarchical (:class:`moetrain.comm.all_to_all.HierarchicalAllToAllPlan`): stage 1 sends each of
  the ``L - 1`` other local members the rows for its column, ``M * r`` rows each; stage 2 sends each
  of the ``M - 1`` other nodes ``L * r`` rows: ``(L - 1) * M * r * w`` intra and
  ``(M - 1) * L * r * w`` inter, in ``L - 1`` and ``M - 1`` messages.

- node_dedup (:mod:`moetrain.layers.node_dispatch`, not a per-slot exchange): per token, one copy
  to each node it reaches (``R`` nodes, :func:`moetrain.planner.node_limit.nodes_reached_per_token`;
  ``R (M - 1) / M`` of them other nodes) to the rank with the same local index, then its ``K`` slot
  rows inside the node. Per MoE layer and micro-step, for T tokens of which a share ``kept`` of the
  slots survives the capacity cut: inter-node ``T kept R (M - 1) / M (4 w + 12 K)`` bytes (rows out,
  partial rows back, and both again in the backward: 4 trips of w; int32 slot ids out, fp32 gates
  out and their gradients back: 12 K bytes) in ``6 (M - 1)`` messages (3 exchanges forward, 3
  backward), intra-node ``4 T kept K (L - 1) / L w`` bytes in ``4 (L - 1)`` messages; counts: ``M -
  1`` messages of 8 bytes across and ``L - 1`` of ``El * 8`` inside the node, once per forward.

The per-expert counts travel the same way first (int64, ``El`` per peer; ``M * El`` per local peer
and ``L * El`` per node for the 2-D algorithm), once per forward. Per MoE layer and micro-step:
one count exchange and four row exchanges (dispatch and combine, forward and backward; a
recomputed layer replays its rows and sends nothing more). With ``a2a_chunks = n`` each row
exchange is n exchanges of a chunk each (:mod:`moetrain.comm.overlap`): n times the calls and
messages, the same bytes; the counts are exchanged once.

All-reduce of ``S`` bytes over a group with grid (M, L) (the 2-D algorithm NCCL's trees and rings
amount to): reduce-scatter and all-gather inside the node, all-reduce of each ``S / L`` shard across
nodes: per rank ``2 * (L - 1) / L * S`` intra and ``2 * (M - 1) / M * S / L`` inter, in
``2 * (L - 1)`` and ``2 * (M - 1)`` messages per bucket.

Time (alpha-beta, as ``benchmarks/all_to_all.py`` fits it): ``messages * latency + intra_bytes /
intra_node_bandwidth + gpus_per_node * inter_bytes / inter_node_bandwidth``: every GPU of a node
runs the same collective at once, so they share the node's inter-node bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moetrain.comm.chunk_cost import GroupLayout, all_to_all_exchange, group_layout  # noqa: F401  (re-exported)
from moetrain.parallel import NODE_GRID_ALGORITHMS, grid_groups, node_grid, rank_grid
from moetrain.planner.hardware import ClusterSpec

DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's default bucket_cap_mb
EXPERT_BUCKET_BYTES = 32 * 2**20  # moetrain.grad_sync.ExpertGradReducer's default


def expert_groups(
    world_size: int, ep_size: int, layout: str, tp_size: int = 1
) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-data-parallel groups) exactly as ParallelContext builds them (from
    :func:`moetrain.parallel.rank_grid`)."""
    grid = grid_groups(rank_grid(world_size, ep_size, tp_size, layout))
    return grid["ep"], [sorted(g) for g in grid["dp"]]


def choose_all_to_all(requested: str, ep_size: int, groups: list[list[int]], gpus_per_node: int) -> str:
    """The algorithm ParallelContext would pick: ``"auto"`` is hierarchical when every EP group has
    the same grid spanning more than one node with more than one rank on each (never node_dedup);
    ``"hierarchical"`` or ``"node_dedup"`` on an irregular grid raises ValueError."""
    grids = {node_grid(g, gpus_per_node) for g in groups}
    grid = grids.pop() if len(grids) == 1 else None
    if requested in NODE_GRID_ALGORITHMS and ep_size > 1 and grid is None:
        raise ValueError(
            f"all_to_all = {requested!r} needs every expert-parallel group to hold the same number of "
            f"ranks on each of its nodes; ep_size = {ep_size} on nodes of {gpus_per_node} does not"
        )
    if requested == "auto":
        return "hierarchical" if grid is not None and grid[0] > 1 and grid[1] > 1 else "flat"
    return requested


@dataclass(frozen=True)
class Traffic:
    """One collective's traffic per rank per optimizer step: bytes sent to ranks of the same node
    (``intra_bytes``) and of other nodes (``inter_bytes``), message counts, calls, and the
    alpha-beta time in seconds."""

    name: str
    calls: int
    intra_bytes: float
    inter_bytes: float
    intra_messages: int
    inter_messages: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def alpha_beta_seconds(
    cluster: ClusterSpec, intra_bytes: float, inter_bytes: float, intra_messages: int, inter_messages: int
) -> float:
    """``intra_messages * intra_latency + inter_messages * inter_latency + intra_bytes / intra_bw +
    gpus_per_node * inter_bytes / inter_node_bw`` (seconds)."""
    return (
        intra_messages * cluster.intra_node_latency
        + inter_messages * cluster.inter_node_latency
        + intra_bytes / cluster.intra_node_bandwidth
        + cluster.gpus_per_node * inter_bytes / cluster.inter_node_bandwidth
    )


def all_to_all_traffic(
    cluster: ClusterSpec,
    layout: GroupLayout,
    algorithm: str,
    rows_per_peer: float,
    row_bytes: int,
    local_experts: int,
    exchanges: int,
    count_exchanges: int,
    chunks: int = 1,
) -> tuple[Traffic, Traffic]:
    """(rows, counts) traffic of ``exchanges`` row exchanges and ``count_exchanges`` count
    exchanges per step. Each row exchange runs in ``chunks`` chunks (``a2a_chunks``; the counts
    are never chunked): ``chunks`` times the calls and messages for the same bytes, so every chunk
    pays the messages' latency again."""
    intra, inter, m_intra, m_inter = all_to_all_exchange(layout, algorithm, rows_per_peer * row_bytes)
    calls = 1 if algorithm == "flat" else 2
    rows = Traffic(
        "all_to_all",
        exchanges * chunks * calls if layout.size > 1 else 0,
        exchanges * intra,
        exchanges * inter,
        exchanges * chunks * m_intra,
        exchanges * chunks * m_inter,
        exchanges * alpha_beta_seconds(cluster, intra, inter, chunks * m_intra, chunks * m_inter),
    )
    c_intra, c_inter, c_m_intra, c_m_inter = all_to_all_exchange(layout, algorithm, local_experts * 8)
    counts = Traffic(
        "all_to_all_counts",
        count_exchanges * calls if layout.size > 1 else 0,
        count_exchanges * c_intra,
        count_exchanges * c_inter,
        count_exchanges * c_m_intra,
        count_exchanges * c_m_inter,
        count_exchanges * alpha_beta_seconds(cluster, c_intra, c_inter, c_m_intra, c_m_inter),
    )
    return rows, counts


def node_dedup_traffic(
    cluster: ClusterSpec,
    layout: GroupLayout,
    kept_slots: float,
    top_k: int,
    nodes_reached: float,
    row_bytes: int,
    local_experts: int,
    rounds: int,
) -> tuple[Traffic, Traffic]:
    """(rows, counts) traffic of ``rounds`` MoE layer forward + backward passes with
    ``all_to_all="node_dedup"`` on a grid ``layout``, ``kept_slots`` slots a rank routes per layer
    (``T kept K``), ``nodes_reached`` nodes a token's kept slots reach (module docstring)."""
    if layout.size == 1:
        return Traffic("all_to_all", 0, 0.0, 0.0, 0, 0, 0.0), Traffic(
            "all_to_all_counts", 0, 0.0, 0.0, 0, 0, 0.0
        )
    m, l = layout.nodes, layout.per_node
    remote_copies = kept_slots / top_k * nodes_reached * (m - 1) / m
    inter = rounds * remote_copies * (4 * row_bytes + 12 * top_k)
    intra = rounds * 4 * kept_slots * (l - 1) / l * row_bytes
    m_inter, m_intra = rounds * 6 * (m - 1), rounds * 4 * (l - 1)
    rows = Traffic(
        "all_to_all", rounds * 10, intra, inter, m_intra, m_inter,
        alpha_beta_seconds(cluster, intra, inter, m_intra, m_inter),
    )  # fmt: skip
    c_intra, c_inter = rounds * (l - 1) * local_experts * 8, rounds * (m - 1) * 8
    c_m_intra, c_m_inter = rounds * (l - 1), rounds * (m - 1)
    counts = Traffic(
        "all_to_all_counts", rounds * 2, c_intra, c_inter, c_m_intra, c_m_inter,
        alpha_beta_seconds(cluster, c_intra, c_inter, c_m_intra, c_m_inter),
    )  # fmt: skip
    return rows, counts


def all_reduce_traffic(
    cluster: ClusterSpec, name: str, layout: GroupLayout, payload_bytes: float, bucket_bytes: int
) -> Traffic:
    """2-D all-reduce of ``payload_bytes`` in buckets of ``bucket_bytes`` (see the module docstring)."""
    if layout.size == 1 or payload_bytes == 0:
        return Traffic(name, 0, 0.0, 0.0, 0, 0, 0.0)
    m, l = layout.nodes, layout.per_node
    buckets = math.ceil(payload_bytes / bucket_bytes)
    intra = 2 * (l - 1) / l * payload_bytes
    inter = 2 * (m - 1) / m * payload_bytes / l
    m_intra, m_inter = buckets * 2 * (l - 1), buckets * 2 * (m - 1)
    seconds = alpha_beta_seconds(cluster, intra, inter, m_intra, m_inter)
    return Traffic(name, buckets, intra, inter, m_intra, m_inter, seconds)
