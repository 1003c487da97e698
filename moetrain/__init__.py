"""moetrain: Mixture-of-Experts training for PyTorch."""

from moetrain.config import MoEConfig
from moetrain.layers import MoELayer, MoEModelStats, MoEStats, collect_moe_stats

__version__ = "0.1.0"

__all__ = ["MoEConfig", "MoELayer", "MoEModelStats", "MoEStats", "__version__", "collect_moe_stats"]
