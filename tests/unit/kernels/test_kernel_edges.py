"""Edge cases where the C++ kernels and their torch-native twins must agree: sizes whose sum wraps
around int64, repeated plan indices, no token, arguments out of range, crafted exponents of the
scaled fp16 format; the start-up check's fp64 sample, the kernel choice, and the layer's
``sequence_lengths`` and fp64 inputs under autocast."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import moetrain.kernels  # noqa: F401  (registers the operators)
from moetrain import MoELayer
from moetrain.kernels import kernel, native
from moetrain.kernels.selection import SAMPLES, KernelVerifier
from moetrain.layers.dispatch import build_dispatch_plan, permute_tokens

ops = torch.ops.moetrain
IMPLEMENTATIONS = ("custom", "twin")
REPO = Path(__file__).resolve().parents[3]


def _op(impl: str, name: str):
    return getattr(ops, name) if impl == "custom" else getattr(native, name)


# ------------------------------------------------------------------------------------------------
# transpose_chunks: sizes whose int64 sum wraps around to the rows of x.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_transpose_chunks_refuses_sizes_whose_sum_wraps_around_to_the_rows(impl):
    # Each size >= 0; the sum is 2^64 + 4, 4 (the rows of x) as int64. The old kernels crashed,
    # so the call runs in a child process: a crash fails this test instead of killing pytest.
    script = textwrap.dedent(
        f"""
        import torch
        import moetrain.kernels
        from moetrain.kernels import native

        fn = torch.ops.moetrain.transpose_chunks if {impl!r} == "custom" else native.transpose_chunks
        big = 2**62
        try:
            fn(torch.arange(4.0).view(4, 1), torch.tensor([[big, big, big, big + 4]]))
            print("returned")
        except (RuntimeError, ValueError) as error:
            print("raised:", str(error).splitlines()[0])
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    assert "raised: sizes sum past the 4 rows of x at [0, 0]" in child.stdout, child.stdout


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_transpose_chunks_refuses_sizes_past_the_rows_and_keeps_exact_sums(impl):
    fn = _op(impl, "transpose_chunks")
    x = torch.arange(6.0).view(6, 1)
    with pytest.raises((RuntimeError, ValueError), match=r"sizes sum past the 6 rows of x at \[1, 0\]"):
        fn(x, torch.tensor([[2, 1], [4, 0]]))
    out = fn(x, torch.tensor([[2, 1], [3, 0]]))
    assert out.flatten().tolist() == [0.0, 1.0, 3.0, 4.0, 5.0, 2.0]


# ------------------------------------------------------------------------------------------------
# Repeated indices: refused by the CPU kernels and the twins alike.
# ------------------------------------------------------------------------------------------------

Y = torch.tensor([[1.0], [10.0], [100.0]])
X = torch.tensor([[5.0], [7.0]])
DUPLICATES = {
    "unpermute_rows": (
        (Y, torch.tensor([[1, 1], [0, 2]]), None),
        r"row_of_slot must hold distinct rows; row 1 appears twice \(again at \[1\]\)",
    ),
    "unpermute_rows_weighted": (
        (Y, torch.tensor([[0, -1], [2, 0]]), torch.ones(2, 2)),
        r"row_of_slot must hold distinct rows; row 0 appears twice \(again at \[3\]\)",
    ),
    "unpermute_weight_grad": (
        (torch.ones(2, 1), Y, torch.tensor([[1, 1], [0, 2]])),
        r"row_of_slot must hold distinct rows; row 1 appears twice \(again at \[1\]\)",
    ),
    "permute_rows": (
        (X, torch.tensor([0, 0, 1]), 1, None),
        r"slot_of_row must hold distinct slots; slot 0 appears twice \(again at \[1\]\)",
    ),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_repeated_plan_indices_are_refused(case, impl):
    args, message = DUPLICATES[case]
    with pytest.raises((RuntimeError, ValueError), match=message):
        _op(impl, case.removesuffix("_weighted"))(*args)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_padding_indices_may_repeat(impl):
    out = _op(impl, "permute_rows")(X, torch.tensor([1, -1, 0, -1]), 1, None)
    assert out.flatten().tolist() == [7.0, 0.0, 5.0, 0.0]
    out = _op(impl, "unpermute_rows")(Y, torch.tensor([[-1, 2], [-1, -1]]), None)
    assert out.flatten().tolist() == [100.0, 0.0]


# ------------------------------------------------------------------------------------------------
# No token with rows in y; arguments out of range.
# ------------------------------------------------------------------------------------------------

EMPTY = {
    "unpermute_rows_weighted": ("unpermute_rows", lambda y, r: (y, r, torch.ones(r.shape))),
    "unpermute_rows": ("unpermute_rows", lambda y, r: (y, r, None)),
    "unpermute_weight_grad": (
        "unpermute_weight_grad",
        lambda y, r: (torch.ones(r.shape[0], y.shape[1]), y, r),
    ),
}


@pytest.mark.parametrize("tokens_k", [(0, 2), (0, 1)])
@pytest.mark.parametrize("case", sorted(EMPTY))
def test_twins_give_the_cpp_results_without_tokens(case, tokens_k):
    name, arguments = EMPTY[case]
    y = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    row_of_slot = torch.empty(tokens_k, dtype=torch.long)
    results = []
    for impl in IMPLEMENTATIONS:
        leaf = y.clone().requires_grad_()
        out = _op(impl, name)(*arguments(leaf, row_of_slot))
        (out.sum() + leaf.sum() * 0).backward()
        results.append((out.detach(), leaf.grad))
    (custom, custom_dy), (twin, twin_dy) = results
    assert twin.shape == custom.shape and torch.equal(twin, custom)
    assert torch.equal(twin_dy, custom_dy) and not twin_dy.any()


OUT_OF_RANGE = {
    "slot -2": ("permute_rows", (X, torch.tensor([-2]), 1, None), r"slot_of_row\[0\] = -2 outside \[-1, 2\)"),
    "slot past": (
        "permute_rows",
        (X, torch.tensor([1, 2]), 1, None),
        r"slot_of_row\[1\] = 2 outside \[-1, 2\)",
    ),
    "k 0": ("permute_rows", (X, torch.tensor([0]), 0, None), "k must be >= 1, got 0"),
    "k -1": ("permute_rows", (X, torch.tensor([-1]), -1, None), "k must be >= 1, got -1"),
    "row -5": (
        "unpermute_rows",
        (Y, torch.tensor([[-5], [0]]), None),
        r"row_of_slot\[0\] = -5 outside \[-1, 3\)",
    ),
    "row past": (
        "unpermute_weight_grad",
        (torch.ones(1, 1), Y, torch.tensor([[3]])),
        r"row_of_slot\[0\] = 3 outside \[-1, 3\)",
    ),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_twins_refuse_what_the_cpp_kernels_refuse_in_the_same_words(case, impl):
    name, args, message = OUT_OF_RANGE[case]
    with pytest.raises(RuntimeError if impl == "custom" else ValueError, match=message):
        _op(impl, name)(*args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unpack_scaled_fp16_decodes_every_exponent_as_the_cpp_kernel(dtype):
    exponents = torch.cat([torch.arange(-1200, 1200), torch.tensor([-32768, 32767])]).to(torch.int16)
    values = [0.0, 1.0, -1.5, 65504.0, 6e-8, 3e-5, float("inf"), float("nan")]
    halves = torch.tensor(values, dtype=torch.float16).view(torch.int16)
    packed = torch.cat([halves.expand(exponents.numel(), -1), exponents[:, None]], dim=1).contiguous()
    custom = ops.unpack_scaled_fp16(packed, dtype)
    twin = native.unpack_scaled_fp16(packed, dtype)
    assert torch.equal(custom.isnan(), twin.isnan())
    assert torch.equal(custom.nan_to_num(0.0, 7.0, -7.0), twin.nan_to_num(0.0, 7.0, -7.0))


# ------------------------------------------------------------------------------------------------
# The start-up check and the kernel choice.
# ------------------------------------------------------------------------------------------------


def test_the_start_up_check_refuses_a_kernel_wrong_only_in_fp64(caplog):
    def permute_rows_wrong_in_fp64(x, slot_of_row, k, weights):
        out = ops.permute_rows(x, slot_of_row, k, weights)
        return out * 2 if x.dtype == torch.float64 else out

    assert torch.float64 in {sample["dtype"] for sample in SAMPLES}
    verifier = KernelVerifier(
        custom={"permute_rows": permute_rows_wrong_in_fp64}, checked_device_types=("cpu",)
    )
    assert not verifier.trusts("permute_rows", "cpu")
    assert "float64" in caplog.text


@pytest.mark.parametrize("choice", ["Torch", "natvie", ""])
def test_kernel_choices_outside_auto_custom_torch_are_refused(choice):
    message = f"kernels must be one of 'auto', 'custom', 'torch', got {choice!r}"
    with pytest.raises(ValueError, match=message):
        kernel("permute_rows", torch.device("cpu"), choice)
    plan = build_dispatch_plan(torch.tensor([[0], [1]]), 2, None)
    with pytest.raises(ValueError, match=message):
        permute_tokens(torch.randn(2, 3), plan, kernels=choice)


# ------------------------------------------------------------------------------------------------
# The layer: sequence_lengths, fp64 under autocast.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths",
    [torch.tensor([2, 2]), torch.tensor([4, 4]), torch.tensor([-1, 7]), torch.tensor([3.0, 3.0])]
    + [torch.tensor([[3, 3]]), torch.tensor([True, True]), [3, 3]],
    ids=["short", "long", "negative", "float", "2-D", "bool", "list"],
)
def test_layer_refuses_sequence_lengths_that_do_not_fit_naming_them(lengths):
    torch.manual_seed(0)
    layer = MoELayer(d_model=4, d_ff=4, num_experts=4, top_k=2, seq_aux_loss_coef=1.0)
    with pytest.raises(
        ValueError, match=r"sequence_lengths must be 1-D integers >= 0 summing to T = 6, got "
    ):
        layer(torch.randn(6, 4), sequence_lengths=lengths)
    layer(torch.randn(6, 4), sequence_lengths=torch.tensor([0, 6], dtype=torch.int32))


def test_layer_keeps_fp64_inputs_in_fp64_under_autocast():
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64)
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2, shared_expert_d_ff=8).double()
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
        low = layer.float()(x.float())
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    assert low.dtype == torch.bfloat16  # fp32 inputs still take autocast's dtype
