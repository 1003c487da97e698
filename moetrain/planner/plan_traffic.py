"""The traffic stage of :func:`~moetrain.planner.plan.make_plan`: bytes and seconds per rank per
optimizer step of each collective (the all-to-all's rows and counts, the DP, expert-DP and tensor-
parallel all-reduces), the all-to-all algorithm not chosen for comparison, and the node-limit
figures (:class:`PlanTraffic`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moetrain.planner.comm import (
    DDP_BUCKET_BYTES,
    EXPERT_BUCKET_BYTES,
    Traffic,
    all_reduce_traffic,
    all_to_all_traffic,
    group_layout,
    node_dedup_traffic,
)
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.node_limit import node_limit_figures
from moetrain.planner.plan_layout import PlanLayout, nodes_reached, wire_row_bytes


@dataclass(frozen=True)
class PlanTraffic:
    """What :func:`traffic_stage` computed: ``traffic`` per collective, ``alternative`` (the
    all-to-all algorithm not chosen, or None), ``node_limit`` (None without a node limit) and the
    ``notes`` the report adds."""

    traffic: list[Traffic]
    alternative: Traffic | None
    node_limit: dict | None
    notes: tuple[str, ...]


def traffic_stage(model: ModelDescription, cluster: ClusterSpec, layout: PlanLayout) -> PlanTraffic:
    """Traffic per optimizer step: the all-to-all (:func:`_all_to_all_stage`), then the all-reduces."""
    arch, tp, split = model.arch, layout.tp, layout.split
    traffic, alternative, per_slot, dedup_inter, notes = _all_to_all_stage(model, cluster, layout)
    node_limit = None
    if layout.moe_layers and layout.max_nodes is not None:
        node_limit = node_limit_figures(
            arch.moe, layout.max_nodes, layout.ep_layout, layout.algorithm, per_slot, dedup_inter
        )
    dense_layout = group_layout(
        list(range(0, layout.stage_world, tp)), cluster.gpus_per_node
    )  # same tp index
    traffic.append(
        all_reduce_traffic(
            cluster, "dp_all_reduce", dense_layout, layout.dense * layout.weight_b, DDP_BUCKET_BYTES
        )
    )
    if tp > 1:
        traffic.append(
            Traffic(
                "tp_all_reduce", split["calls"], split["intra_bytes"], split["inter_bytes"],
                split["messages"], 0, split["seconds"],
            )
        )  # fmt: skip
    if layout.experts:
        expert_layout = group_layout(layout.expert_dp_groups[0], cluster.gpus_per_node)
        traffic.append(
            all_reduce_traffic(
                cluster,
                "expert_dp_all_reduce",
                expert_layout,
                layout.experts * layout.weight_b,
                EXPERT_BUCKET_BYTES,
            )  # fmt: skip
        )
    return PlanTraffic(traffic, alternative, node_limit, tuple(notes))


def _all_to_all_stage(
    model: ModelDescription, cluster: ClusterSpec, layout: PlanLayout
) -> tuple[list[Traffic], Traffic | None, tuple[str, float], Callable[[int | None], float] | None, list[str]]:
    """The all-to-all's rows and counts (none without expert parallelism), the algorithm not chosen
    (both in ``layout.chunks`` chunks), a per-slot algorithm with its inter-node bytes (the chosen
    one, else the alternative), node_dedup's inter-node row bytes per node limit (a grid layout
    only, else None) and notes."""
    arch, settings, ep, ep_layout = model.arch, layout.settings, layout.ep, layout.ep_layout
    algorithm, moe_layers = layout.algorithm, layout.moe_layers
    traffic = []
    notes: list[str] = []
    alternative = None
    per_slot = ("flat", 0.0)  # a per-slot all-to-all (the chosen one, else the alternative), inter bytes
    dedup_inter = None  # limit -> inter-node row bytes of node_dedup (a grid layout only)
    accum = settings.grad_accum
    if moe_layers and ep > 1:
        rows = moe_layers[0].rows
        balanced_rows = moe_layers[0].balanced_rows.sent
        row_bytes = wire_row_bytes(arch.d_model, settings.precision, settings.comm_dtype)
        n, chunks = layout.layers_here * accum, layout.chunks
        local_experts = arch.moe.num_experts // ep

        def per_slot_traffic(name: str) -> tuple[Traffic, Traffic]:  # in the layout's chunks
            return all_to_all_traffic(
                cluster, ep_layout, name, balanced_rows / ep, row_bytes, local_experts, 4 * n, n, chunks
            )

        def dedup(limit: int | None) -> tuple[Traffic, Traffic]:
            reached = nodes_reached(arch.moe, ep_layout.nodes, limit)
            return node_dedup_traffic(
                cluster, ep_layout, balanced_rows, arch.moe.top_k, reached, row_bytes, local_experts, n
            )

        if ep_layout.grid:

            def dedup_inter(limit: int | None) -> float:
                return dedup(limit)[0].inter_bytes

        a2a_rows, a2a_counts = (
            dedup(layout.max_nodes) if algorithm == "node_dedup" else per_slot_traffic(algorithm)
        )
        traffic += [a2a_rows, a2a_counts]
        two_d = ep_layout.grid and ep_layout.nodes > 1 and ep_layout.per_node > 1
        if algorithm == "hierarchical":
            other = "flat"
        elif algorithm == "flat":
            other = "hierarchical" if two_d else None
        else:  # node_dedup: against the per-slot algorithm "auto" picks
            other = "hierarchical" if two_d else "flat"
        per_slot = (algorithm, a2a_rows.inter_bytes)
        if other is not None:
            alt_rows, alt_counts = per_slot_traffic(other)
            alternative = Traffic(
                f"all_to_all_{other}",
                alt_rows.calls + alt_counts.calls,
                alt_rows.intra_bytes + alt_counts.intra_bytes,
                alt_rows.inter_bytes + alt_counts.inter_bytes,
                alt_rows.intra_messages + alt_counts.intra_messages,
                alt_rows.inter_messages + alt_counts.inter_messages,
                alt_rows.seconds + alt_counts.seconds,
            )
            if algorithm == "node_dedup":
                per_slot = (other, alt_rows.inter_bytes)
        if layout.cf is not None and balanced_rows != rows.sent:
            notes.append(
                f"all-to-all bytes assume balanced routing ({balanced_rows} rows sent per layer); "
                f"at most {rows.sent} when every expert fills its capacity {rows.capacity}"
            )
    return traffic, alternative, per_slot, dedup_inter, notes
