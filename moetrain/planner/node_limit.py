"""Which nodes a token's routed rows reach, with and without node-limited routing.

Legend: E experts laid out node-major over the N nodes of an EP group (node m holds
``[m*E/N, (m+1)*E/N)``), K choices per token, G prototype groups, M = ``max_nodes_per_token``.
"Uniform routing": every choice of K experts (per prototype group: of K/G of its E/G experts) is
equally likely, and the node a token starts on is independent of its choice (balanced routing, as
the planner's byte counts assume everywhere).

- **Rows crossing nodes.** The flat and hierarchical all-to-alls send one row per routed slot, so
  each row lands on the node of its expert; every expert's node is equally likely, so ``(N - 1) / N``
  of the rows cross nodes, with or without a node limit: node-limited routing gathers a token's rows
  onto fewer nodes but does not make them local (each node is still picked with probability 1/N). It
  does not change their inter-node bytes.
- **Nodes reached per token** (:func:`nodes_reached_per_token`): without a binding limit,
  ``sum_m P(node m holds one of the token's experts)`` with
  ``P = 1 - prod_g C(E/G - e_mg, K/G) / C(E/G, K/G)`` (``e_mg``: experts of node m in group g;
  for G = 1, ``N * (1 - C(E - E/N, K) / C(E, K))``). With a limit that binds (``M < min(K, N)``):
  exactly 1 for M = 1, at most M otherwise (the bound is used). Of these, ``(N - 1) / N`` are
  other nodes than the token's own (:func:`remote_nodes_per_token`): the copies that
  ``all_to_all="node_dedup"`` (:mod:`moetrain.layers.node_dispatch`, DeepSeek-V3's dispatch: each
  token once per node it reaches) sends across; its bytes are
  :func:`moetrain.planner.comm.node_dedup_traffic`'s.

``tests/unit/planner/test_planner_node_limit.py`` checks these against routing random tokens through real
routers; ``benchmarks/node_limited.py`` counts them on 8 gloo ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from math import comb

from moetrain.layers.router import node_limit_binds


def cross_node_row_share(nodes: int) -> float:
    """Share of the routed rows whose expert is on another node than their token: ``(N - 1) / N``."""
    return (nodes - 1) / nodes


def nodes_reached_per_token(
    num_experts: int, top_k: int, nodes: int, num_prototypes: int = 1, max_nodes: int | None = None
) -> float:
    """Expected distinct nodes a token's K experts lie on under uniform routing (module docstring);
    with a binding ``max_nodes``: 1 for M = 1, the bound M otherwise."""
    if node_limit_binds(top_k, nodes, max_nodes):
        return float(max_nodes)
    per_node, per_group = num_experts // nodes, num_experts // num_prototypes
    picks = top_k // num_prototypes
    reached = Fraction(0)  # exact: integer-valued answers stay integers
    for m in range(nodes):
        missed = Fraction(1)
        for g in range(num_prototypes):
            overlap = max(0, min((m + 1) * per_node, (g + 1) * per_group) - max(m * per_node, g * per_group))
            missed *= Fraction(comb(per_group - overlap, picks), comb(per_group, picks))
        reached += 1 - missed
    return float(reached)


def remote_nodes_per_token(
    num_experts: int, top_k: int, nodes: int, num_prototypes: int = 1, max_nodes: int | None = None
) -> float:
    """Expected nodes other than its own that a token's experts lie on: reached x ``(N - 1) / N``."""
    reached = nodes_reached_per_token(num_experts, top_k, nodes, num_prototypes, max_nodes)
    return reached * cross_node_row_share(nodes)


def node_limit_figures(
    moe,
    max_nodes: int,
    layout,
    algorithm: str,
    per_slot: tuple[str, float],
    node_dedup_inter_bytes: Callable[[int | None], float] | None,
) -> dict:
    """What ``max_nodes_per_token = max_nodes`` means for a model's MoE config ``moe`` on an EP group
    of ``layout`` (:class:`~moetrain.planner.comm.GroupLayout`) whose all-to-all is ``algorithm``: a
    JSON-ready dict (the plan's ``node_limit``) with the nodes a token reaches, the inter-node row
    bytes per GPU and step of a per-slot all-to-all (``per_slot``: its name and bytes, unchanged by
    the limit) and of node_dedup with and without the limit (``node_dedup_inter_bytes(limit)``; None:
    the layout has no node grid, which node_dedup needs). ``all_to_all_inter_node_bytes``: those of
    ``algorithm``. ValueError, as the router raises it, for a limit the model or layout cannot take."""
    from dataclasses import replace

    from moetrain.layers.router import check_expert_nodes

    replace(moe, max_nodes_per_token=max_nodes)  # the config's own checks (prototypes)
    nodes = layout.nodes
    binds = node_limit_binds(moe.top_k, nodes, max_nodes)
    if binds and not layout.grid:
        raise ValueError(
            "max_nodes_per_token needs every node to hold the same number of the expert-parallel group's "
            "ranks; this layout does not"
        )
    check_expert_nodes(moe.num_experts, moe.top_k, nodes, max_nodes)
    shape = (moe.num_experts, moe.top_k, nodes, moe.num_prototypes)
    dedup = None if node_dedup_inter_bytes is None else node_dedup_inter_bytes(max_nodes)
    dedup_unlimited = None if node_dedup_inter_bytes is None else node_dedup_inter_bytes(None)
    return {
        "max_nodes_per_token": max_nodes,
        "ep_nodes": nodes,
        "binds": binds,
        "exact": not binds or max_nodes == 1,  # else nodes_reached_per_token is the bound M
        "rows_per_token": moe.top_k,
        "cross_node_row_share": cross_node_row_share(nodes),
        "nodes_reached_per_token": nodes_reached_per_token(*shape, max_nodes),
        "nodes_reached_per_token_unlimited": nodes_reached_per_token(*shape),
        "all_to_all": algorithm,
        "all_to_all_inter_node_bytes": dedup if algorithm == "node_dedup" else per_slot[1],
        "per_slot_all_to_all": per_slot[0],
        "per_slot_inter_node_bytes": per_slot[1],
        "node_dedup_inter_node_bytes": dedup,
        "node_dedup_inter_node_bytes_unlimited": dedup_unlimited,
    }
