"""What torch needs besides the C++ kernels to treat ``torch.ops.moetrain.*`` as real operators:
fake implementations (shapes and dtypes without data: ``torch.compile``, FakeTensor, the ``meta``
device), autograd formulas, and the kernels that are torch-native (``build_dispatch_plan`` on CUDA,
``sort_dispatch_plan`` everywhere). Imported once by :mod:`moetrain.kernels`.

Autograd formulas (S = T*K slots, N rows, ``inv`` = :func:`~moetrain.kernels.native.inverse_index`):

- ``permute_rows(x, slot_of_row, k, w)``: ``dx = unpermute_rows(g, row_of_slot, w)`` and
  ``dw = unpermute_weight_grad(x, g, row_of_slot)`` with ``row_of_slot = inv(slot_of_row, S)``;
- ``unpermute_rows(y, row_of_slot, w)``: ``dy = permute_rows(g, inv(row_of_slot, N), k, w)`` (rows
  no slot uses get zeros) and ``dw = unpermute_weight_grad(g, y, row_of_slot)``;
- ``unpermute_weight_grad(grad, y, row_of_slot)``: ``dgrad = unpermute_rows(y, row_of_slot, g)``,
  ``dy = permute_rows(grad, inv(row_of_slot, N), k, g)``;
- ``transpose_chunks(x, sizes)``: ``dx = transpose_chunks(g, sizes^T)``.

The index inversions are O(S) integer scatters on the device, small next to the row movement.
The index tensors are kept on the autograd context, not saved with ``save_for_backward``: they
belong to the dispatch plan, which lives with the graph either way (an activation checkpoint
recomputes rows, not plans), so saved-tensor hooks see the same tensors as before the operators
existed (``moetrain.recompute`` and the planner count them separately).
"""

from __future__ import annotations

import torch

from moetrain import _ext  # loads the compiled extension, which defines the operators
from moetrain.kernels import native

# The operators csrc/bindings.cpp defines, as torch prints their schemas (a test compares them with
# the extension's); defined here only when no extension could be built (``_ext.EXTENSION``).
SCHEMAS = {
    "build_dispatch_plan": "build_dispatch_plan(Tensor expert_ids, Tensor? priority_order, "
    "SymInt num_experts, SymInt capacity, SymInt? num_rows=None) -> (Tensor row_of_slot, "
    "Tensor slot_of_row, Tensor kept_counts, Tensor routed_counts)",
    "permute_rows": "permute_rows(Tensor x, Tensor slot_of_row, int k, Tensor? weights) -> Tensor",
    "unpermute_rows": "unpermute_rows(Tensor y, Tensor row_of_slot, Tensor? weights) -> Tensor",
    "unpermute_weight_grad": "unpermute_weight_grad(Tensor grad, Tensor y, Tensor row_of_slot) -> Tensor",
    "transpose_chunks": "transpose_chunks(Tensor x, Tensor sizes) -> Tensor",
    "pack_scaled_fp16": "pack_scaled_fp16(Tensor x) -> Tensor",
    "unpack_scaled_fp16": "unpack_scaled_fp16(Tensor packed, ScalarType dtype) -> Tensor",
    "adam_step_": "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, *, "
    "int step, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw, "
    "float grad_scale=1., Tensor(d!)? param_copy_out=None) -> ()",
    "adam_step_multi_": "adam_step_multi_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, *, int[] steps, float lr, float beta1, float beta2, float eps, "
    "float weight_decay, bool adamw, float grad_scale, Tensor(d!)[] param_copies_out, "
    "int[] copy_index) -> ()",
    "adam_memory_probe_": "adam_memory_probe_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, "
    "Tensor(c!) exp_avg_sq, Tensor(d!)? param_copy_out=None) -> ()",
}


def _define_torch_native_operators() -> torch.library.Library:
    """The operators with the twins as their kernels on every device (``CompositeExplicitAutograd``;
    the Meta, CUDA and autograd registrations below apply on top, as with the extension)."""
    library = torch.library.Library("moetrain", "DEF")
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, native.NATIVE_OPS[name], "CompositeExplicitAutograd")
    return library


_NATIVE_DEFINITIONS = _define_torch_native_operators() if _ext.EXTENSION == "torch-native" else None
_LIBRARY = torch.library.Library("moetrain", "FRAGMENT")  # kept alive: holds the Python kernels
# ``register_fake`` also serves the Meta key on torch 2.11 (not on 2.13); the Meta kernels below
# replace it there, so ``allow_override=True`` (the default on 2.13) is spelled out.


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------
# Dispatch plan: N (kept rows) depends on the data.
# ------------------------------------------------------------------------------------------------


def _plan_outputs(expert_ids_TK, num_experts, rows):
    tokens, k = expert_ids_TK.shape
    return (
        expert_ids_TK.new_empty((tokens, k)),
        expert_ids_TK.new_empty((rows,)),
        expert_ids_TK.new_empty((num_experts,)),
        expert_ids_TK.new_empty((num_experts,)),
    )


def _plan_fake(expert_ids_TK, priority_order_S, num_experts, capacity, num_rows=None):
    """With ``num_rows`` (what compiled code passes) the shapes are static; without it the row
    count is an unbacked size, which ``torch.compile`` accepts only with
    ``torch._dynamo.config.capture_dynamic_output_shape_ops``."""
    torch._check(expert_ids_TK.dim() == 2, lambda: "expert_ids must be 2-D [tokens, k]")
    if num_rows is None:
        tokens, k = expert_ids_TK.shape
        num_rows = torch.library.get_ctx().new_dynamic_size(
            max=tokens * k if isinstance(tokens * k, int) else None
        )
    return _plan_outputs(expert_ids_TK, num_experts, num_rows)


def most_kept_rows(tokens: int, k: int, num_experts: int, capacity: int) -> int:
    """The most rows a plan can keep: every slot when dropless (``capacity < 0``), else
    ``min(T*K, E*capacity)``."""
    return tokens * k if capacity < 0 else min(tokens * k, num_experts * capacity)


def _plan_meta(expert_ids_TK, priority_order_S, num_experts, capacity, num_rows=None):
    """On ``meta`` there is no routing to count: the plan keeps the most rows it could (the
    memory a planner must budget), or ``num_rows``."""
    tokens, k = expert_ids_TK.shape
    rows = most_kept_rows(tokens, k, num_experts, capacity) if num_rows is None else num_rows
    return _plan_outputs(expert_ids_TK, num_experts, rows)


torch.library.register_fake("moetrain::build_dispatch_plan", _plan_fake)
_LIBRARY.impl("build_dispatch_plan", _plan_meta, "Meta", allow_override=True)
# csrc/ has no CUDA counting sort: on CUDA the op is the torch-native stable-sort plan.
_LIBRARY.impl("build_dispatch_plan", native.build_dispatch_plan, "CUDA")


@torch.library.custom_op("moetrain::sort_dispatch_plan", mutates_args=())
def sort_dispatch_plan(
    expert_ids: torch.Tensor,
    priority_order: torch.Tensor | None,
    num_experts: int,
    capacity: int,
    num_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch-native plan (:func:`moetrain.kernels.native.build_dispatch_plan`) as an operator
    on every device, so that its host synchronisation is one opaque step in a compiled graph."""
    return native.build_dispatch_plan(expert_ids, priority_order, num_experts, capacity, num_rows)


sort_dispatch_plan.register_fake(_plan_fake)
_LIBRARY.impl("sort_dispatch_plan", _plan_meta, "Meta", allow_override=True)


# ------------------------------------------------------------------------------------------------
# Row movement.
# ------------------------------------------------------------------------------------------------


@torch.library.register_fake("moetrain::permute_rows")
def _permute_rows_fake(x_TD, slot_of_row_N, k, weights_S):
    torch._check(x_TD.dim() == 2, lambda: "x must be 2-D [tokens, hidden]")
    return x_TD.new_empty((slot_of_row_N.shape[0], x_TD.shape[1]))


@torch.library.register_fake("moetrain::unpermute_rows")
def _unpermute_rows_fake(y_ND, row_of_slot_TK, weights_TK):
    torch._check(y_ND.dim() == 2, lambda: "y must be 2-D [rows, hidden]")
    return y_ND.new_empty((row_of_slot_TK.shape[0], y_ND.shape[1]))


@torch.library.register_fake("moetrain::unpermute_weight_grad")
def _unpermute_weight_grad_fake(grad_TD, y_ND, row_of_slot_TK):
    return grad_TD.new_empty(tuple(row_of_slot_TK.shape), dtype=_accumulate_dtype(grad_TD.dtype))


def _row_of_slot(slot_of_row_N, tokens, k):
    return native.inverse_index(slot_of_row_N, tokens * k).view(tokens, k)


def _permute_rows_setup(ctx, inputs, output):
    x_TD, slot_of_row_N, k, weights_S = inputs
    ctx.k = k
    ctx.has_weights = weights_S is not None
    ctx.save_for_backward(x_TD if ctx.has_weights else None, weights_S)
    ctx.slot_of_row_N = slot_of_row_N
    ctx.tokens = x_TD.shape[0]


def _permute_rows_backward(ctx, grad_ND):
    x_TD, weights_S = ctx.saved_tensors
    row_of_slot_TK = _row_of_slot(ctx.slot_of_row_N, ctx.tokens, ctx.k)
    grad_ND = grad_ND.contiguous()
    weights_TK = None if weights_S is None else weights_S.view(ctx.tokens, ctx.k)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.moetrain.unpermute_rows(grad_ND, row_of_slot_TK, weights_TK)
    if ctx.has_weights and ctx.needs_input_grad[3]:
        grad_w = torch.ops.moetrain.unpermute_weight_grad(x_TD, grad_ND, row_of_slot_TK).view(-1)
    return grad_x, None, None, grad_w


torch.library.register_autograd(
    "moetrain::permute_rows", _permute_rows_backward, setup_context=_permute_rows_setup
)


def _unpermute_rows_setup(ctx, inputs, output):
    y_ND, row_of_slot_TK, weights_TK = inputs
    ctx.has_weights = weights_TK is not None
    ctx.save_for_backward(y_ND if ctx.has_weights else None, weights_TK)
    ctx.row_of_slot_TK = row_of_slot_TK
    ctx.rows = y_ND.shape[0]


def _unpermute_rows_backward(ctx, grad_TD):
    y_ND, weights_TK = ctx.saved_tensors
    row_of_slot_TK = ctx.row_of_slot_TK
    k = row_of_slot_TK.shape[1]
    grad_TD = grad_TD.contiguous()
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        slot_of_row_N = native.inverse_index(row_of_slot_TK, ctx.rows)
        weights_S = None if weights_TK is None else weights_TK.reshape(-1)
        grad_y = torch.ops.moetrain.permute_rows(grad_TD, slot_of_row_N, k, weights_S)
    if ctx.has_weights and ctx.needs_input_grad[2]:
        grad_w = torch.ops.moetrain.unpermute_weight_grad(grad_TD, y_ND, row_of_slot_TK)
    return grad_y, None, grad_w


torch.library.register_autograd(
    "moetrain::unpermute_rows", _unpermute_rows_backward, setup_context=_unpermute_rows_setup
)


def _weight_grad_setup(ctx, inputs, output):
    grad_TD, y_ND, row_of_slot_TK = inputs
    ctx.save_for_backward(grad_TD, y_ND)
    ctx.row_of_slot_TK = row_of_slot_TK


def _weight_grad_backward(ctx, grad_gw_TK):
    grad_TD, y_ND = ctx.saved_tensors
    row_of_slot_TK = ctx.row_of_slot_TK
    grad_gw_TK = grad_gw_TK.contiguous()
    d_grad = d_y = None
    if ctx.needs_input_grad[0]:
        d_grad = torch.ops.moetrain.unpermute_rows(y_ND, row_of_slot_TK, grad_gw_TK)
    if ctx.needs_input_grad[1]:
        slot_of_row_N = native.inverse_index(row_of_slot_TK, y_ND.shape[0])
        d_y = torch.ops.moetrain.permute_rows(
            grad_TD, slot_of_row_N, row_of_slot_TK.shape[1], grad_gw_TK.reshape(-1)
        )
    return d_grad, d_y, None


torch.library.register_autograd(
    "moetrain::unpermute_weight_grad", _weight_grad_backward, setup_context=_weight_grad_setup
)


# ------------------------------------------------------------------------------------------------
# All-to-all layout.
# ------------------------------------------------------------------------------------------------


@torch.library.register_fake("moetrain::transpose_chunks")
def _transpose_chunks_fake(x, sizes_AB):
    torch._check(sizes_AB.dim() == 2, lambda: "sizes must be 2-D [A, B]")
    return torch.empty_like(x)


def _transpose_chunks_setup(ctx, inputs, output):
    ctx.sizes_AB = inputs[1]


def _transpose_chunks_backward(ctx, grad):
    sizes_AB = ctx.sizes_AB
    return torch.ops.moetrain.transpose_chunks(grad.contiguous(), sizes_AB.t().contiguous()), None


torch.library.register_autograd(
    "moetrain::transpose_chunks", _transpose_chunks_backward, setup_context=_transpose_chunks_setup
)


@torch.library.register_fake("moetrain::pack_scaled_fp16")
def _pack_fake(x_ND):
    torch._check(x_ND.dim() == 2, lambda: "x must be 2-D [rows, hidden]")
    return x_ND.new_empty((x_ND.shape[0], x_ND.shape[1] + 1), dtype=torch.int16)


@torch.library.register_fake("moetrain::unpack_scaled_fp16")
def _unpack_fake(packed_NW, dtype):
    torch._check(packed_NW.dim() == 2, lambda: "packed must be 2-D [rows, hidden + 1]")
    return packed_NW.new_empty((packed_NW.shape[0], packed_NW.shape[1] - 1), dtype=dtype)


# ------------------------------------------------------------------------------------------------
# CPU Adam: in-place optimizer steps (no autograd).
# ------------------------------------------------------------------------------------------------


def _adam_meta(op: str, named: dict) -> None:
    """On ``meta`` an optimizer step has nothing to do; a meta tensor among host tensors is a
    mistake, named as the CPU kernel would name it."""
    tensors = {name: t for name, t in named.items() if isinstance(t, torch.Tensor)}
    if any(t.device.type != "meta" for t in tensors.values()):
        name, bad = next((n, t) for n, t in tensors.items() if t.device.type == "meta")
        raise RuntimeError(f"{op}: {name} must be a CPU tensor, got device {bad.device}")


def _adam_step_meta(param, grad, exp_avg, exp_avg_sq, *, param_copy_out=None, **unused):
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "param_copy_out")
    _adam_meta(
        "adam_step_", dict(zip(names, (param, grad, exp_avg, exp_avg_sq, param_copy_out), strict=True))
    )


def _adam_step_multi_meta(params, grads, exp_avgs, exp_avg_sqs, *, param_copies_out, **unused):
    named = {}
    for label, tensors in (
        ("params", params),
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("param_copies_out", param_copies_out),
    ):
        named.update({f"{label}[{i}]": t for i, t in enumerate(tensors)})
    _adam_meta("adam_step_multi_", named)


def _adam_memory_probe_meta(param, grad, exp_avg, exp_avg_sq, param_copy_out=None):
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "param_copy_out")
    _adam_meta(
        "adam_memory_probe_",
        dict(zip(names, (param, grad, exp_avg, exp_avg_sq, param_copy_out), strict=True)),
    )


for _op, _meta in (
    ("adam_step_", _adam_step_meta),
    ("adam_step_multi_", _adam_step_multi_meta),
    ("adam_memory_probe_", _adam_memory_probe_meta),
):
    torch.library.register_fake(f"moetrain::{_op}", lambda *args, **kwargs: None)
    _LIBRARY.impl(_op, _meta, "Meta", allow_override=True)
