"""Per-expert GEMMs over contiguous row blocks whose sizes are a tensor, as operators.

Legend: N rows in expert order, I/O the GEMM's input/output width, E experts; expert e owns rows
``[sum(counts[:e]), sum(counts[:e+1]))``; rows after ``sum(counts)`` (a padded plan's) belong to
no expert and come out as zeros.

- ``moetrain::grouped_mm(x, w, counts, transpose_w, padded)``: ``out[rows_e] = x[rows_e] @ w[e]``
  (``w[e]^T`` when ``transpose_w``), ``w`` is ``[E, I, O]`` (``[E, O, I]`` transposed);
  ``padded=False`` promises that ``x`` has exactly ``sum(counts)`` rows (an eager call's plan), so
  torch's grouped GEMM result needs no pass over the whole output to zero rows no expert owns;
- ``moetrain::grouped_mm_weight_grad(a, b, counts)``: ``out[e] = a[rows_e]^T @ b[rows_e]``, zeros
  for experts without rows (on CUDA bf16, torch's grouped GEMM in its 2-D x 2-D form, where the
  row dimension is split by the offsets; else the loop).

The row counts stay a tensor, so a compiled graph has no data-dependent Python: the loop over
experts (which reads the counts) runs inside the op. On CUDA, bf16 operands whose rows are 16-byte
multiples go through torch's grouped GEMM (:func:`moetrain._torch_compat.grouped_mm`, one kernel
for all experts); everything else takes the loop of ``torch.mm``. On the CPU the loop is as fast as
torch's grouped GEMM forward (``benchmarks/grouped_mm.py``), which has no CPU backward.
"""

from __future__ import annotations

import torch

from moetrain import _torch_compat


def uses_torch_grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, transpose_w: bool) -> bool:
    """Whether torch's grouped GEMM takes this call: CUDA, bf16 operands, row sizes that are
    multiples of 16 bytes (8 bf16 values), a GPU of compute capability >= 8.0 and a torch that has
    the kernel. Everything else runs the per-expert loop."""
    return _torch_grouped_gemm_takes((x_NI, w_EIO), (x_NI.shape[1], w_EIO.shape[1], w_EIO.shape[2]))


def uses_torch_grouped_weight_grad(a_NA: torch.Tensor, b_NB: torch.Tensor) -> bool:
    """The weight gradient's counterpart of :func:`uses_torch_grouped_mm`: the same conditions on
    ``a`` and ``b`` and their widths (16-byte strides of ``a^T`` and ``b``)."""
    return _torch_grouped_gemm_takes((a_NA, b_NB), (a_NA.shape[1], b_NB.shape[1]))


def _torch_grouped_gemm_takes(operands: tuple[torch.Tensor, ...], widths: tuple[int, ...]) -> bool:
    if not (operands[0].is_cuda and all(t.dtype == torch.bfloat16 for t in operands)):
        return False
    if not _torch_compat.grouped_mm_available() or any(width % 8 for width in widths):
        return False
    return torch.cuda.get_device_capability(operands[0].device) >= (8, 0)


def _int32_offsets(counts_E: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each expert's end row, ``cumsum(counts)``, as the int32 device tensor torch's kernel takes."""
    return torch.cumsum(counts_E.to(device=device), 0).to(torch.int32)


def _offsets(counts_E: torch.Tensor) -> list[int]:
    offsets = [0]
    for count in counts_E.tolist():
        offsets.append(offsets[-1] + count)
    return offsets


def loop_grouped_mm(x_NI, w_EIO, counts_E, transpose_w: bool) -> torch.Tensor:
    offsets = _offsets(counts_E)
    width = w_EIO.shape[1] if transpose_w else w_EIO.shape[2]
    out_NO = x_NI.new_empty((x_NI.shape[0], width))
    out_NO[offsets[-1] :].zero_()
    for e in range(w_EIO.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if end > start:
            torch.mm(x_NI[start:end], w_EIO[e].t() if transpose_w else w_EIO[e], out=out_NO[start:end])
    return out_NO


def torch_grouped_mm(x_NI, w_EIO, counts_E, transpose_w: bool, padded: bool) -> torch.Tensor:
    """torch's grouped GEMM (one kernel for every expert); rows after ``sum(counts)`` are zeroed
    only for a ``padded`` plan (torch leaves them unwritten)."""
    weights = w_EIO.transpose(1, 2) if transpose_w else w_EIO
    offsets_E = _int32_offsets(counts_E, x_NI.device)
    out_NO = _torch_compat.grouped_mm(x_NI, weights, offsets_E)
    if padded:
        beyond_N1 = torch.arange(x_NI.shape[0], device=x_NI.device).unsqueeze(1) >= offsets_E[-1:]
        out_NO.masked_fill_(beyond_N1, 0)
    return out_NO


@torch.library.custom_op("moetrain::grouped_mm", mutates_args=())
def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, transpose_w: bool, padded: bool = True
) -> torch.Tensor:
    if uses_torch_grouped_mm(x, w, transpose_w):
        return torch_grouped_mm(x, w, counts, transpose_w, padded)
    return loop_grouped_mm(x, w, counts, transpose_w)


@grouped_mm.register_fake
def _(x, w, counts, transpose_w, padded=True):
    torch._check(x.dim() == 2 and w.dim() == 3, lambda: "grouped_mm takes x [N, I] and w [E, I, O]")
    return x.new_empty((x.shape[0], w.shape[1] if transpose_w else w.shape[2]))


def torch_grouped_weight_grad(a_NA, b_NB, counts_E) -> torch.Tensor:
    """``out[e] = a[rows_e]^T @ b[rows_e]`` as one grouped GEMM. An expert without rows gets zeros:
    where the kernel is not known to write them (:func:`empty_groups_come_out_zero`), they are
    written here, after one host check whether any expert is empty."""
    offsets_E = _int32_offsets(counts_E, a_NA.device)
    out_EAB = _torch_compat.grouped_mm(a_NA.t(), b_NB, offsets_E)
    if not empty_groups_come_out_zero(a_NA.device):
        empty_E = counts_E == 0
        if bool(empty_E.any()):
            out_EAB.masked_fill_(empty_E.to(out_EAB.device).view(-1, 1, 1), 0)
    return out_EAB


_EMPTY_GROUPS_ZERO: dict[str, bool] = {}


def empty_groups_come_out_zero(device: torch.device) -> bool:
    """Whether torch's 2-D x 2-D grouped GEMM writes zeros for a group of zero rows on ``device``
    (Hopper's kernel does; others have been seen to leave the block unwritten: pytorch issue
    172439). Measured once per device: the output takes the block of a just-freed tensor of its
    size filled with NaN, so an unwritten group shows NaN. Where the output lands elsewhere, or on
    a device other than CUDA, the answer is False (the caller zeroes)."""
    key = str(device)
    if key not in _EMPTY_GROUPS_ZERO:
        _EMPTY_GROUPS_ZERO[key] = device.type == "cuda" and _probe_empty_group(device)
    return _EMPTY_GROUPS_ZERO[key]


def _probe_empty_group(device: torch.device) -> bool:
    a_NA = torch.ones(32, 16, dtype=torch.bfloat16, device=device)
    offsets_E = torch.tensor([0, 32], dtype=torch.int32, device=device)
    answers = []
    for _ in range(2):
        poison = torch.full((2, 16, 16), float("nan"), dtype=torch.bfloat16, device=device)
        block = poison.data_ptr()
        del poison
        out_EAB = _torch_compat.grouped_mm(a_NA.t(), a_NA, offsets_E)
        answers.append(out_EAB.data_ptr() == block and bool((out_EAB[0] == 0).all()))
    return all(answers)


def loop_weight_grad(a_NA, b_NB, counts_E) -> torch.Tensor:
    offsets = _offsets(counts_E)
    out_EAB = a_NA.new_empty((counts_E.shape[0], a_NA.shape[1], b_NB.shape[1]))
    for e in range(counts_E.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if end > start:
            torch.mm(a_NA[start:end].t(), b_NB[start:end], out=out_EAB[e])
        else:
            out_EAB[e].zero_()
    return out_EAB


@torch.library.custom_op("moetrain::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if uses_torch_grouped_weight_grad(a, b):
        return torch_grouped_weight_grad(a.contiguous(), b.contiguous(), counts)
    return loop_weight_grad(a, b, counts)


@grouped_mm_weight_grad.register_fake
def _(a, b, counts):
    return a.new_empty((counts.shape[0], a.shape[1], b.shape[1]))


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts, transpose_w, padded = inputs
    ctx.transpose_w, ctx.padded = transpose_w, padded
    ctx.save_for_backward(x, w, counts)


def _grouped_mm_backward(ctx, grad_NO):
    x, w, counts = ctx.saved_tensors
    grad_NO = grad_NO.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.moetrain.grouped_mm(grad_NO, w, counts, not ctx.transpose_w, ctx.padded)
    if ctx.needs_input_grad[1]:
        if ctx.transpose_w:  # out = x @ w^T: d w[e] = grad^T @ x
            grad_w = torch.ops.moetrain.grouped_mm_weight_grad(grad_NO, x, counts)
        else:
            grad_w = torch.ops.moetrain.grouped_mm_weight_grad(x, grad_NO, counts)
    return grad_x, grad_w, None, None, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _weight_grad_setup(ctx, inputs, output):
    a, b, counts = inputs
    ctx.save_for_backward(a, b, counts)


def _weight_grad_backward(ctx, grad_EAB):
    a, b, counts = ctx.saved_tensors  # out[e] = a_e^T b_e: d a_e = b_e grad[e]^T, d b_e = a_e grad[e]
    grad_EAB = grad_EAB.contiguous()
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.moetrain.grouped_mm(b, grad_EAB, counts, True)
    if ctx.needs_input_grad[1]:
        grad_b = torch.ops.moetrain.grouped_mm(a, grad_EAB, counts, False)
    return grad_a, grad_b, None


grouped_mm_weight_grad.register_autograd(_weight_grad_backward, setup_context=_weight_grad_setup)
