"""Experts stored as stacked weights and run as one GEMM per expert over contiguous row blocks.

Legend: N routed rows in expert order, D model dim, F ffn hidden dim, E local experts.
``w1_EDF`` is ``[E, D, F]`` (``[E, D, 2F]`` for SwiGLU: gate then up projection), ``w2_EFD`` is
``[E, F, D]``. Expert e owns rows ``[offsets[e], offsets[e+1])`` of ``x_ND``; only those rows are
multiplied, so skewed routing never pays for padding.

Two paths, same math. Eager runs read the row counts once and use the autograd function here over
:class:`ExpertRowMath`, the row-stable phases of :mod:`moetrain.layers.expert_math` (one GEMM per
expert, in-place activation backward, reused gradient buffers: the speed of
``benchmarks/moe_layer.py``; each row's result independent of the other rows in the call). The
chunked all-to-all (:mod:`moetrain.layers.overlap`) runs the same phases over chunks of rows
(:meth:`GroupedExperts.forward_rows`).
Compiled graphs and the ``meta`` device use the operators of :mod:`moetrain.kernels.grouped_mm`,
whose row counts stay a tensor. Eager CUDA calls that torch's grouped GEMM can take run whichever of
the two measured faster on that GPU for that shape class (:mod:`moetrain.layers.expert_path`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain._torch_compat import storage_use_count
from moetrain.kernels.grouped_mm import uses_torch_grouped_mm
from moetrain.layers import expert_path
from moetrain.layers.expert_math import (
    ExpertActivations,
    expert_forward,
    expert_input_grad,
    expert_weight_grads,
    padded_rows,
    row_offsets,
)


class ReusableGradBuffer:
    """Storage for one CPU weight gradient, reused across steps when nobody else holds it.

    Each backward writes the stacked expert gradient into a fresh tensor object sharing this
    buffer's storage; autograd hands that object to ``param.grad`` without a copy. When the
    previous step's gradient has been released (``zero_grad(set_to_none=True)``), the storage has
    no other owner and is written again, so the ``E*D*F`` floats are not re-allocated and
    re-faulted every step. If anything still references the storage (a kept ``.grad``, gradient
    accumulation, a view held by a reducer) a new buffer is allocated instead, so a live gradient
    is never overwritten. The same test guards torch's own CUDA-graph output reuse.
    """

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def _reusable(self, like: torch.Tensor) -> bool:
        buffer = self._buffer
        if (
            buffer is None
            or buffer.shape != like.shape
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            return False
        # Owners of the storage: self._buffer and the temporary Python storage object below.
        return storage_use_count(buffer.untyped_storage()) <= 2

    def get(self, like: torch.Tensor) -> torch.Tensor:
        if like.device.type != "cpu":  # device allocators cache blocks themselves
            return torch.empty_like(like)
        if not self._reusable(like):
            self._buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
        return self._buffer.view(like.shape)


class ExpertRowMath:
    """The experts' math over rows in expert order (expert e owns rows ``[offsets[e],
    offsets[e+1])``), in the three row-stable phases of :mod:`moetrain.layers.expert_math`: a
    row's result does not depend on the other rows of the call. :meth:`forward` and
    :meth:`input_grad` may run on any subset of each expert's rows (a chunk); :meth:`weight_grads`
    runs once over all rows, in the unchunked order. ``weights`` is ``(w1_EDF, w2_EFD, b1_EF,
    b2_ED)`` in the rows' dtype (biases None without ``bias``; the backward phases use w1 and w2
    only): an argument, so that the autograd function running the phases saves the weights as its
    inputs. Made by :meth:`GroupedExperts.forward_rows`; the module's eager path and the chunked
    exchange (:mod:`moetrain.layers.overlap`) both run it."""

    def __init__(self, activation: str, grad_buffers: tuple[ReusableGradBuffer, ReusableGradBuffer]):
        self.activation, self.grad_buffers = activation, grad_buffers

    def forward(
        self, x_ND: torch.Tensor, weights, offsets: list[int]
    ) -> tuple[torch.Tensor, ExpertActivations]:
        """``y_ND = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]`` and what the backward needs."""
        w1_EDF, w2_EFD, b1_EF, b2_ED = weights
        return expert_forward(x_ND, w1_EDF, w2_EFD, b1_EF, b2_ED, offsets, self.activation)

    def input_grad(
        self, grad_y_ND: torch.Tensor, saved: ExpertActivations, weights, offsets: list[int], need_grad_x=True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(d loss / d x [N, D]`` (None unless ``need_grad_x``), ``d loss / d h [P, F2])``."""
        return expert_input_grad(
            grad_y_ND, saved, weights[0], weights[1], offsets, self.activation, need_grad_x
        )

    def weight_grads(
        self, x_ND, a_NF, grad_y_ND, grad_h_NF2, weights, offsets: list[int], needs: tuple[bool, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """``(dw1, dw2, db1, db2)`` over all rows (``needs``: which of the four; the others None),
        the weights' into the reusable storage."""
        return expert_weight_grads(
            x_ND,
            a_NF,
            grad_y_ND,
            grad_h_NF2,
            offsets,
            self.grad_buffers[0].get(weights[0]) if needs[0] else None,
            self.grad_buffers[1].get(weights[1]) if needs[1] else None,
            (needs[2], needs[3]),
        )

    def new_activations(self, rows: int, weights, like: torch.Tensor) -> ExpertActivations:
        """Empty storage for what :meth:`forward` saves, for ``rows`` rows without padding (a
        caller that computes the rows in chunks keeps them here, :meth:`keep_activations`)."""
        inner, hidden = weights[0].shape[2], weights[1].shape[1]
        h_NF2, a_NF = like.new_empty(rows, inner), like.new_empty(rows, hidden)
        return ExpertActivations(
            h_NF2, a_NF, like.new_empty(rows, hidden) if self.activation == "swiglu" else None
        )

    @staticmethod
    def keep_activations(kept: ExpertActivations, index_R: torch.Tensor, saved: ExpertActivations) -> None:
        """Copies what :meth:`forward` saved for R rows into the rows ``index_R`` of ``kept``."""
        rows = index_R.numel()
        kept.h_PF2.index_copy_(0, index_R, saved.h_PF2[:rows])
        kept.a_PF.index_copy_(0, index_R, saved.a_PF[:rows])
        if kept.s_PF is not None:
            kept.s_PF.index_copy_(0, index_R, saved.s_PF[:rows])

    def chunk_activations(self, kept: ExpertActivations, index_R: torch.Tensor) -> ExpertActivations:
        """What :meth:`input_grad` needs for the rows ``index_R`` of ``kept``, laid out as
        :meth:`forward` saves them (padded rows)."""
        h_NF2 = kept.h_PF2
        width = h_NF2.shape[1] // 2 if self.activation == "swiglu" else h_NF2.shape[1]
        h_PF2 = _gather_padded(h_NF2, index_R, padded_rows(index_R.numel(), width))
        s_PF = None if kept.s_PF is None else _gather_padded(kept.s_PF, index_R, h_PF2.shape[0])
        return ExpertActivations(h_PF2, None, s_PF)


def _gather_padded(full: torch.Tensor, index: torch.Tensor, padded: int) -> torch.Tensor:
    out = full.new_empty(padded, full.shape[1])
    torch.index_select(full, 0, index, out=out[: index.numel()])
    out[index.numel() :].zero_()
    return out


class _ExpertMLP(torch.autograd.Function):
    """``y = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]`` over each expert's rows (biases optional), with
    :class:`ExpertRowMath`. Saves x, h, act(h) (and silu(gate) for SwiGLU), like autograd would; its
    backward writes the activation's gradient into the buffer of ``grad_a`` in place, sparing one
    [N, F] allocation per step."""

    @staticmethod
    def forward(ctx, x_ND, w1_EDF, w2_EFD, b1_EF, b2_ED, offsets, math: ExpertRowMath):
        y_ND, saved = math.forward(x_ND, (w1_EDF, w2_EFD, b1_EF, b2_ED), offsets)
        ctx.save_for_backward(x_ND, w1_EDF, w2_EFD, saved.h_PF2, saved.a_PF, saved.s_PF)
        ctx.offsets, ctx.math = offsets, math
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        x_ND, w1_EDF, w2_EFD, h_PF2, a_PF, s_PF = ctx.saved_tensors
        offsets, math, needs = ctx.offsets, ctx.math, ctx.needs_input_grad
        grad_y_ND = grad_y_ND.contiguous()
        weights = (w1_EDF, w2_EFD, None, None)
        saved = ExpertActivations(h_PF2, a_PF, s_PF)
        grad_x, grad_h_PF2 = math.input_grad(grad_y_ND, saved, weights, offsets, needs[0])
        grads = math.weight_grads(x_ND, a_PF, grad_y_ND, grad_h_PF2, weights, offsets, needs[1:5])
        return grad_x, *grads, None, None


def apply_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """relu / gelu (exact) / gelu_tanh (the tanh approximation) / swiglu
    (``silu(h[:, :F]) * h[:, F:]``)."""
    if activation == "relu":
        return F.relu(h)
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


_EXPERTS_ON_META = contextvars.ContextVar("moetrain_experts_on_meta", default=False)


@contextlib.contextmanager
def experts_on_meta(enabled: bool = True):
    """Within it, :class:`GroupedExperts` are built on ``meta`` (no memory, nothing initialised)
    whatever the surrounding device; everything else is built as usual, and draws on torch's global
    generator exactly as it would outside (the experts' values come from their own per-expert
    generators, never from it). So a model built inside it, sharded (:func:`moetrain.parallelize`)
    and materialised (:func:`moetrain.materialize`, which allocates and initialises only what is on
    ``meta``), equals the model built outside it and sharded, while no process ever holds more than
    its own experts. ``enabled=False`` builds them as usual inside an enclosing one (moefy, whose
    new layers copy a dense FFN into every expert)."""
    token = _EXPERTS_ON_META.set(enabled)
    try:
        yield
    finally:
        _EXPERTS_ON_META.reset(token)


class GroupedExperts(nn.Module):
    """E feed-forward experts ``y = act(x @ w1[e] [+ b1[e]]) @ w2[e] [+ b2[e]]`` stored as stacked
    weights (the biases ``b1_EF``, ``b2_ED`` only with ``bias=True``, initialised to zero).

    Under expert parallelism a rank holds the ``num_experts`` experts starting at global index
    ``first_expert`` of ``total_experts`` (default: ``num_experts``, all of them). Each expert is
    initialised from its own generator seeded with ``seed + global index``, so an expert's initial
    weights do not depend on the parallel layout nor on the device the module was built on (on
    ``meta`` nothing is initialised until :meth:`reset_parameters` runs on the materialised
    module). ``seed`` None: drawn from torch's global CPU generator.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: str,
        first_expert: int = 0,
        seed: int | None = None,
        bias: bool = False,
        total_experts: int | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.total_experts = num_experts if total_experts is None else total_experts
        self.activation = activation
        inner = 2 * d_ff if activation == "swiglu" else d_ff
        with torch.device("meta") if _EXPERTS_ON_META.get() else contextlib.nullcontext():
            self.w1_EDF = nn.Parameter(torch.empty(num_experts, d_model, inner))
            self.b1_EF = nn.Parameter(torch.zeros(num_experts, inner)) if bias else None
            self.b2_ED = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
            self.w2_EFD = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.seed = int(torch.randint(0, 2**62, (), device="cpu")) if seed is None else seed
        self._grad_buffers = (ReusableGradBuffer(), ReusableGradBuffer())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s default per expert: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (biases: 0).
        Weights sharded by FSDP (DTensors over the expert-data-parallel ranks) initialise the
        experts whose rows this rank holds."""
        if self.w1_EDF.device.type == "meta":
            return
        first_row, rows = local_rows(self.w1_EDF)
        weights = [(weight, local_tensor(weight)) for weight in (self.w1_EDF, self.w2_EFD)]
        for row in range(rows):
            generator = torch.Generator().manual_seed(self.seed + self.first_expert + first_row + row)
            for weight, local_weight in weights:
                bound = 1.0 / math.sqrt(weight.shape[1])
                values = torch.empty(weight.shape[1:]).uniform_(-bound, bound, generator=generator)
                local_weight[row].copy_(values)
        for bias in (self.b1_EF, self.b2_ED):
            if bias is not None:
                local_tensor(bias).zero_()

    def slice_experts(self, start: int, stop: int) -> GroupedExperts:
        """A new module holding local experts ``[start, stop)`` of this one (copies of their
        weights; on ``meta``, a ``meta`` module of the same dtypes that :meth:`reset_parameters`
        initialises with the same per-expert seeds)."""
        if not 0 <= start < stop <= self.num_experts:
            raise ValueError(f"expert slice [{start}, {stop}) is outside [0, {self.num_experts})")
        d_model, inner = self.w1_EDF.shape[1:]
        d_ff = self.w2_EFD.shape[1]
        with torch.device("meta"):
            part = GroupedExperts(
                stop - start, d_model, d_ff, self.activation, self.first_expert + start, self.seed,
                self.b1_EF is not None, self.total_experts,
            )  # fmt: skip
        for name, param in self.named_parameters(recurse=False):  # on meta: the dtype, no data
            setattr(part, name, nn.Parameter(param.detach()[start:stop].clone(), param.requires_grad))
        return part

    def forward(self, x_ND: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
        """``x_ND`` rows in expert order, ``rows_per_expert_E`` (int64 ``[E]``) rows per expert ->
        ``y_ND``."""
        dtype = x_ND.dtype
        w1, w2, b1, b2, buffers = self.weights_for(dtype)
        x_ND = x_ND.contiguous()
        if torch.compiler.is_compiling() or x_ND.device.type == "meta":  # a padded plan's rows
            return self._forward_by_operators(x_ND, w1, w2, b1, b2, rows_per_expert_E, padded=True)
        if uses_torch_grouped_mm(x_ND, w1, transpose_w=False) and self._grouped_is_faster(
            x_ND, w1, w2, b1, b2, rows_per_expert_E
        ):
            return self._forward_by_operators(x_ND, w1, w2, b1, b2, rows_per_expert_E, padded=False)
        return self._forward_per_expert(x_ND, w1, w2, b1, b2, rows_per_expert_E, buffers)

    def _forward_per_expert(self, x_ND, w1, w2, b1, b2, rows_per_expert_E, buffers) -> torch.Tensor:
        offsets = row_offsets(rows_per_expert_E.tolist())
        return _ExpertMLP.apply(x_ND, w1, w2, b1, b2, offsets, ExpertRowMath(self.activation, buffers))

    def _forward_by_operators(self, x_ND, w1, w2, b1, b2, rows_per_expert_E, padded: bool) -> torch.Tensor:
        if b1 is not None:
            return self._forward_with_biases(x_ND, w1, w2, b1, b2, rows_per_expert_E, padded)
        grouped_mm = torch.ops.moetrain.grouped_mm
        h_NF = grouped_mm(x_ND, w1, rows_per_expert_E, False, padded)
        return grouped_mm(apply_activation(h_NF, self.activation), w2, rows_per_expert_E, False, padded)

    def _grouped_is_faster(self, x_ND, w1, w2, b1, b2, rows_per_expert_E) -> bool:
        """Whether torch's grouped GEMM beat the per-expert GEMMs for this shape class on this
        device (measured on the first call of the class, on detached copies)."""

        def candidate(grouped: bool):
            def run() -> None:
                x, a, b = (t.detach().requires_grad_() for t in (x_ND, w1, w2))
                biases = (None, None) if b1 is None else (b1.detach(), b2.detach())
                if grouped:
                    y = self._forward_by_operators(x, a, b, *biases, rows_per_expert_E, padded=False)
                else:
                    buffers = (ReusableGradBuffer(), ReusableGradBuffer())
                    y = self._forward_per_expert(x, a, b, *biases, rows_per_expert_E, buffers)
                y.backward(torch.ones_like(y))

            return run

        key = expert_path.shape_class(x_ND, w1, w2, self.activation, b1 is not None)
        candidates = {"grouped": candidate(True), "per_expert": candidate(False)}
        return expert_path.CHOOSER.choose(key, x_ND.device, candidates) == "grouped"

    def forward_rows(self, x_ND: torch.Tensor, compute: Callable) -> torch.Tensor:
        """``compute(x_ND, (w1, w2, b1, b2), math)``: the experts in phases (:class:`ExpertRowMath`
        ``math`` over the weights cast for rows of ``x_ND``'s dtype), for a caller that runs them over
        chunks of rows in one autograd function (the chunked exchange, :mod:`moetrain.layers.overlap`).
        A forward of this module that is not ``forward``: :func:`moetrain.parallelize.parallelize`
        registers it with FSDP2, which gathers sharded weights around it as around ``forward``."""
        w1, w2, b1, b2, buffers = self.weights_for(x_ND.dtype)
        return compute(x_ND, (w1, w2, b1, b2), ExpertRowMath(self.activation, buffers))

    def weights_for(self, dtype: torch.dtype):
        """``(w1, w2, b1, b2, grad_buffers)`` for rows of ``dtype``: the weights cast to it (biases
        None without ``bias``) and the reusable weight-gradient storage, which only the parameters'
        own gradients use (the gradient of a cast copy is converted by autograd; a fresh buffer is a
        plain allocation)."""
        w1, w2 = self.w1_EDF.to(dtype), self.w2_EFD.to(dtype)
        b1 = None if self.b1_EF is None else self.b1_EF.to(dtype)
        b2 = None if self.b2_ED is None else self.b2_ED.to(dtype)
        buffers = self._grad_buffers if w1 is self.w1_EDF else (ReusableGradBuffer(), ReusableGradBuffer())
        return w1, w2, b1, b2, buffers

    def _forward_with_biases(self, x_ND, w1_EDF, w2_EFD, b1_EF, b2_ED, rows_per_expert_E, padded: bool):
        """The operator path plus each row's expert bias, gathered by the row's expert index.

        ``padded`` (a compiled graph's plan): ``x_ND`` may have more rows than
        ``sum(rows_per_expert_E)`` (tokens were dropped); those padding rows, which belong to no
        expert, get zero biases, as if from an extra expert ``E`` whose biases are zeros, so that
        ``repeat_interleave`` fills exactly ``N`` rows. Unpadded: every row has an expert."""
        grouped_mm = torch.ops.moetrain.grouped_mm
        counts_E, rows = rows_per_expert_E, x_ND.shape[0]
        if padded:
            counts_E = torch.cat([counts_E, (rows - counts_E.sum()).reshape(1)])
            b1_EF = torch.cat([b1_EF, b1_EF.new_zeros((1, b1_EF.shape[1]))])
            b2_ED = torch.cat([b2_ED, b2_ED.new_zeros((1, b2_ED.shape[1]))])
        experts_E = torch.arange(counts_E.shape[0], device=x_ND.device)
        expert_N = torch.repeat_interleave(experts_E, counts_E, output_size=rows)
        b1_NF, b2_ND = b1_EF[expert_N], b2_ED[expert_N]
        h_NF = grouped_mm(x_ND, w1_EDF, rows_per_expert_E, False, padded) + b1_NF
        a_NF = apply_activation(h_NF, self.activation)
        return grouped_mm(a_NF, w2_EFD, rows_per_expert_E, False, padded) + b2_ND


def derive_seed(seed: int, name: str) -> int:
    """A seed in ``[0, 2**62)`` for the module ``name`` of a model built with seed ``seed``: the
    first 62 bits of ``sha256(f"{seed}/{name}")``, so every layer's experts get their own seeds,
    the same on every rank and device."""
    import hashlib

    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard (the same storage), else
    the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """``(first row, row count)`` of dim 0 that this rank holds: everything for a plain tensor; for
    a DTensor sharded on dim 0 over one mesh dimension (FSDP2), the chunk ``torch.chunk`` gives
    this rank: ``ceil(n / shards)`` rows per rank, the last ranks possibly fewer or none."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    rows = tensor.shape[0]
    first = 0
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(
                    f"expert weights must be sharded on dim 0, got placements {tensor.placements}"
                )
            shards = tensor.device_mesh.size(dim)
            per_shard = -(-rows // shards)
            index = tensor.device_mesh.get_local_rank(dim)
            first = min(index * per_shard, rows)
            rows = min(first + per_shard, rows) - first
    return first, rows


class DenseFFN(nn.Module):
    """A plain FFN ``act(x @ w1) @ w2`` (the shared expert, and the dense layer MoE replaces)."""

    def __init__(self, d_model: int, d_ff: int, activation: str):
        super().__init__()
        self.activation = activation
        inner = 2 * d_ff if activation == "swiglu" else d_ff
        self.w1_DF = nn.Parameter(torch.empty(d_model, inner))
        self.w2_FD = nn.Parameter(torch.empty(d_ff, d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` per matrix."""
        for weight in (self.w1_DF, self.w2_FD):
            bound = 1.0 / math.sqrt(weight.shape[0])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        dtype = x_TD.dtype
        return apply_activation(x_TD @ self.w1_DF.to(dtype), self.activation) @ self.w2_FD.to(dtype)
