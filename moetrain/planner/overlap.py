"""The chunked all-to-all of a MoE layer overlapped with its experts, as the planner models it.

One MoE layer per micro-step exchanges its rows four times (dispatch and combine, forward and
backward) and runs its experts three times over (forward, backward to the inputs, weight
gradients); :mod:`moetrain.comm.chunking` gives the overlapped time of that and what it hides:

- one exchange, unchunked: ``e = A + B`` from the alpha-beta formulas of
  :mod:`moetrain.planner.comm` (``A``: the message latencies, which every chunk pays again; ``B``:
  the bytes over the links, split between the chunks);
- the experts: ``c = ffn_flops(rows) / flops_per_s`` for each of the three (balanced routing);
- ``a2a_chunks = n``: forward ``2 e_n + c / n + (n - 1) max(c / n, 2 e_n)``, backward
  ``e_n + c / n + (n - 1) max(c / n, 2 e_n) + max(e_n, c)`` with ``e_n = A + B / n``; ``n = 1``:
  ``4 e + 3 c``, nothing hidden. The hidden time is the difference.

The count exchange (once per forward) and a recomputed layer's forward (which replays its rows and
sends nothing) are not overlapped. The same formulas pick ``a2a_chunks="auto"`` at run time
(:func:`runtime_chunks`), with the constants of :func:`moetrain.planner.hardware.runtime_links`.
"""

from __future__ import annotations

from moetrain.comm.chunking import ExchangeCost, choose_chunks
from moetrain.comm.compression import wire_row_bytes
from moetrain.planner.activations import ffn_flops
from moetrain.planner.comm import GroupLayout, all_to_all_exchange, group_layout
from moetrain.planner.hardware import runtime_links


def exchange_cost(cluster, layout: GroupLayout, algorithm: str, per_peer_bytes: float) -> ExchangeCost:
    """One exchange giving every peer ``per_peer_bytes``: latency ``intra_messages * intra_latency +
    inter_messages * inter_latency``, transfer ``intra_bytes / intra_bw + ranks_per_node *
    inter_bytes / inter_bw`` (``cluster``: a ClusterSpec or :class:`~moetrain.planner.hardware.Links`)."""
    intra, inter, m_intra, m_inter = all_to_all_exchange(layout, algorithm, per_peer_bytes)
    latency = m_intra * cluster.intra_node_latency + m_inter * cluster.inter_node_latency
    transfer = (
        intra / cluster.intra_node_bandwidth + cluster.gpus_per_node * inter / cluster.inter_node_bandwidth
    )
    return ExchangeCost(latency, transfer)


def layer_overlap_inputs(
    cluster, layout: GroupLayout, algorithm: str, rows: float, row_bytes: int, d_model: int, d_ff: int,
    activation: str, flops_per_s: float,
) -> tuple[ExchangeCost, float]:  # fmt: skip
    """(one exchange's cost, the experts' seconds for one of forward / backward-input / weights) of
    a MoE layer sending and computing ``rows`` rows over an EP group of ``layout.size`` ranks."""
    per_peer = rows / layout.size * row_bytes
    return exchange_cost(cluster, layout, algorithm, per_peer), ffn_flops(
        rows, d_model, d_ff, activation
    ) / flops_per_s


def plan_chunks(requested, cost: ExchangeCost, expert_s: float) -> int:
    """``requested`` (an integer) or, for ``"auto"``, the count with the least modelled time."""
    return choose_chunks(cost, expert_s, expert_s, expert_s) if requested == "auto" else int(requested)


def runtime_chunks(parallel, rows_sent: int, x_ND, experts, comm_dtype) -> int:
    """This rank's ``a2a_chunks="auto"`` choice for a layer call sending ``rows_sent`` rows of
    ``x_ND``'s width and dtype (the EP group agrees on the largest choice)."""
    links = runtime_links(x_ND.device.type).with_ranks_per_node(parallel.local_world_size)
    layout = group_layout(sorted(parallel.ep_ranks), parallel.local_world_size)
    row_bytes = wire_row_bytes(x_ND.shape[1], x_ND.dtype, comm_dtype)
    d_ff = experts.w2_EFD.shape[1]
    cost, expert_s = layer_overlap_inputs(
        links, layout, parallel.all_to_all, rows_sent, row_bytes, x_ND.shape[1], d_ff, experts.activation,
        links.flops_per_s,
    )  # fmt: skip
    return plan_chunks("auto", cost, expert_s)
