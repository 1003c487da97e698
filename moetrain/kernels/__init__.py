"""moetrain's ops as torch operators, their torch-native twins, and the choice between them.

- ``torch.ops.moetrain.<op>``: the C++ (CPU) and CUDA kernels of ``csrc/``, registered by the
  extension; :mod:`~moetrain.kernels.registration` adds fake (meta) implementations and autograd.
- :mod:`~moetrain.kernels.native`: the same ops written with torch ops (any device).
- :mod:`~moetrain.kernels.selection`: ``kernels: auto | custom | torch`` and the once-per-process
  check that a CUDA kernel matches its twin before a run trusts it.
- :mod:`~moetrain.kernels.grouped_mm`: the experts' GEMMs with tensor row counts, as operators.
"""

from moetrain.kernels import grouped_mm, native, registration  # noqa: F401  (registers the operators)
from moetrain.kernels.selection import DEVICE_OPS, KERNEL_CHOICES, KernelVerifier, kernel

__all__ = ["DEVICE_OPS", "KERNEL_CHOICES", "KernelVerifier", "kernel"]
