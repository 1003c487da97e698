"""moetrain: Mixture-of-Experts training for PyTorch."""

from moetrain import scope
from moetrain._version import __version__
from moetrain.config import MoEConfig, ParallelConfig
from moetrain.layers import (
    MoELayer,
    MoEModelStats,
    MoEStats,
    collect_moe_stats,
    experts_on_meta,
    set_aux_loss_scale,
    shard_experts,
)
from moetrain.moefy import moefy
from moetrain.parallel import ParallelContext
from moetrain.parallelize import Parallelized, materialize, parallelize
from moetrain.scope import strategy_from_scopes

__all__ = [
    "MoEConfig",
    "MoELayer",
    "MoEModelStats",
    "MoEStats",
    "ParallelConfig",
    "ParallelContext",
    "Parallelized",
    "__version__",
    "collect_moe_stats",
    "experts_on_meta",
    "materialize",
    "moefy",
    "parallelize",
    "scope",
    "set_aux_loss_scale",
    "shard_experts",
    "strategy_from_scopes",
]
