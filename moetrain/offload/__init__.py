"""Optimizer-state offloading: the fused C++ CPU Adam and the offloaded optimizer built on it."""

from moetrain.offload.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
