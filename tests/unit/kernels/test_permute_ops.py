"""The C++ permutation kernels against the plain-PyTorch references in tests/helpers/reference.py."""

import pytest
import torch

from moetrain._ext import ops
from moetrain.layers.dispatch import (
    build_dispatch_plan,
    permute_tokens,
    token_priority_order,
    unpermute_tokens,
)
from tests.helpers.reference import (
    PERMUTE_SHAPES,
    reference_dispatch_plan,
    reference_permute,
    reference_unpermute,
)

SHAPES = PERMUTE_SHAPES


def _random_routing(tokens, k, experts, generator):
    """Distinct experts per token, skewed so some experts get nothing."""
    scores = torch.rand(tokens, experts, generator=generator) ** 3
    return scores.topk(k, dim=-1).indices


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("prioritized", [False, True])
def test_build_dispatch_plan_matches_reference(shape, prioritized):
    tokens, k, experts, _, capacity = shape
    g = torch.Generator().manual_seed(tokens * 31 + k)
    expert_ids = _random_routing(tokens, k, experts, g)
    order = token_priority_order(tokens, k, torch.rand(tokens, generator=g)) if prioritized else None
    plan = build_dispatch_plan(expert_ids, experts, capacity, order)
    ref = reference_dispatch_plan(expert_ids, experts, capacity, order)
    for got, want in zip(
        (plan.row_of_slot_TK, plan.slot_of_row_N, plan.kept_per_expert_E, plan.routed_per_expert_E),
        ref,
        strict=True,
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_permute_unpermute_match_reference(shape, dtype, simd_level):
    tokens, k, experts, hidden, capacity = shape
    g = torch.Generator().manual_seed(hidden + 7 * tokens)
    expert_ids = _random_routing(tokens, k, experts, g)
    plan = build_dispatch_plan(expert_ids, experts, capacity)
    x = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    w = torch.rand(tokens, k, generator=g, dtype=dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}

    torch.testing.assert_close(
        ops.permute_rows(x, plan.slot_of_row_N, k, None), reference_permute(x, plan.slot_of_row_N, k), **tol
    )
    torch.testing.assert_close(
        ops.permute_rows(x, plan.slot_of_row_N, k, w.view(-1)),
        reference_permute(x, plan.slot_of_row_N, k, w.view(-1)),
        **tol,
    )
    y = torch.randn(plan.num_rows, hidden, generator=g, dtype=dtype)
    torch.testing.assert_close(
        ops.unpermute_rows(y, plan.row_of_slot_TK, w), reference_unpermute(y, plan.row_of_slot_TK, w), **tol
    )
    torch.testing.assert_close(
        ops.unpermute_rows(y, plan.row_of_slot_TK, None), reference_unpermute(y, plan.row_of_slot_TK), **tol
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_autograd_matches_reference_gradients(shape, dtype, simd_level):
    tokens, k, experts, hidden, capacity = shape
    g = torch.Generator().manual_seed(3 * hidden + tokens)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g), experts, capacity)
    x = torch.randn(tokens, hidden, generator=g, dtype=dtype, requires_grad=True)
    gates = torch.rand(tokens, k, generator=g, dtype=dtype, requires_grad=True)
    upstream = torch.randn(tokens, hidden, generator=g, dtype=dtype)

    def run(permute, unpermute):
        x_ND = permute(x)
        y_ND = torch.tanh(x_ND) * 1.5  # something row-wise and non-linear between the two
        out = unpermute(y_ND)
        anchor = 0.0 * (x.sum() + gates.sum())  # keeps the graph alive when every slot is dropped
        return torch.autograd.grad((out * upstream).sum() + anchor, (x, gates))

    got = run(lambda x_: permute_tokens(x_, plan), lambda y: unpermute_tokens(y, gates, plan))
    want = run(
        lambda x_: reference_permute(x_, plan.slot_of_row_N, k),
        lambda y: reference_unpermute(y, plan.row_of_slot_TK, gates),
    )
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("shape", [s for s in SHAPES if 0 < s[0] * s[3] <= 1000])
def test_gradcheck_fp64(shape):
    tokens, k, experts, hidden, capacity = shape
    g = torch.Generator().manual_seed(tokens + hidden)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g), experts, capacity)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(plan.num_rows, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(tokens, k, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_: permute_tokens(x_, plan), (x,))
    assert torch.autograd.gradcheck(lambda y_, g_: unpermute_tokens(y_, g_, plan), (y, gates))


def test_permute_then_unpermute_round_trips_input_and_gradient():
    tokens, k, experts, hidden = 50, 2, 8, 24
    plan = build_dispatch_plan(
        _random_routing(tokens, k, experts, torch.Generator().manual_seed(1)), experts, None
    )
    x = torch.randn(tokens, hidden, requires_grad=True)
    ones = torch.full((tokens, k), 1.0 / k)
    out = unpermute_tokens(permute_tokens(x, plan), ones, plan)
    torch.testing.assert_close(out, x)
    grad = torch.randn(tokens, hidden)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_rows(dtype, simd_level):
    tokens, k, experts, hidden = 33, 2, 5, 40
    g = torch.Generator().manual_seed(5)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g), experts, 9)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.rand(tokens, k, generator=g)
    y = torch.randn(plan.num_rows, hidden, generator=g).to(dtype)
    grad = torch.randn(tokens, hidden, generator=g).to(dtype)
    # Exact for copies; for weighted sums the kernel accumulates in fp32 and rounds once.
    assert torch.equal(
        ops.permute_rows(x, plan.slot_of_row_N, k, None), reference_permute(x, plan.slot_of_row_N, k)
    )
    want = reference_unpermute(y.float(), plan.row_of_slot_TK, w).to(dtype)
    torch.testing.assert_close(ops.unpermute_rows(y, plan.row_of_slot_TK, w), want, rtol=1e-2, atol=1e-2)
    want_gw = torch.stack(
        [
            torch.stack(
                [
                    grad[t].float() @ y[r].float() if r >= 0 else torch.zeros(())
                    for r in plan.row_of_slot_TK[t].tolist()
                ]
            )
            for t in range(tokens)
        ]
    )
    torch.testing.assert_close(
        ops.unpermute_weight_grad(grad, y, plan.row_of_slot_TK), want_gw, rtol=1e-4, atol=1e-4
    )


def test_bad_arguments_raise():
    ids = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(RuntimeError, match="outside"):
        ops.build_dispatch_plan(ids, None, 2, -1)
    with pytest.raises(RuntimeError, match="permutation"):
        ops.build_dispatch_plan(ids, torch.tensor([0, 0, 1, 2]), 3, -1)
    with pytest.raises(RuntimeError, match="int64"):
        ops.build_dispatch_plan(ids.int(), None, 3, -1)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="slot_of_row"):
        ops.permute_rows(x, torch.tensor([0, 9]), 2, None)
    with pytest.raises(RuntimeError, match="weights must be Float for Float rows"):
        ops.permute_rows(x, torch.tensor([0, 1]), 2, torch.ones(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="row_of_slot"):
        ops.unpermute_rows(x, torch.tensor([[0, 5]]), None)
    # The checks the CUDA kernels share (csrc/arg_checks.cpp), with the integers their messages name.
    with pytest.raises(RuntimeError, match="weights must have 4 elements, got 3"):
        ops.permute_rows(x, torch.tensor([0, 1]), 2, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"row_of_slot must be 2-D \[tokens, k\], got 1-D"):
        ops.unpermute_rows(x, torch.tensor([0, 1]), None)
    with pytest.raises(RuntimeError, match="k must be >= 1, got 0"):
        ops.permute_rows(x, torch.tensor([0]), 0, None)
    with pytest.raises(RuntimeError, match="grad has 3 rows but row_of_slot has 2 tokens"):
        ops.unpermute_weight_grad(torch.randn(3, 4), x, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="must be float32, float64, bfloat16 or float16"):
        ops.permute_rows(torch.ones(2, 2, dtype=torch.int32), torch.tensor([0]), 1, None)
