"""Payload precision on the wire: rows are encoded before an all-to-all and decoded on arrival.

- ``None``: sent as they are.
- ``"bf16"``: cast to bfloat16 (fp32's exponent range, 8-bit mantissa): cannot overflow.
- ``"fp16"``: each row divided by a power of two ``2^e`` with ``max|row| / 2^e <= 2^15``, cast to
  float16 and sent with ``e`` in one extra 16-bit column (``csrc/a2a_layout.cpp`` for CPU rows,
  ``csrc/a2a_layout.cu`` for CUDA rows). The scale is exact, so the error is fp16 rounding
  (relative 2^-11) and no finite value overflows.
  Reduced-precision inputs (bf16/fp16 rows) are sent as a plain fp16/bf16 cast.
"""

from __future__ import annotations

import torch

from moetrain._ext import kernels_for

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def encode_rows(x_ND: torch.Tensor, comm_dtype: str | None) -> torch.Tensor:
    """Rows ``[N, D]`` -> the tensor that travels (``[N, D]``, or ``[N, D + 1]`` for scaled fp16)."""
    if comm_dtype is None or x_ND.dtype == WIRE_DTYPES[comm_dtype]:
        return x_ND
    if comm_dtype == "fp16" and x_ND.dtype in (torch.float32, torch.float64):
        kernels = kernels_for(x_ND, "encode_rows(x_ND)")
        return kernels.pack_scaled_fp16(x_ND.contiguous()).view(torch.float16)
    return x_ND.to(WIRE_DTYPES[comm_dtype])


def decode_rows(wire: torch.Tensor, comm_dtype: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_rows` back to ``dtype``."""
    if comm_dtype is None or dtype == WIRE_DTYPES[comm_dtype]:
        return wire
    if comm_dtype == "fp16" and dtype in (torch.float32, torch.float64):
        kernels = kernels_for(wire, "decode_rows(wire)")
        return kernels.unpack_scaled_fp16(wire.contiguous().view(torch.int16), dtype)
    return wire.to(dtype)
