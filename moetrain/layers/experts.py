"""Experts stored as stacked weights and run as one GEMM per expert over contiguous row blocks.

Legend: N routed rows in expert order, D model dim, F ffn hidden dim, E local experts.
``w1_EDF`` is ``[E, D, F]`` (``[E, D, 2F]`` for SwiGLU: gate then up projection), ``w2_EFD`` is
``[E, F, D]``. Expert e owns rows ``[offsets[e], offsets[e+1])`` of ``x_ND``; only those rows are
multiplied, so skewed routing never pays for padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _row_offsets(rows_per_expert: list[int]) -> list[int]:
    offsets = [0]
    for count in rows_per_expert:
        offsets.append(offsets[-1] + count)
    return offsets


class _GroupedMatmul(torch.autograd.Function):
    """``out[rows_e] = x[rows_e] @ w[e]`` for each expert e; backward computes
    ``grad_x[rows_e] = grad[rows_e] @ w[e]^T`` and ``grad_w[e] = x[rows_e]^T @ grad[rows_e]`` straight
    into the stacked gradient (no per-expert full-size zero tensors)."""

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, w_EIO: torch.Tensor, offsets: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x_NI, w_EIO)
        ctx.offsets = offsets
        out_NO = x_NI.new_empty(x_NI.shape[0], w_EIO.shape[2])
        for e in range(w_EIO.shape[0]):
            start, end = offsets[e], offsets[e + 1]
            if end > start:
                torch.mm(x_NI[start:end], w_EIO[e], out=out_NO[start:end])
        return out_NO

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        x_NI, w_EIO = ctx.saved_tensors
        offsets = ctx.offsets
        grad_NO = grad_NO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = x_NI.new_empty(x_NI.shape)
        if ctx.needs_input_grad[1]:
            grad_w = w_EIO.new_empty(w_EIO.shape)
        for e in range(w_EIO.shape[0]):
            start, end = offsets[e], offsets[e + 1]
            if grad_x is not None and end > start:
                torch.mm(grad_NO[start:end], w_EIO[e].t(), out=grad_x[start:end])
            if grad_w is not None:
                if end > start:
                    torch.mm(x_NI[start:end].t(), grad_NO[start:end], out=grad_w[e])
                else:
                    grad_w[e].zero_()
        return grad_x, grad_w, None


def grouped_matmul(x_NI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
    """Per-expert GEMM over contiguous row blocks: ``out[rows_e] = x[rows_e] @ w[e]``."""
    if sum(rows_per_expert) != x_NI.shape[0] or len(rows_per_expert) != w_EIO.shape[0]:
        raise ValueError(
            f"rows_per_expert {rows_per_expert} must have {w_EIO.shape[0]} entries summing to the "
            f"{x_NI.shape[0]} rows of x"
        )
    return _GroupedMatmul.apply(x_NI.contiguous(), w_EIO, _row_offsets(rows_per_expert))


def apply_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """relu / gelu (tanh-free, exact) / swiglu (``silu(h[:, :F]) * h[:, F:]``)."""
    if activation == "relu":
        return F.relu(h)
    if activation == "gelu":
        return F.gelu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class GroupedExperts(nn.Module):
    """E feed-forward experts ``y = act(x @ w1[e]) @ w2[e]`` stored as stacked weights.

    Under expert parallelism a rank holds the ``num_experts`` experts starting at global index
    ``first_expert``. Each expert is initialised from its own generator seeded with
    ``seed + global index``, so an expert's initial weights do not depend on the parallel layout.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: str,
        first_expert: int = 0,
        seed: int | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.activation = activation
        inner = 2 * d_ff if activation == "swiglu" else d_ff
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, d_model, inner))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s default per expert: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
        if self.w1_EDF.device.type == "meta":
            return
        for local in range(self.num_experts):
            generator = torch.Generator().manual_seed(self.seed + self.first_expert + local)
            for weight in (self.w1_EDF, self.w2_EFD):
                bound = 1.0 / math.sqrt(weight.shape[1])
                values = torch.empty(weight.shape[1:]).uniform_(-bound, bound, generator=generator)
                weight[local].copy_(values)

    def forward(self, x_ND: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        dtype = x_ND.dtype
        h_NF = grouped_matmul(x_ND, self.w1_EDF.to(dtype), rows_per_expert)
        return grouped_matmul(apply_activation(h_NF, self.activation), self.w2_EFD.to(dtype), rows_per_expert)


class DenseFFN(nn.Module):
    """A plain FFN ``act(x @ w1) @ w2`` (the shared expert, and the dense layer MoE replaces)."""

    def __init__(self, d_model: int, d_ff: int, activation: str):
        super().__init__()
        self.activation = activation
        inner = 2 * d_ff if activation == "swiglu" else d_ff
        self.w1_DF = nn.Parameter(torch.empty(d_model, inner))
        self.w2_FD = nn.Parameter(torch.empty(d_ff, d_model))
        for weight in (self.w1_DF, self.w2_FD):
            bound = 1.0 / math.sqrt(weight.shape[0])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        dtype = x_TD.dtype
        return apply_activation(x_TD @ self.w1_DF.to(dtype), self.activation) @ self.w2_FD.to(dtype)
