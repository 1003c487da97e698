import pytest
import torch

from moetrain._ext import ops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def available_simd_levels() -> list[str]:
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(ops.detected_simd_level()) + 1]


@pytest.fixture(params=available_simd_levels())
def simd_level(request):
    """Runs a test once per SIMD code path this CPU can execute, restoring the best one after."""
    ops.set_max_simd_level(request.param)
    yield request.param
    ops.set_max_simd_level("avx512")
