"""``kernels: auto | custom | torch`` and the start-up check of ``auto``.

On a GPU the check compares each CUDA kernel with its torch-native twin once per process. No GPU
runs here, so these tests make the CPU a checked device and inject deliberately wrong "custom"
implementations: the check must catch each one (values, gradients, errors), warn once naming the
op, and the layer must then run the twin for the rest of the process.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from moetrain import MoELayer
from moetrain.kernels import DEVICE_OPS, KernelVerifier, kernel, native, selection

CPU = torch.device("cpu")


def _shifted_permute(x, slot_of_row, k, weights):
    """Right shape and dtype, wrong rows: a kernel indexing off by one token."""
    return native.permute_rows(torch.roll(x, 1, dims=0), slot_of_row, k, weights)


def _detached_unpermute(y, row_of_slot, weights):
    """Right values, no gradient: a kernel whose autograd formula was lost."""
    return native.unpermute_rows(y.detach(), row_of_slot, None if weights is None else weights.detach())


def _crashing_transpose(x, sizes):
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")


def _doubled_gradient_permute(x, slot_of_row, k, weights):
    """Right values, doubled gradients: a wrong backward formula."""
    out = native.permute_rows(x, slot_of_row, k, weights)
    return out.detach() + (out - out.detach()) * 2.0


def _bf16_only_wrong_unpermute(y, row_of_slot, weights):
    """Right in fp32, wrong rows in bf16: a bug in one dtype's instantiation."""
    out = native.unpermute_rows(y, row_of_slot, weights)
    return torch.roll(out, 1, dims=0) if y.dtype == torch.bfloat16 else out


def test_choices_pick_the_operator_or_the_twin():
    assert kernel("permute_rows", CPU, "custom") is torch.ops.moetrain.permute_rows
    assert (
        kernel("permute_rows", CPU, "auto") is torch.ops.moetrain.permute_rows
    )  # the CPU kernels are tested
    assert kernel("permute_rows", CPU, "torch") is native.permute_rows
    assert kernel("build_dispatch_plan", CPU, "torch") is torch.ops.moetrain.sort_dispatch_plan
    assert kernel("permute_rows", torch.device("meta"), "auto") is torch.ops.moetrain.permute_rows


def test_every_custom_kernel_passes_the_check_against_its_twin():
    """The check itself, run on the CPU kernels: none may be flagged (else ``auto`` on a GPU
    would reject correct kernels)."""
    verifier = KernelVerifier(checked_device_types=("cpu",))
    for op in DEVICE_OPS:
        assert verifier._problem(op, CPU) is None, op


@pytest.mark.parametrize(
    "op, wrong, reason",
    [
        ("permute_rows", _shifted_permute, "output 0 differs from the torch-native result by up to"),
        ("unpermute_rows", _detached_unpermute, "gives no gradient 0"),
        (
            "transpose_chunks",
            _crashing_transpose,
            "raised RuntimeError: CUDA error: an illegal memory access",
        ),
    ],
)
def test_a_wrong_kernel_is_caught_once_with_one_warning(op, wrong, reason, caplog):
    verifier = KernelVerifier(custom={op: wrong}, checked_device_types=("cpu",))
    with caplog.at_level(logging.WARNING, logger="moetrain.kernels"):
        assert not verifier.trusts(op, "cpu")
        assert not verifier.trusts(op, "cpu")  # decided once per process
        assert verifier.trusts("unpermute_weight_grad", "cpu")  # the others keep their kernels
    warnings = [r for r in caplog.records if r.name == "moetrain.kernels"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"moetrain kernel {op} on cpu" in message and reason in message
    assert "using the torch-native implementation for the rest of this run" in message
    assert "\n" not in message


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_first_check_without_grad_still_compares_the_gradients(mode):
    """The first call of an op may come under no_grad (an evaluation before training): the check
    still compares gradients, and its verdict holds for the rest of the process."""
    verifier = KernelVerifier(
        custom={"permute_rows": _doubled_gradient_permute}, checked_device_types=("cpu",)
    )
    with mode():
        assert not verifier.trusts("permute_rows", "cpu")
    assert not verifier.trusts("permute_rows", "cpu")
    assert "gradient 0 differs" in verifier._problem("permute_rows", CPU)


def test_a_kernel_wrong_in_one_dtype_is_caught_naming_the_sample():
    verifier = KernelVerifier(
        custom={"unpermute_rows": _bf16_only_wrong_unpermute}, checked_device_types=("cpu",)
    )
    problem = verifier._problem("unpermute_rows", CPU)
    assert problem.startswith("output 0 differs from the torch-native result")
    assert "(sample 1: bfloat16, 29 tokens, top-3, hidden 7)" in problem


def test_layer_with_auto_falls_back_to_the_twin_after_a_failed_check(monkeypatch, caplog):
    torch.manual_seed(0)
    layer = MoELayer(d_model=16, d_ff=24, num_experts=4, top_k=2, capacity_factor=1.0, min_capacity=1)
    twin = MoELayer(dataclasses.replace(layer.config, kernels="torch"))
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(30, 16)
    want = twin(x)

    # Control: trusted without a check, the wrong kernel corrupts the output (the test can tell).
    monkeypatch.setattr(selection, "VERIFIER", KernelVerifier(custom={"permute_rows": _shifted_permute}))
    assert not torch.allclose(layer(x), want, atol=1e-3)

    monkeypatch.setattr(
        selection,
        "VERIFIER",
        KernelVerifier(custom={"permute_rows": _shifted_permute}, checked_device_types=("cpu",)),
    )
    with caplog.at_level(logging.WARNING, logger="moetrain.kernels"):
        torch.testing.assert_close(layer(x), want)
        torch.testing.assert_close(layer(x), want)
    warnings = [r.getMessage() for r in caplog.records if r.name == "moetrain.kernels"]
    assert warnings == [warnings[0]] and "permute_rows" in warnings[0]
    assert kernel("permute_rows", CPU, "auto") is native.permute_rows
    assert kernel("permute_rows", CPU, "custom") is _shifted_permute  # custom means custom


def test_compiled_layer_takes_the_checked_choice(monkeypatch):
    """Under torch.compile the check runs while tracing and the twin is traced into the graph."""
    torch.manual_seed(0)
    layer = MoELayer(d_model=16, d_ff=24, num_experts=4, top_k=2, capacity_factor=None)
    x = torch.randn(12, 16)
    want = MoELayer(dataclasses.replace(layer.config, kernels="torch"))
    want.load_state_dict(layer.state_dict())
    monkeypatch.setattr(
        selection,
        "VERIFIER",
        KernelVerifier(custom={"permute_rows": _shifted_permute}, checked_device_types=("cpu",)),
    )
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), want(x))
    torch._dynamo.reset()


def test_config_rejects_unknown_kernel_choices():
    with pytest.raises(ValueError, match=r"kernels must be one of 'auto', 'custom', 'torch', got 'cuda'"):
        MoELayer(d_model=4, d_ff=4, kernels="cuda")
    from moetrain import ParallelConfig

    with pytest.raises(ValueError, match=r"kernels must be one of 'auto', 'custom', 'torch', got None"):
        ParallelConfig(kernels=None)
