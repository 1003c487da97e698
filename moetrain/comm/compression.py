"""Payload precision on the wire: rows are encoded before an all-to-all and decoded on arrival.

- ``None``: sent as they are.
- ``"bf16"``: cast to bfloat16 (fp32's exponent range, 8-bit mantissa): overflows only above bf16's
  largest value (3.39e38, a hair below fp32's 3.40e38).
- ``"fp16"``: each row divided by a power of two ``2^e`` with ``max|row| / 2^e <= 2^15``, cast to
  float16 and sent with ``e`` in one extra 16-bit column (the ``pack_scaled_fp16`` op of
  :mod:`moetrain.kernels`: ``csrc/a2a_layout.cpp`` for CPU rows, ``csrc/a2a_layout_cuda.cu`` for CUDA
  rows, or the frexp/ldexp twin, as ``kernels`` selects). The scale is exact, so the error is fp16
  rounding of ``x / 2^e``: relative 2^-11 (values more than ~2^28 times smaller than the row's
  largest fall below fp16's normal range: they lose bits or flush to zero), and no value of a
  finite row overflows. ``e`` stops at -1000 (``2^-e`` stays a finite fp64), which only fp64 rows
  reach (largest magnitude at most 2^-986, ~1.5e-297): their values keep the relative 2^-11 down
  to 2^-1014 (~5.7e-306), are fp16 subnormals below it (absolute error at most 2^-1025) and
  arrive as zeros at 2^-1025 (~2.8e-309) and below. A row holding +-inf is sent unscaled, so its
  other values above 65504 arrive as inf too (the row is non-finite already: a loss-scaled step
  skips it). bf16 rows (whose range fp16 lacks) are widened to fp32 first and packed the same
  way, so ``comm_dtype="fp16"`` never overflows whatever the activation dtype.
- fp16 rows with ``"bf16"`` are cast (the mantissa loses 3 bits); bf16 rounds values above 65408 up
  to 2^16, past fp16's largest value 65504, so on arrival those saturate to +-65504.
"""

from __future__ import annotations

import torch

from moetrain.kernels import kernel
from moetrain.validation import require_choice

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _wire_dtype(comm_dtype: str) -> torch.dtype:
    """The dtype of a wire name; ``ValueError`` naming the allowed ones for any other value."""
    require_choice("comm_dtype", comm_dtype, (None, *WIRE_DTYPES))
    return WIRE_DTYPES[comm_dtype]


def encode_rows(x_ND: torch.Tensor, comm_dtype: str | None, kernels: str = "auto") -> torch.Tensor:
    """Rows ``[N, D]`` -> the tensor that travels (``[N, D]``, or ``[N, D + 1]`` for scaled fp16)."""
    if comm_dtype is None or x_ND.dtype == _wire_dtype(comm_dtype):
        return x_ND
    if comm_dtype == "fp16":
        if x_ND.dtype == torch.bfloat16:
            x_ND = x_ND.float()
        return kernel("pack_scaled_fp16", x_ND.device, kernels)(x_ND.contiguous()).view(torch.float16)
    return x_ND.to(WIRE_DTYPES[comm_dtype])


def decode_rows(
    wire: torch.Tensor, comm_dtype: str | None, dtype: torch.dtype, kernels: str = "auto"
) -> torch.Tensor:
    """Inverse of :func:`encode_rows` back to ``dtype``."""
    if comm_dtype is None or dtype == _wire_dtype(comm_dtype):
        return wire
    if dtype == torch.float16:  # a bf16 wire: values rounded up to 2^16 saturate, inf stays inf
        wide = wire.float()  # 65504 is not a bf16 value
        return torch.where(wide.abs() == 2.0**16, wide.sign() * 65504.0, wide).to(dtype)
    if comm_dtype == "fp16":
        unpack = kernel("unpack_scaled_fp16", wire.device, kernels)
        unpack_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        return unpack(wire.contiguous().view(torch.int16), unpack_dtype).to(dtype)
    return wire.to(dtype)


def wire_row_bytes(width: int, dtype: torch.dtype, comm_dtype: str | None) -> int:
    """Bytes one row of ``width`` values of ``dtype`` takes on the wire: as it is, 2 per value for a
    bf16 wire, ``2 * (width + 1)`` for the scaled fp16 wire (its exponent column) unless the rows
    are fp16 already."""
    if comm_dtype is None or dtype == _wire_dtype(comm_dtype):
        return width * dtype.itemsize
    return 2 * (width + 1) if comm_dtype == "fp16" else 2 * width
