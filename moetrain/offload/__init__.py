"""Optimizer-state offloading: the fused C++ CPU Adam, the offloaded optimizer built on it, and
group-wise stepping of ordinary torch optimizers."""

from moetrain.offload.cpu_adam import CPUAdam
from moetrain.offload.groupwise import GroupwiseApply
from moetrain.offload.optimizer import OffloadOptimizer

__all__ = ["CPUAdam", "GroupwiseApply", "OffloadOptimizer"]
