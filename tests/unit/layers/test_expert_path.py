"""The measured choice of the experts' GEMM path (moetrain/layers/expert_path.py) and torch's grouped
GEMM without a full-output pass for exact plans (moetrain/kernels/grouped_mm.py). The timings that
decide on a GPU come from scripts/gpu_check.sh; here the mechanism runs on the CPU: a fake timer
decides, and both paths must give the same values and gradients whichever is chosen."""

from __future__ import annotations

import logging

import pytest
import torch

from moetrain.kernels import grouped_mm as grouped_mm_module
from moetrain.layers import expert_path, experts
from moetrain.layers.experts import GroupedExperts


class FakeTimer:
    """The chooser times the candidates in turn, ``grouped`` first: it takes ``grouped_s``, the
    per-expert path 1 ms. Records which it timed."""

    ORDER = ("grouped", "per_expert")

    def __init__(self, grouped_s: float):
        self.grouped_s, self.timed = grouped_s, []

    def __call__(self, run) -> float:
        run()
        name = self.ORDER[len(self.timed) % 2]
        self.timed.append(name)
        return self.grouped_s if name == "grouped" else 1e-3


def test_the_chooser_keeps_the_faster_candidate_per_shape_class_and_logs_it(caplog):
    calls = {"a": 0, "b": 0}
    durations = {"a": 2.0, "b": 1.0}

    def make(name):
        def run():
            calls[name] += 1

        run.name = name
        return run

    chooser = expert_path.ExpertPathChooser(
        warmup=1, repeats=3, timer=lambda run: (run(), durations[run.name])[1]
    )
    candidates = {"a": make("a"), "b": make("b")}
    key = ("cpu", torch.float32, 8, 16, 16, 4, "gelu", False, 64)
    with caplog.at_level(logging.INFO, logger="moetrain.layers.expert_path"):
        assert chooser.choose(key, torch.device("cpu"), candidates) == "b"
    assert calls == {"a": 4, "b": 4}  # 1 warm-up + 3 timed each
    assert "b (fwd+bwd a 2000.000 ms, b 1000.000 ms)" in caplog.text
    assert chooser.choose(key, torch.device("cpu"), candidates) == "b" and calls == {"a": 4, "b": 4}
    other = key[:-1] + (128,)
    durations.update(a=0.5)
    assert chooser.choose(other, torch.device("cpu"), candidates) == "a"


def test_shape_classes_round_rows_up_to_a_power_of_two():
    w1, w2 = torch.empty(4, 8, 16), torch.empty(4, 16, 8)
    keys = {
        rows: expert_path.shape_class(torch.empty(rows, 8), w1, w2, "gelu", False) for rows in (33, 64, 65)
    }
    assert keys[33] == keys[64] != keys[65]
    assert keys[64][-1] == 64 and keys[65][-1] == 128


@pytest.mark.parametrize("grouped_faster", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_whichever_path_is_chosen_the_layer_gives_the_same_values_and_gradients(
    monkeypatch, grouped_faster, bias
):
    """Where torch's grouped GEMM may run (patched in: this is a CPU) the measured path runs; its
    output and the parameters' gradients equal the per-expert path's, and the measurement's own
    forward/backward runs on detached copies leave no gradient on the parameters."""
    torch.manual_seed(0)
    layer = GroupedExperts(4, 8, 16, "swiglu", seed=1, bias=bias)
    if bias:
        with torch.no_grad():
            layer.b1_EF.normal_()
            layer.b2_ED.normal_()
    reference = GroupedExperts(4, 8, 16, "swiglu", seed=1, bias=bias)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(30, 8)
    counts = torch.tensor([10, 0, 15, 5])
    timer = FakeTimer(grouped_s=1e-4 if grouped_faster else 1e-2)
    monkeypatch.setattr(
        expert_path, "CHOOSER", expert_path.ExpertPathChooser(warmup=0, repeats=2, timer=timer)
    )
    monkeypatch.setattr(experts, "uses_torch_grouped_mm", lambda *args, **kwargs: True)
    chosen = {}
    original = GroupedExperts._forward_by_operators

    def spy(self, *args, **kwargs):
        chosen["operators"] = kwargs.get("padded", args[-1] if args else None)
        return original(self, *args, **kwargs)

    x1 = x.clone().requires_grad_()
    out = layer(x1, counts)
    assert all(p.grad is None for p in layer.parameters())  # the measurement left no gradient
    assert sorted(set(timer.timed)) == ["grouped", "per_expert"]
    monkeypatch.setattr(GroupedExperts, "_forward_by_operators", spy)
    layer(x.clone(), counts)  # cached: no new measurement
    assert len(timer.timed) == 4
    assert ("operators" in chosen) == grouped_faster
    if grouped_faster:
        assert chosen["operators"] is False  # an eager plan is exact: no full-output pass
    monkeypatch.setattr(experts, "uses_torch_grouped_mm", lambda *args, **kwargs: False)
    x2 = x.clone().requires_grad_()
    expected = reference(x2, counts)
    torch.testing.assert_close(out, expected)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for (name, param), other in zip(layer.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, other.grad, msg=name)


def test_torch_grouped_gemm_zeroes_rows_beyond_the_counts_only_for_padded_plans():
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no public grouped_mm")
    torch.manual_seed(0)
    x = torch.randn(24, 16, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    counts = torch.tensor([5, 0, 11])
    expected = grouped_mm_module.loop_grouped_mm(x, w, counts, False)
    padded = grouped_mm_module.torch_grouped_mm(x, w, counts, False, padded=True)
    torch.testing.assert_close(padded, expected)
    assert torch.equal(padded[16:], torch.zeros(8, 8, dtype=torch.bfloat16))
    exact = grouped_mm_module.torch_grouped_mm(x[:16], w, counts, False, padded=False)
    torch.testing.assert_close(exact, expected[:16])


def test_torch_grouped_weight_gradient_equals_the_loop_and_zeroes_experts_without_rows():
    """``a[rows_e]^T @ b[rows_e]`` per expert by torch's 2-D x 2-D grouped GEMM (the CUDA bf16
    weight gradient) against the per-expert loop and an fp64 reference; expert 1 has no rows, so
    its block must be zeros whatever the kernel leaves there."""
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no public grouped_mm")
    torch.manual_seed(0)
    a = torch.randn(16, 24, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    counts = torch.tensor([5, 0, 11])
    grouped = grouped_mm_module.torch_grouped_weight_grad(a, b, counts)
    loop = grouped_mm_module.loop_weight_grad(a, b, counts)
    offsets = [0, 5, 5, 16]
    reference = torch.stack(
        [a[s:e].double().t() @ b[s:e].double() for s, e in zip(offsets, offsets[1:], strict=False)]
    )
    assert not grouped_mm_module.empty_groups_come_out_zero(a.device)  # so zeroed here, on the CPU
    assert grouped.shape == (3, 24, 8)
    assert torch.equal(grouped[1], torch.zeros(24, 8, dtype=torch.bfloat16))
    torch.testing.assert_close(grouped.double(), reference, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=5e-2)
