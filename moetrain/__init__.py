"""moetrain: Mixture-of-Experts training for PyTorch."""

from moetrain._version import __version__
from moetrain.config import MoEConfig, ParallelConfig
from moetrain.layers import MoELayer, MoEModelStats, MoEStats, collect_moe_stats, set_aux_loss_scale
from moetrain.moefy import moefy
from moetrain.parallel import ParallelContext

__all__ = [
    "MoEConfig",
    "MoELayer",
    "MoEModelStats",
    "MoEStats",
    "ParallelConfig",
    "ParallelContext",
    "__version__",
    "collect_moe_stats",
    "moefy",
    "set_aux_loss_scale",
]
