"""MoE layer building blocks: router, losses, dispatch, experts and the layer itself."""

from moetrain.layers.experts import experts_on_meta
from moetrain.layers.moe_layer import (
    MoELayer,
    MoEModelStats,
    MoEStats,
    collect_moe_stats,
    discard_routed_counts,
    set_aux_loss_scale,
    shard_experts,
    update_score_biases,
)

__all__ = [
    "MoELayer",
    "MoEModelStats",
    "MoEStats",
    "collect_moe_stats",
    "discard_routed_counts",
    "experts_on_meta",
    "set_aux_loss_scale",
    "shard_experts",
    "update_score_biases",
]
