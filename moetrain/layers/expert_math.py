"""The experts' FFN math in phases, computed so that each row's result does not depend on which
other rows share the call: the same bits whether a row is computed with all of its expert's rows
(the unchunked layer) or with a chunk of them (``a2a_chunks > 1``, :mod:`moetrain.layers.overlap`).

Legend: N rows in expert order (expert e owns ``[offsets[e], offsets[e+1])``), D model dim, F hidden
dim (``F2 = 2F`` for SwiGLU's gate and up projections), E local experts, P padded rows.

Why this is needed (measured on the CPU, torch 2.13 with MKL, fp32 and fp64): a GEMM computes its
rows in groups of 4; the last partial group of a call goes through other kernels, whose sums differ
in the last bits (fp64 at every row count, fp32 below 12 rows). And torch's elementwise CPU kernels
run vectors of ``2 * Vec::size()`` elements over each thread's share of the tensor and a scalar loop
over its remainder, whose ``erf``/``exp``/``tanh`` differ from the vector ones in the last bits
(gelu in fp64, silu and tanh-gelu in fp32 and fp64). So:

- :func:`grouped_mm_into` computes every row inside a full group of :data:`ROW_GROUP` rows: an
  expert's call covers its rows rounded up to a multiple of 4 when the buffers hold those rows
  (the extra rows belong to the next expert, which is computed after it and overwrites them, or to
  the padding), else its last partial group goes through a zero-padded group of 4.
- activations run on buffers of :func:`padded_rows` rows, whose element count splits into whole
  vector blocks for every thread (:func:`vector_aligned_rows`); the padding rows are sliced away.
- weight gradients are summed over all of an expert's rows in one GEMM, in the unchunked row order
  (a sum split by chunks would round differently).

Rows are row-stable this way when ``D`` and ``F`` are multiples of 4 (with rows of other widths the
GEMM's result also depends on each row's address alignment); ``tests/unit/layers/test_expert_math.py`` checks
the property for every activation in fp32 and fp64 and fails if a torch or MKL update breaks it.
On CUDA, cuBLAS picks its kernel by the row count, so chunked and unchunked results there may differ
in the last bits; the padding costs nothing that matters there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_GROUP = 4  # rows a CPU GEMM kernel computes together
_VECTOR_ELEMENTS = 64  # a multiple of 2 * Vec::size() for every dtype and CPU capability
_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: elements below which an elementwise op runs on one thread
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")


def row_offsets(rows_per_expert: list[int]) -> list[int]:
    """``[0, r0, r0 + r1, ...]``: where each expert's rows start (and the total at the end)."""
    offsets = [0]
    for count in rows_per_expert:
        offsets.append(offsets[-1] + count)
    return offsets


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def vector_aligned_rows(rows: int, width: int, threads: int | None = None) -> int:
    """The fewest rows ``>= rows`` whose ``rows * width`` elements an elementwise CPU kernel runs
    entirely through its vector loop: the count and each thread's share (``ceil(n / threads)``, with
    ``threads = min(torch threads, ceil(n / 32768))``, as ``at::parallel_for`` splits it) are
    multiples of 64 elements."""
    threads = torch.get_num_threads() if threads is None else threads
    if width == 0:
        return rows
    padded = rows
    while True:
        n = padded * width
        if n % _VECTOR_ELEMENTS == 0:
            used = 1 if n < _GRAIN_SIZE or threads == 1 else min(threads, -(-n // _GRAIN_SIZE))
            if -(-n // used) % _VECTOR_ELEMENTS == 0:
                return padded
        padded += 1


def padded_rows(rows: int, width: int) -> int:
    """Rows of a hidden buffer ``[P, width]`` for ``rows`` rows: room for the last expert's whole
    GEMM group, then :func:`vector_aligned_rows`."""
    return vector_aligned_rows(_round_up(rows, ROW_GROUP), width)


def grouped_mm_into(
    out: torch.Tensor, a: torch.Tensor, w_EIO: torch.Tensor, offsets: list[int], transpose_w: bool
) -> torch.Tensor:
    """``out[rows_e] = a[rows_e] @ w[e]`` (``w[e]^T`` when ``transpose_w``) for each expert e, each
    row computed inside a full group of :data:`ROW_GROUP` rows (see the module docstring). Rows of
    ``out`` past an expert's own, up to its rows rounded up to 4, may be overwritten: they belong to
    later experts (computed after it) or to padding."""
    room = min(a.shape[0], out.shape[0])
    for e in range(w_EIO.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if end <= start:
            continue
        weight = w_EIO[e].t() if transpose_w else w_EIO[e]
        stop = start + _round_up(end - start, ROW_GROUP)
        if stop <= room:
            torch.mm(a[start:stop], weight, out=out[start:stop])
            continue
        full = start + (end - start) // ROW_GROUP * ROW_GROUP
        if full > start:
            torch.mm(a[start:full], weight, out=out[start:full])
        group = a.new_zeros(ROW_GROUP, a.shape[1])
        group[: end - full] = a[full:end]
        out[full:end] = torch.mm(group, weight)[: end - full]
    return out


def grouped_weight_grad_(grad_w: torch.Tensor, a: torch.Tensor, g: torch.Tensor, offsets: list[int]):
    """``grad_w[e] = a[rows_e]^T @ g[rows_e]`` in one GEMM per expert; experts without rows get
    zeros."""
    for e in range(grad_w.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if end > start:
            torch.mm(a[start:end].t(), g[start:end], out=grad_w[e])
        else:
            grad_w[e].zero_()
    return grad_w


def grouped_bias_grad(g: torch.Tensor, offsets: list[int], experts: int) -> torch.Tensor:
    """``grad_b[e] = sum of g[rows_e]`` ``[E, width]`` (zeros for experts without rows)."""
    out = g.new_zeros(experts, g.shape[1])
    for e in range(experts):
        start, end = offsets[e], offsets[e + 1]
        if end > start:
            torch.sum(g[start:end], dim=0, out=out[e])
    return out


def _add_bias_(h: torch.Tensor, b_EF: torch.Tensor | None, offsets: list[int]) -> None:
    if b_EF is None:
        return
    for e in range(b_EF.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if end > start:
            h[start:end] += b_EF[e]


@dataclass
class ExpertActivations:
    """What a forward keeps for the backward: the hidden rows ``h_PF2`` (``x @ w1 + b1``), for SwiGLU
    ``silu(gate)`` as ``s_PF``, and the activation ``a_PF``. All ``[P, .]`` with ``P`` padded rows
    (:func:`padded_rows`); the first N are the rows'."""

    h_PF2: torch.Tensor
    a_PF: torch.Tensor | None
    s_PF: torch.Tensor | None = None


def _gate_up(h_PF2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = h_PF2.shape[1] // 2
    return h_PF2[:, :half].contiguous(), h_PF2[:, half:]


def activate(h_PF2: torch.Tensor, activation: str) -> ExpertActivations:
    """``a = act(h)`` on the whole padded buffer (so every element takes the vector path)."""
    if activation == "relu":
        return ExpertActivations(h_PF2, torch.relu(h_PF2))
    if activation == "gelu":
        return ExpertActivations(h_PF2, F.gelu(h_PF2))
    if activation == "gelu_tanh":
        return ExpertActivations(h_PF2, F.gelu(h_PF2, approximate="tanh"))
    gate_PF, up_PF = _gate_up(h_PF2)
    s_PF = F.silu(gate_PF)
    return ExpertActivations(h_PF2, s_PF * up_PF, s_PF)


def activation_backward_(grad_a_PF: torch.Tensor, saved: ExpertActivations, activation: str) -> torch.Tensor:
    """``d loss / d h`` ``[P, F2]`` from ``d loss / d a`` ``[P, F]`` (padded like ``saved``); relu,
    gelu and tanh-gelu write it into ``grad_a_PF``'s buffer (the output aliases the input)."""
    h_PF2 = saved.h_PF2
    if activation == "relu":
        return torch.ops.aten.threshold_backward.grad_input(grad_a_PF, h_PF2, 0.0, grad_input=grad_a_PF)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward.grad_input(grad_a_PF, h_PF2, grad_input=grad_a_PF)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward.grad_input(
            grad_a_PF, h_PF2, approximate="tanh", grad_input=grad_a_PF
        )
    gate_PF, up_PF = _gate_up(h_PF2)
    grad_h_PF2 = torch.empty_like(h_PF2)
    half = gate_PF.shape[1]
    torch.mul(grad_a_PF, saved.s_PF, out=grad_h_PF2[:, half:])  # d/d up = grad_a * silu(gate)
    grad_s_PF = grad_a_PF.mul_(up_PF)
    grad_h_PF2[:, :half] = torch.ops.aten.silu_backward(grad_s_PF, gate_PF)
    return grad_h_PF2


def expert_forward(
    x_ND: torch.Tensor,
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    b1_EF: torch.Tensor | None,
    b2_ED: torch.Tensor | None,
    offsets: list[int],
    activation: str,
) -> tuple[torch.Tensor, ExpertActivations]:
    """``y = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]`` over each expert's rows. Returns ``y_ND`` (a view
    of ``[N + 3, D]`` rows) and what the backward needs."""
    rows = x_ND.shape[0]
    inner = w1_EDF.shape[2]
    h_PF2 = x_ND.new_empty(padded_rows(rows, inner // 2 if activation == "swiglu" else inner), inner)
    h_PF2[rows:].zero_()
    grouped_mm_into(h_PF2, x_ND, w1_EDF, offsets, False)
    _add_bias_(h_PF2, b1_EF, offsets)
    saved = activate(h_PF2, activation)
    y_ND = x_ND.new_empty(_round_up(rows, ROW_GROUP), w2_EFD.shape[2])
    grouped_mm_into(y_ND, saved.a_PF, w2_EFD, offsets, False)
    y_ND = y_ND[:rows]
    _add_bias_(y_ND, b2_ED, offsets)
    return y_ND, saved


def expert_input_grad(
    grad_y_ND: torch.Tensor,
    saved: ExpertActivations,
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    offsets: list[int],
    activation: str,
    need_grad_x: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The backward through the rows: ``(d loss / d x [N, D] or None, d loss / d h [P, F2])``; the
    weights' gradients come from :func:`expert_weight_grads`. Uses ``saved.h_PF2`` (and ``s_PF``
    for SwiGLU), padded to :func:`padded_rows` rows."""
    rows = grad_y_ND.shape[0]
    grad_a_PF = grad_y_ND.new_empty(saved.h_PF2.shape[0], w2_EFD.shape[1])
    grad_a_PF[rows:].zero_()
    grouped_mm_into(grad_a_PF, grad_y_ND, w2_EFD, offsets, True)
    grad_h_PF2 = activation_backward_(grad_a_PF, saved, activation)
    grad_x_ND = None
    if need_grad_x:
        grad_x_ND = grad_y_ND.new_empty(_round_up(rows, ROW_GROUP), w1_EDF.shape[1])
        grad_x_ND = grouped_mm_into(grad_x_ND, grad_h_PF2, w1_EDF, offsets, True)[:rows]
    return grad_x_ND, grad_h_PF2


def expert_weight_grads(
    x_ND: torch.Tensor,
    a_NF: torch.Tensor,
    grad_y_ND: torch.Tensor,
    grad_h_NF2: torch.Tensor,
    offsets: list[int],
    grad_w1_EDF: torch.Tensor | None,
    grad_w2_EFD: torch.Tensor | None,
    bias_grads: tuple[bool, bool] = (False, False),
) -> tuple[torch.Tensor | None, ...]:
    """Writes ``d w1[e] = x_e^T @ dh_e`` into ``grad_w1_EDF`` and ``d w2[e] = a_e^T @ dy_e`` into
    ``grad_w2_EFD`` (either may be None: not needed) and sums the bias gradients when
    ``bias_grads``; rows in the unchunked expert order. Returns ``(dw1, dw2, db1, db2)``."""
    experts = len(offsets) - 1
    rows = x_ND.shape[0]
    grad_h_NF2, a_NF = grad_h_NF2[:rows], a_NF[:rows]
    if grad_w2_EFD is not None:
        grouped_weight_grad_(grad_w2_EFD, a_NF, grad_y_ND, offsets)
    if grad_w1_EDF is not None:
        grouped_weight_grad_(grad_w1_EDF, x_ND, grad_h_NF2, offsets)
    grad_b1 = grouped_bias_grad(grad_h_NF2, offsets, experts) if bias_grads[0] else None
    grad_b2 = grouped_bias_grad(grad_y_ND, offsets, experts) if bias_grads[1] else None
    return grad_w1_EDF, grad_w2_EFD, grad_b1, grad_b2
