"""moetrain: Mixture-of-Experts training for PyTorch."""

from moetrain.config import MoEConfig, ParallelConfig
from moetrain.layers import MoELayer, MoEModelStats, MoEStats, collect_moe_stats, set_aux_loss_scale
from moetrain.parallel import ParallelContext

__version__ = "0.1.0"

__all__ = [
    "MoEConfig",
    "MoELayer",
    "MoEModelStats",
    "MoEStats",
    "ParallelConfig",
    "ParallelContext",
    "__version__",
    "collect_moe_stats",
    "set_aux_loss_scale",
]
