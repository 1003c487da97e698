"""The cost model that picks the chunk count of a MoE layer's all-to-all (``a2a_chunks="auto"``).

The run's layers (:class:`~moetrain.layers.dispatch.AllToAllTokenDispatcher`) and the planner
(:mod:`moetrain.planner.overlap`, :mod:`moetrain.planner.comm`) share it; it imports nothing above
:mod:`moetrain.comm`.

One exchange that gives every peer ``b`` bytes, alpha-beta (legend: a group of P ranks on M nodes
of L ranks, the worst-placed rank with ``p_i`` peers on its node and ``p_o`` on others):

- flat: ``p_i`` messages of ``b`` inside the node, ``p_o`` between nodes;
- hierarchical (2-D): ``L - 1`` messages of ``M b`` inside the node, ``M - 1`` of ``L b`` between;
- seconds: latency ``A = m_i * intra_node_latency + m_o * inter_node_latency`` (paid again by every
  chunk), transfer ``B = bytes_i / intra_node_bandwidth + L * bytes_o / inter_node_bandwidth`` (the
  node's ranks share its link; split between the chunks): :func:`exchange_cost`.

The experts' seconds ``c = ffn_flops(rows) / flops_per_s`` for each of forward, backward to the
inputs and weight gradients (balanced routing); :func:`moetrain.comm.chunking.choose_chunks` takes
the chunk count with the least overlapped time.

The constants (:class:`Links`) come from the run's ``ParallelConfig.a2a_links`` (measured or
stated by whoever runs the job: seconds per message, bytes/s per direction, the experts' FLOP/s);
without it, CPU ranks (gloo) use :data:`EMULATED_GLOO_LINKS`, fitted from measurements of this
project's emulated cluster (``benchmarks/fit_links.py``). GPU ranks need ``a2a_links``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.comm.chunking import ExchangeCost, choose_chunks
from moetrain.config.parallel import A2A_LINK_FIELDS as LINK_FIELDS


@dataclass(frozen=True)
class Links:
    """What the alpha-beta formulas read from a cluster: seconds per message inside and between
    nodes, bytes/s one rank sends inside its node, bytes/s one node sends to the others (its ranks
    share it), ranks per node, and the FLOP/s the experts reach."""

    intra_node_latency: float
    inter_node_latency: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    flops_per_s: float
    gpus_per_node: int = 1
    source: str = ""

    def with_ranks_per_node(self, ranks: int) -> Links:
        return replace(self, gpus_per_node=ranks)


# fit-constants:begin (written by benchmarks/fit_links.py; edit the script's inputs, not this block)
EMULATED_GLOO_LINKS = Links(
    intra_node_latency=0.0001534,
    inter_node_latency=0.0001534,
    intra_node_bandwidth=25910000.0,
    inter_node_bandwidth=22830000.0,  # 200 Mbit/s tbf
    flops_per_s=17340000000.0,
    source=(
        "fitted 2026-11-24 from benchmarks/all_to_all.py --emulated-mbit 100 200 400 (2 nodes x 2 "
        "ranks, gloo, one fit: the node link is the 200 Mbit/s run's) and a 1-thread fp32 GEMM on "
        "this machine"
    ),
)
# fit-constants:end


def run_links(a2a_links: dict | None, device_type: str) -> Links:
    """The constants of a run: ``a2a_links`` (``ParallelConfig.a2a_links``: the :data:`LINK_FIELDS`)
    when given, else :data:`EMULATED_GLOO_LINKS` on CPU ranks; a ValueError naming the option on
    other devices (no figure there is measured)."""
    if a2a_links is not None:
        return Links(**{name: float(a2a_links[name]) for name in LINK_FIELDS}, source="parallel.a2a_links")
    if device_type == "cpu":
        return EMULATED_GLOO_LINKS
    raise ValueError(
        f"a2a_chunks = 'auto' on {device_type} ranks needs parallel.a2a_links (the links' latencies in "
        f"seconds, bandwidths in bytes/s per direction and the experts' FLOP/s: {', '.join(LINK_FIELDS)}); "
        "measure them (benchmarks/all_to_all.py) or set a2a_chunks to an integer"
    )


@dataclass(frozen=True)
class GroupLayout:
    """One process group as the cost model needs it: ``size`` members, ``nodes`` x ``per_node``
    when every node holds the same number (``grid`` True), and for the worst-placed member (most
    peers on other nodes) its ``intra_peers`` and ``inter_peers``."""

    size: int
    nodes: int
    per_node: int
    grid: bool
    intra_peers: int
    inter_peers: int


def group_layout(ranks: list[int], gpus_per_node: int) -> GroupLayout:
    """Layout of a sorted rank list on nodes of ``gpus_per_node`` ranks."""
    counts: dict[int, int] = {}
    for rank in ranks:
        counts[rank // gpus_per_node] = counts.get(rank // gpus_per_node, 0) + 1
    fewest = min(counts.values())  # the worst-placed member has the fewest peers on its node
    grid = len(set(counts.values())) == 1
    return GroupLayout(len(ranks), len(counts), fewest, grid, fewest - 1, len(ranks) - fewest)


def all_to_all_exchange(
    layout: GroupLayout, algorithm: str, per_peer_bytes: float
) -> tuple[float, float, int, int]:
    """(intra bytes, inter bytes, intra messages, inter messages) a rank sends in one exchange that
    gives every peer ``per_peer_bytes`` (module docstring; ``algorithm`` "flat" or "hierarchical")."""
    if layout.size == 1:
        return 0.0, 0.0, 0, 0
    if algorithm == "flat":
        return (
            layout.intra_peers * per_peer_bytes,
            layout.inter_peers * per_peer_bytes,
            layout.intra_peers,
            layout.inter_peers,
        )
    m, l = layout.nodes, layout.per_node
    return (l - 1) * m * per_peer_bytes, (m - 1) * l * per_peer_bytes, l - 1, m - 1


def exchange_cost(cluster, layout: GroupLayout, algorithm: str, per_peer_bytes: float) -> ExchangeCost:
    """One exchange giving every peer ``per_peer_bytes`` (module docstring); ``cluster``: a
    :class:`Links` or the planner's ClusterSpec (the same field names)."""
    intra, inter, m_intra, m_inter = all_to_all_exchange(layout, algorithm, per_peer_bytes)
    latency = m_intra * cluster.intra_node_latency + m_inter * cluster.inter_node_latency
    transfer = (
        intra / cluster.intra_node_bandwidth + cluster.gpus_per_node * inter / cluster.inter_node_bandwidth
    )
    return ExchangeCost(latency, transfer)


def ffn_flops(rows: float, d_model: int, d_ff: int, activation: str) -> float:
    """``2*rows*D*F`` per GEMM; two GEMMs, three for SwiGLU (the first is D x 2F)."""
    return 2.0 * rows * d_model * d_ff * (3 if activation == "swiglu" else 2)


def layer_overlap_inputs(
    cluster, layout: GroupLayout, algorithm: str, rows: float, row_bytes: int, d_model: int, d_ff: int,
    activation: str, flops_per_s: float,
) -> tuple[ExchangeCost, float]:  # fmt: skip
    """(one exchange's cost, the experts' seconds for one of forward / backward-input / weights) of
    a MoE layer sending and computing ``rows`` rows of ``row_bytes`` wire bytes over an EP group of
    ``layout.size`` ranks."""
    per_peer = rows / layout.size * row_bytes
    expert_s = ffn_flops(rows, d_model, d_ff, activation) / flops_per_s
    return exchange_cost(cluster, layout, algorithm, per_peer), expert_s


def plan_chunks(requested, cost: ExchangeCost, expert_s: float) -> int:
    """``requested`` (an integer) or, for ``"auto"``, the count with the least modelled time."""
    return choose_chunks(cost, expert_s, expert_s, expert_s) if requested == "auto" else int(requested)
