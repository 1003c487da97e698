"""The bucketed gradient reducer (``moetrain.grad_sync.GradReducer``, the expert gradients' and the
plain data-parallel path's) on real gloo ranks against the mean computed in one process."""

from __future__ import annotations

import torch
from torch import nn

from moetrain.grad_sync import GradReducer
from tests.helpers.dist_utils import run_distributed


def _reduce(rank: int, world: int, dtype: torch.dtype, value: float) -> list[torch.Tensor]:
    import torch.distributed as dist

    params = [nn.Parameter(torch.zeros(3, dtype=dtype)), nn.Parameter(torch.zeros(2, 2, dtype=dtype))]
    for index, param in enumerate(params):
        param.grad = torch.full_like(param, value * (1 + index + rank))
    GradReducer(params, dist.group.WORLD, world, world, bucket_bytes=16).reduce()
    return [param.grad.clone() for param in params]


def test_fp16_gradients_near_the_top_of_their_range_are_averaged_not_overflowed():
    """Two ranks' fp16 gradients of 40000 and 60000 sum to 100000, past fp16's 65504: summing first
    gave inf; their mean, 50000, is what each rank must hold (and 30000 for the other tensor)."""
    value = 20000.0
    expected = [
        torch.full((3,), value * 1.5, dtype=torch.float16),
        torch.full((2, 2), value * 2.5, dtype=torch.float16),
    ]
    for grads in run_distributed(_reduce, 2, torch.float16, value):
        for grad, want in zip(grads, expected, strict=True):
            assert torch.isfinite(grad).all(), grad
            torch.testing.assert_close(grad, want, rtol=1e-3, atol=0)


def test_fp32_gradients_are_the_mean_over_ranks():
    for grads in run_distributed(_reduce, 2, torch.float32, 0.1):
        torch.testing.assert_close(grads[0], torch.full((3,), 0.15))
        torch.testing.assert_close(grads[1], torch.full((2, 2), 0.25))
