"""The experts' row-stable math (moetrain.layers.expert_math): a row's result does not depend on
which other rows share the call, which is what makes the chunked all-to-all bit-identical to the
unchunked layer. These tests fail loudly if a torch or MKL update changes the kernels' grouping."""

from __future__ import annotations

import random

import pytest
import torch

from moetrain.layers.expert_math import (
    ACTIVATIONS,
    expert_forward,
    expert_input_grad,
    grouped_mm_into,
    padded_rows,
    row_offsets,
    vector_aligned_rows,
)

DTYPES = (torch.float32, torch.float64)


def _split(rows: int, parts: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.randrange(rows + 1) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_grouped_mm_rows_do_not_depend_on_the_call(dtype, transpose_w):
    rng = random.Random(0)
    torch.manual_seed(0)
    experts, d_in, d_out = 3, 24, 40
    w = (
        torch.randn(experts, d_out, d_in, dtype=dtype)
        if transpose_w
        else torch.randn(experts, d_in, d_out, dtype=dtype)
    )
    x = torch.randn(300, d_in, dtype=dtype)
    counts = [100, 100, 100]
    offsets = row_offsets(counts)
    reference = grouped_mm_into(x.new_empty(304, d_out), x, w, offsets, transpose_w)[:300]
    for _ in range(10):
        # any subset of each expert's rows, in order, gives the same bits per row
        picked = [
            sorted(rng.sample(range(o, o + c), rng.randint(0, c)))
            for o, c in zip(offsets, counts, strict=False)
        ]
        rows = [r for block in picked for r in block]
        sub = x[rows]
        out = grouped_mm_into(
            sub.new_empty(len(rows) + 3, d_out), sub, w, row_offsets([len(p) for p in picked]), transpose_w
        )
        assert torch.equal(out[: len(rows)], reference[rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_expert_rows_are_the_same_bits_in_any_grouping(dtype, activation, bias):
    """Forward rows and input-gradient rows of a random subset of each expert's rows equal those
    rows of the whole call, at 1 and 2 threads (elementwise kernels split their work by thread)."""
    rng = random.Random(1)
    torch.manual_seed(1)
    experts, d_model, d_ff = 2, 16, 40
    inner = 2 * d_ff if activation == "swiglu" else d_ff
    w1, w2 = (
        torch.randn(experts, d_model, inner, dtype=dtype),
        torch.randn(experts, d_ff, d_model, dtype=dtype),
    )
    b1 = torch.randn(experts, inner, dtype=dtype) if bias else None
    b2 = torch.randn(experts, d_model, dtype=dtype) if bias else None
    counts = [700, 650]  # 1350 x 80 elements: above the 32768-element grain, so two threads split it
    x = torch.randn(sum(counts), d_model, dtype=dtype)
    grad_y = torch.randn(sum(counts), d_model, dtype=dtype)
    offsets = row_offsets(counts)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            y, saved = expert_forward(x, w1, w2, b1, b2, offsets, activation)
            grad_x, grad_h = expert_input_grad(grad_y, saved, w1, w2, offsets, activation)
            for _ in range(4):
                picked = [
                    sorted(rng.sample(range(o, o + c), rng.choice([0, 1, 3, 5, rng.randint(0, c)])))
                    for o, c in zip(offsets, counts, strict=False)
                ]
                rows = [r for block in picked for r in block]
                sub_offsets = row_offsets([len(p) for p in picked])
                y_sub, saved_sub = expert_forward(x[rows], w1, w2, b1, b2, sub_offsets, activation)
                gx_sub, gh_sub = expert_input_grad(grad_y[rows], saved_sub, w1, w2, sub_offsets, activation)
                assert torch.equal(y_sub, y[rows]), (num_threads, len(rows))
                assert torch.equal(saved_sub.a_PF[: len(rows)], saved.a_PF[rows])
                assert torch.equal(gx_sub, grad_x[rows]), (num_threads, len(rows))
                assert torch.equal(gh_sub[: len(rows)], grad_h[rows])
    finally:
        torch.set_num_threads(threads)


def test_padding_rows_keep_elementwise_kernels_on_their_vector_path():
    for rows, width, threads in [(1, 16, 2), (3, 24, 2), (1000, 40, 2), (5, 2048, 1), (4097, 12, 2)]:
        padded = vector_aligned_rows(rows, width, threads)
        n = padded * width
        used = 1 if n < 32768 else min(threads, -(-n // 32768))
        assert padded >= rows and n % 64 == 0 and -(-n // used) % 64 == 0
        assert padded - rows < 64
    assert padded_rows(5, 2048) >= 8  # room for the last expert's whole group of 4


def test_expert_forward_matches_the_plain_formula():
    torch.manual_seed(2)
    x = torch.randn(11, 8, dtype=torch.float64)
    w1, w2 = torch.randn(2, 8, 32, dtype=torch.float64), torch.randn(2, 16, 8, dtype=torch.float64)
    b1, b2 = torch.randn(2, 32, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    y, _ = expert_forward(x, w1, w2, b1, b2, [0, 4, 11], "swiglu")
    for e, (s, t) in enumerate([(0, 4), (4, 11)]):
        h = x[s:t] @ w1[e] + b1[e]
        want = (torch.nn.functional.silu(h[:, :16]) * h[:, 16:]) @ w2[e] + b2[e]
        torch.testing.assert_close(y[s:t], want, rtol=1e-12, atol=1e-12)
