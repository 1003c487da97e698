"""What the ``kernels: auto`` start-up check covers, where it runs, and what a trusted CUDA kernel is
still not given; the memory of the ``unpermute_weight_grad`` twin (the CUDA fallback).

No GPU runs here: the check is run on the C++ CPU kernels with the CPU made a checked device and
deliberately wrong "custom" kernels injected, and the device handling with the check stubbed out.
"""

from __future__ import annotations

import logging

import pytest
import torch

from moetrain.kernels import KernelVerifier, native, selection
from moetrain.layers.dispatch import build_dispatch_plan
from moetrain.planner.measure import PeakStorageBytes

ops = torch.ops.moetrain
ROW_OPS = ["permute_rows", "unpermute_rows", "unpermute_weight_grad"]

# ------------------------------------------------------------------------------------------------
# The samples reach the branches real plans take: rows of slot -1 (padded plans), k > 8.
# ------------------------------------------------------------------------------------------------


def _permute_wrong_in_zero_rows(x, slot_of_row, k, weights):
    """Right for kept rows, 7 in the rows of slot -1 (a padded plan's tail)."""
    return ops.permute_rows(x, slot_of_row, k, weights).masked_fill((slot_of_row < 0).unsqueeze(1), 7.0)


def _weight_grad_wrong_past_eight_choices(grad, y, row_of_slot):
    """Right for choices 0..7, 0 for the second group of 8 (a group loop that stops early)."""
    gw = ops.unpermute_weight_grad(grad, y, row_of_slot)
    return torch.cat([gw[:, :8], torch.zeros_like(gw[:, 8:])], dim=1)


def _unpermute_wrong_past_eight_choices(y, row_of_slot, weights):
    """Sums choices 0..7 only."""
    first_eight = torch.cat([row_of_slot[:, :8], torch.full_like(row_of_slot[:, 8:], -1)], dim=1)
    return ops.unpermute_rows(y, first_eight, weights)


@pytest.mark.parametrize(
    "op, wrong, caught_in",
    [
        (
            "permute_rows",
            _permute_wrong_in_zero_rows,
            "(sample 2: float16, 16 tokens, top-6, hidden 40, padded)",
        ),
        ("unpermute_weight_grad", _weight_grad_wrong_past_eight_choices, "top-10"),
        ("unpermute_rows", _unpermute_wrong_past_eight_choices, "top-10"),
    ],
)
def test_the_check_refuses_a_kernel_wrong_only_where_real_plans_go(op, wrong, caught_in, caplog):
    verifier = KernelVerifier(custom={op: wrong}, checked_device_types=("cpu",))
    with caplog.at_level(logging.WARNING, logger="moetrain.kernels"):
        assert not verifier.trusts(op, "cpu")
    assert caught_in in caplog.text


def test_a_compiled_layers_padded_plan_has_rows_of_slot_minus_one():
    """Control: the zero-row branch is one every padded plan takes, so a kernel wrong there is
    wrong in compiled graphs."""
    ids = torch.tensor([[0, 1]] * 8)  # experts 2 and 3 get nothing: fewer rows than E * capacity
    plan = build_dispatch_plan(ids, 4, 2, padded=True)
    assert bool((plan.slot_of_row_N < 0).any())
    x = torch.randn(8, 6)
    wrong = _permute_wrong_in_zero_rows(x, plan.slot_of_row_N, 2, None)
    assert not torch.equal(wrong, native.permute_rows(x, plan.slot_of_row_N, 2, None))


# ------------------------------------------------------------------------------------------------
# The CUDA row kernels take K <= 256: auto gives larger K to the twin.
# ------------------------------------------------------------------------------------------------


def test_cuda_row_kernels_take_at_most_256_choices():
    takes = selection.custom_kernel_takes
    for op in ROW_OPS:
        assert takes(op, "cuda", 256)
        assert not takes(op, "cuda", 300)
        assert takes(op, "cpu", 300)  # the C++ CPU kernels take any K
    assert takes("transpose_chunks", "cuda", 300)


def _row_op_args(op, k):
    tokens, experts, hidden = 3, k + 4, 8
    generator = torch.Generator().manual_seed(k)
    ids = torch.rand(tokens, experts, generator=generator).topk(k, dim=-1).indices
    row_of_slot, slot_of_row, _, _ = native.build_dispatch_plan(ids, None, experts, -1)
    y = torch.randn(slot_of_row.numel(), hidden, generator=generator)
    if op == "permute_rows":
        return (torch.randn(tokens, hidden, generator=generator), slot_of_row, k, None)
    if op == "unpermute_rows":
        return (y, row_of_slot, torch.rand(tokens, k, generator=generator))
    return (torch.randn(tokens, hidden, generator=generator), y, row_of_slot)


@pytest.mark.parametrize("op", ROW_OPS)
def test_auto_on_cuda_gives_calls_past_256_choices_to_the_twin(op, monkeypatch):
    """The choice for a CUDA device, run with CPU tensors: the stand-in "CUDA kernel" records its
    calls (its values are the twin's)."""
    custom_calls = []

    def cuda_kernel(*args):
        custom_calls.append(args)
        return native.NATIVE_OPS[op](*args)

    monkeypatch.setattr(
        selection, "VERIFIER", KernelVerifier(custom={op: cuda_kernel}, checked_device_types=())
    )
    chosen = selection.kernel(op, torch.device("cuda", 0), "auto")
    for k, runs_custom in ((300, False), (256, True), (2, True)):
        custom_calls.clear()
        args = _row_op_args(op, k)
        torch.testing.assert_close(chosen(*args), native.NATIVE_OPS[op](*args))
        assert bool(custom_calls) == runs_custom, k
    custom_calls.clear()
    selection.kernel(op, torch.device("cuda", 0), "custom")(*_row_op_args(op, 300))
    assert custom_calls  # custom means custom: the CUDA kernel refuses it
    assert selection.kernel(op, torch.device("cpu"), "auto") is cuda_kernel  # no limit on the CPU


# ------------------------------------------------------------------------------------------------
# The check runs on the tensors' GPU, each GPU on its own.
# ------------------------------------------------------------------------------------------------


def test_the_check_runs_on_the_tensors_gpu_with_a_verdict_per_gpu(monkeypatch):
    checked = []

    def compare_on_sample(op, custom, twin, device):
        checked.append(device)
        return "differs" if device.index == 3 else None

    monkeypatch.setattr(selection, "compare_on_sample", compare_on_sample)
    monkeypatch.setattr(selection, "VERIFIER", KernelVerifier())
    chosen = {
        index: selection.kernel("transpose_chunks", torch.device("cuda", index), "auto")
        for index in (3, 5, 3)
    }
    assert checked == [torch.device("cuda", 3), torch.device("cuda", 5)]
    assert set(selection.VERIFIER.verdicts) == {
        ("transpose_chunks", "cuda:3"),
        ("transpose_chunks", "cuda:5"),
    }
    assert chosen[3] is native.transpose_chunks
    assert chosen[5] is ops.transpose_chunks


# ------------------------------------------------------------------------------------------------
# The unpermute_weight_grad twin: bounded temporaries, the values of the one-shot formula.
# ------------------------------------------------------------------------------------------------


def _one_shot_weight_grad(grad_TD, y_ND, row_of_slot_TK):
    """The twin's earlier formula: every dot at once, three [N, D] temporaries."""
    tokens, k = row_of_slot_TK.shape
    acc = native.accumulate_dtype(grad_TD.dtype)
    slot_of_row_N = native.inverse_index(row_of_slot_TK, y_ND.shape[0])
    kept_N = slot_of_row_N >= 0
    token_N = torch.where(kept_N, slot_of_row_N // k, 0)
    dots_N = (grad_TD.index_select(0, token_N).to(acc) * y_ND.to(acc)).sum(1)
    target_N = torch.where(kept_N, slot_of_row_N, tokens * k)
    return dots_N.new_zeros(tokens * k + 1).scatter_(0, target_N, dots_N)[: tokens * k].view(tokens, k)


def _weight_grad_inputs(tokens, k, experts, hidden, dtype, seed=0):
    """A capacity cut and a padded plan: dropped slots and rows no slot uses."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=generator).topk(k, dim=-1).indices
    capacity = tokens * k // experts
    plan = native.build_dispatch_plan(ids, None, experts, capacity, experts * capacity + 2)
    row_of_slot = plan[0]
    grad = torch.randn(tokens, hidden, generator=generator).to(dtype)
    y = torch.randn(plan[1].numel(), hidden, generator=generator).to(dtype)
    return grad, y, row_of_slot


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_weight_grad_twin_in_chunks_equals_the_one_shot_formula(dtype, monkeypatch):
    monkeypatch.setattr(native, "WEIGHT_GRAD_CHUNK_ELEMENTS", 50)  # 2 rows of 24 a chunk, a partial last one
    grad, y, row_of_slot = _weight_grad_inputs(tokens=13, k=3, experts=5, hidden=24, dtype=dtype)
    assert y.shape[0] % 2 == 1
    results = []
    for formula in (native.unpermute_weight_grad, _one_shot_weight_grad):
        inputs = [grad.clone().requires_grad_(True), y.clone().requires_grad_(True)]
        gw = formula(*inputs, row_of_slot)
        upstream = torch.randn(gw.shape, generator=torch.Generator().manual_seed(1), dtype=gw.dtype)
        results.append([gw, *torch.autograd.grad(gw, inputs, upstream)])
    (gw, *grads), (want_gw, *want_grads) = results
    tight = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(gw, want_gw, **tight)  # fp32 (fp64) sums of the same products
    for got, want in zip(grads, want_grads, strict=True):
        # bf16 gradients: each chunk's rows are rounded to bf16 before autograd adds them up
        torch.testing.assert_close(got, want, **({} if dtype == torch.bfloat16 else tight))


def test_weight_grad_twin_temporaries_stay_below_twice_y():
    """bf16 rows (the one-shot formula held a bf16 and three fp32 [N, D] tensors, about 7x y)."""
    grad, y, row_of_slot = _weight_grad_inputs(tokens=8192, k=2, experts=8, hidden=1024, dtype=torch.bfloat16)
    with PeakStorageBytes() as memory:
        native.unpermute_weight_grad(grad, y, row_of_slot)
    assert memory.peak < 2 * y.nbytes, (memory.peak, y.nbytes)
