"""moetrain's kernels as torch operators: ``torch.library.opcheck`` on every operator (schema, fake
implementation, autograd registration, tracing), and the torch-native twins of
``moetrain/kernels/native.py`` against the C++ CPU kernels (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from moetrain._ext import ops
from moetrain.kernels import native
from moetrain.layers.replay import RoutingReplay
from tests.helpers.reference import PERMUTE_SHAPES, reference_dispatch_plan, scaled_fp16_inputs

moetrain_ops = torch.ops.moetrain


def _routing(tokens, k, experts, generator):
    """Distinct experts per token, skewed so some experts get nothing."""
    return (torch.rand(tokens, experts, generator=generator) ** 3).topk(k, dim=-1).indices


def _plan(tokens=13, k=2, experts=4, capacity=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = _routing(tokens, k, experts, g)
    return ids, ops.build_dispatch_plan(ids, None, experts, capacity)


# ------------------------------------------------------------------------------------------------
# opcheck: every operator, on small inputs.
# ------------------------------------------------------------------------------------------------


def _opcheck_cases():
    g = torch.Generator().manual_seed(1)
    ids, (row_of_slot, slot_of_row, kept, _) = _plan()
    tokens, k = ids.shape
    rows = slot_of_row.numel()
    padded = torch.cat([slot_of_row, torch.full((3,), -1)])
    counts = torch.tensor([3, 0, 4, 2])
    adam = [torch.randn(6, generator=g) for _ in range(3)] + [torch.rand(6, generator=g)]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1, "adamw": True}

    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(True)

    return {
        "build_dispatch_plan": (moetrain_ops.build_dispatch_plan, (ids, None, 4, 3)),
        "build_dispatch_plan_prioritized": (
            moetrain_ops.build_dispatch_plan,
            (ids, torch.randperm(tokens * k, generator=g), 4, -1),
        ),
        "build_dispatch_plan_padded": (moetrain_ops.build_dispatch_plan, (ids, None, 4, 3, 12)),
        "sort_dispatch_plan": (moetrain_ops.sort_dispatch_plan, (ids, None, 4, 3)),
        "sort_dispatch_plan_padded": (moetrain_ops.sort_dispatch_plan, (ids, None, 4, -1, tokens * k)),
        "permute_rows": (moetrain_ops.permute_rows, (leaf(tokens, 8), slot_of_row, k, None)),
        "permute_rows_weighted_padded": (
            moetrain_ops.permute_rows,
            (leaf(tokens, 8), padded, k, leaf(tokens * k)),
        ),
        "unpermute_rows": (moetrain_ops.unpermute_rows, (leaf(rows, 8), row_of_slot, leaf(tokens, k))),
        "unpermute_rows_fp64": (
            moetrain_ops.unpermute_rows,
            (leaf(rows, 5, dtype=torch.float64), row_of_slot, None),
        ),
        "unpermute_weight_grad": (
            moetrain_ops.unpermute_weight_grad,
            (leaf(tokens, 8), leaf(rows, 8), row_of_slot),
        ),
        "transpose_chunks": (
            moetrain_ops.transpose_chunks,
            (leaf(int(kept.sum()), 4), torch.stack([kept // 2, kept - kept // 2])),
        ),
        "pack_scaled_fp16": (moetrain_ops.pack_scaled_fp16, (torch.randn(5, 7, generator=g) * 1e3,)),
        "unpack_scaled_fp16": (
            moetrain_ops.unpack_scaled_fp16,
            (ops.pack_scaled_fp16(torch.randn(5, 7, generator=g)), torch.float64),
        ),
        "adam_step_": (moetrain_ops.adam_step_, tuple(t.clone() for t in adam), {"step": 3, **hyper}),
        "adam_step_multi_": (
            moetrain_ops.adam_step_multi_,
            ([adam[0].clone()], [adam[1]], [adam[2].clone()], [adam[3].clone()]),
            {
                "steps": [2],
                "grad_scale": 1.0,
                "param_copies_out": [torch.empty(6, dtype=torch.bfloat16)],
                "copy_index": [0],
                **hyper,
            },
        ),
        "adam_memory_probe_": (moetrain_ops.adam_memory_probe_, tuple(t.clone() for t in adam)),
        "grouped_mm": (moetrain_ops.grouped_mm, (leaf(10, 6), leaf(4, 6, 5), counts, False)),
        "grouped_mm_transposed_padded": (moetrain_ops.grouped_mm, (leaf(12, 5), leaf(4, 6, 5), counts, True)),
        "grouped_mm_weight_grad": (moetrain_ops.grouped_mm_weight_grad, (leaf(10, 6), leaf(10, 5), counts)),
    }


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_opcheck(case):
    op, args, *kwargs = _opcheck_cases()[case]
    torch.library.opcheck(op, args, kwargs[0] if kwargs else None)


def test_opcheck_replay_routing():
    replay = RoutingReplay()
    decision = [torch.randint(0, 4, (6, 2)), torch.randperm(12)]
    torch.library.opcheck(
        moetrain_ops.replay_routing, (decision, torch.zeros(2, dtype=torch.float64), replay.id, True)
    )


# ------------------------------------------------------------------------------------------------
# Twins against the C++ kernels.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", PERMUTE_SHAPES)
@pytest.mark.parametrize("priority", ["default", "random"])
def test_native_dispatch_plan_equals_the_cpp_counting_sort(shape, priority):
    tokens, k, experts, _, capacity = shape
    g = torch.Generator().manual_seed(11 * tokens + k)
    ids = _routing(tokens, k, experts, g)
    order = None if priority == "default" else torch.randperm(tokens * k, generator=g)
    cap = -1 if capacity is None else capacity
    want = ops.build_dispatch_plan(ids, order, experts, cap)
    assert all(
        torch.equal(a, b)
        for a, b in zip(want, reference_dispatch_plan(ids, experts, capacity, order), strict=True)
    )
    for got in (
        native.build_dispatch_plan(ids, order, experts, cap),
        moetrain_ops.sort_dispatch_plan(ids, order, experts, cap),
    ):
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    padded_rows = tokens * k + 2
    for build in (ops.build_dispatch_plan, native.build_dispatch_plan):
        row_of_slot, slot_of_row, kept, _ = build(ids, order, experts, cap, padded_rows)
        assert torch.equal(slot_of_row[: want[1].numel()], want[1])
        assert bool((slot_of_row[want[1].numel() :] == -1).all()) and slot_of_row.numel() == padded_rows
        assert torch.equal(row_of_slot, want[0]) and torch.equal(kept, want[2])
    if capacity is None and order is None:  # the router's own ids: the plan without a host copy
        for rows in (None, padded_rows):
            got = native.build_dispatch_plan(ids, None, experts, -1, rows, ids_in_range=True)
            checked = native.build_dispatch_plan(ids, None, experts, -1, rows)
            for a, b in zip(got, checked, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("op", ["build_dispatch_plan", "sort_dispatch_plan"])
def test_plan_operators_take_symbolic_sizes(op):
    """The plan's sizes are ``SymInt``: traced with a symbolic token count (a compiled graph's
    dynamic shapes), capacity and rows stay expressions of it (an ``int`` would bake the traced
    length's values in), so the one graph serves other lengths, equal to the operator's calls."""
    from torch.fx.experimental.proxy_tensor import make_fx

    build = getattr(moetrain_ops, op)

    def plan(ids_TK):
        tokens, k = ids_TK.shape
        return build(ids_TK, None, 4, tokens // 3 + 1, tokens * k)

    g = torch.Generator().manual_seed(3)
    graph = make_fx(plan, tracing_mode="symbolic")(_routing(13, 2, 4, g))
    for tokens in (7, 13, 20):
        ids = _routing(tokens, 2, 4, g)
        for got, want in zip(graph(ids), plan(ids), strict=True):
            assert torch.equal(got, want), tokens


def test_dispatch_plans_reject_bad_arguments_by_name():
    ids = torch.tensor([[0, 1], [1, 2]])
    for build, error in ((ops.build_dispatch_plan, RuntimeError), (native.build_dispatch_plan, ValueError)):
        with pytest.raises(error, match=r"expert_ids contains .*outside"):
            build(ids, None, 2, -1)
        with pytest.raises(error, match="priority_order must be a permutation"):
            build(ids, torch.tensor([0, 0, 1, 2]), 3, -1)
        with pytest.raises(error, match="num_rows = 3 is less than the 4 rows the plan keeps"):
            build(ids, None, 3, -1, 3)
    with pytest.raises(ValueError, match=r"priority_order contains values outside \[0, 4\)"):
        native.build_dispatch_plan(ids, torch.tensor([0, 4, 1, 2]), 3, -1)
    with pytest.raises(ValueError, match="expert_ids must be a 2-D int64"):
        native.build_dispatch_plan(ids.int(), None, 3, -1)


def _grads(fn, args, differentiable, upstream):
    args = [a.detach().clone().requires_grad_(True) if i in differentiable else a for i, a in enumerate(args)]
    out = fn(*args)
    grads = torch.autograd.grad(out, [args[i] for i in differentiable], upstream)
    return out.detach(), grads


@pytest.mark.parametrize("shape", PERMUTE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_native_row_ops_equal_the_cpp_kernels_values_and_gradients(shape, dtype):
    tokens, k, experts, hidden, capacity = shape
    g = torch.Generator().manual_seed(hidden + 7 * tokens)
    row_of_slot, slot_of_row, _, _ = ops.build_dispatch_plan(
        _routing(tokens, k, experts, g), None, experts, -1 if capacity is None else capacity
    )
    rows = slot_of_row.numel()
    acc = native.accumulate_dtype(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    y = torch.randn(rows, hidden, generator=g).to(dtype)
    w_TK = torch.rand(tokens, k, generator=g, dtype=acc)
    padded = torch.cat([slot_of_row, torch.full((2,), -1)])
    cases = [
        ("permute_rows", (x, slot_of_row, k, None), (0,), rows),
        ("permute_rows", (x, padded, k, w_TK.view(-1)), (0, 3), rows + 2),
        ("unpermute_rows", (y, row_of_slot, w_TK), (0, 2), tokens),
        ("unpermute_rows", (y, row_of_slot, None), (0,), tokens),
        ("unpermute_weight_grad", (x, y, row_of_slot), (0, 1), None),
    ]
    tol = {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float64: {"rtol": 1e-12, "atol": 1e-12},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2},
    }[dtype]
    for name, args, differentiable, out_rows in cases:
        out_shape = (tokens, k) if out_rows is None else (out_rows, hidden)
        out_dtype = acc if out_rows is None else dtype
        upstream = torch.randn(out_shape, generator=g).to(out_dtype)
        got = _grads(native.NATIVE_OPS[name], args, differentiable, upstream)
        want = _grads(getattr(moetrain_ops, name), args, differentiable, upstream)
        for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_native_transpose_chunks_equals_the_cpp_kernel():
    g = torch.Generator().manual_seed(5)
    for a_count, b_count in [(1, 1), (3, 4), (6, 1), (0, 3), (5, 7)]:
        sizes = torch.randint(0, 4, (a_count, b_count), generator=g)
        x = torch.randn(int(sizes.sum()), 3, generator=g, requires_grad=True)
        got, want = native.transpose_chunks(x, sizes), moetrain_ops.transpose_chunks(x, sizes)
        assert torch.equal(got, want)
        upstream = torch.randn_like(got)
        assert torch.equal(*(torch.autograd.grad(out, x, upstream)[0] for out in (got, want)))
    with pytest.raises(ValueError, match="sizes sum to 3 but x has 4 rows"):
        native.transpose_chunks(torch.zeros(4, 2), torch.tensor([[1, 2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_scaled_fp16_equals_the_cpp_kernel(dtype, simd_level):
    x = scaled_fp16_inputs(dtype)
    got, want = native.pack_scaled_fp16(x), ops.pack_scaled_fp16(x)
    nan_rows = torch.isnan(x).any(1)
    assert torch.equal(got[~nan_rows], want[~nan_rows])
    assert torch.equal(got[:, -1], want[:, -1])  # the exponents, NaN rows included
    for out_dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(
            native.unpack_scaled_fp16(want, out_dtype),
            ops.unpack_scaled_fp16(want, out_dtype),
            rtol=0,
            atol=0,
            equal_nan=True,
        )
    tiny = torch.full((2, 3), 1e-300, dtype=torch.float64)  # exponent clamped at -1000 in both
    assert torch.equal(native.pack_scaled_fp16(tiny), ops.pack_scaled_fp16(tiny))
    assert native.pack_scaled_fp16(x[:, :0]).shape == (64, 1)


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_native_adam_step_matches_the_cpp_kernel(adamw, grad_dtype):
    g = torch.Generator().manual_seed(3)
    param, exp_avg = torch.randn(1000, generator=g), torch.randn(1000, generator=g) * 0.1
    exp_avg_sq = torch.rand(1000, generator=g) * 0.01
    grad = torch.randn(1000, generator=g).to(grad_dtype)
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05, "adamw": adamw}
    states = [[t.clone() for t in (param, exp_avg, exp_avg_sq)] for _ in range(2)]
    copies = [torch.empty(1000, dtype=torch.bfloat16) for _ in range(2)]
    for step in (1, 2, 3):
        for (p, m, v), copy, fn in zip(states, copies, (native.adam_step_, ops.adam_step_), strict=True):
            fn(p, grad, m, v, step=step, grad_scale=2.0, param_copy_out=copy, **hyper)
    for a, b in zip(*states, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert (copies[0].float() - copies[1].float()).abs().max() <= 2**-7 * param.abs().max()
