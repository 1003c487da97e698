"""``torch.compile(..., fullgraph=True)`` of MoELayer (every option) and of a transformer block:
one graph, no break, outputs and gradients equal to eager within fp32 tolerance.

``aot_eager`` traces exactly what inductor would compile (dynamo + AOT autograd) without
generating code, so the cases stay fast; one inductor case is marked slow. Expert parallelism's
graph breaks are counted in tests/distributed/test_expert_parallel.py (it needs gloo ranks).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_lm import LMConfig, TransformerBlock
from moetrain import MoEConfig, MoELayer

BASE = {"d_model": 16, "d_ff": 24, "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.01}
CASES = {
    "capacity_drops": {"capacity_factor": 0.75, "min_capacity": 1},
    "dropless": {"capacity_factor": None},
    "prototypes": {"num_experts": 6, "num_prototypes": 2, "capacity_factor": 0.8, "min_capacity": 1},
    "shared_expert_swiglu": {"shared_expert_d_ff": 8, "activation": "swiglu"},
    "batch_prioritized_z_loss_relu": {
        "batch_prioritized_routing": True,
        "capacity_factor": 0.5,
        "min_capacity": 1,
        "z_loss_coef": 0.1,
        "activation": "relu",
    },
    "sigmoid_scores": {"score_function": "sigmoid", "top_k": 3},
    "torch_kernels": {"kernels": "torch", "capacity_factor": 0.75, "min_capacity": 1},
    "expert_bias_gelu_tanh": {"expert_bias": True, "activation": "gelu_tanh", "capacity_factor": None},
    "aux_free_sequence_loss": {"score_bias_rate": 0.01, "seq_aux_loss_coef": 0.01},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles from scratch (no recompile limit carried over)
    yield
    torch._dynamo.reset()


def _run(module, x, upstream):
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    params = list(module.parameters())
    grads = torch.autograd.grad(out, [x, *params], upstream, allow_unused=True)
    return [out.detach(), *grads]


def _assert_equal_runs(got, want):
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, index
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"tensor {i}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_layer_compiles_to_one_graph_equal_to_eager(case):
    torch.manual_seed(0)
    layer = MoELayer(**{**BASE, **CASES[case]})
    x, upstream = torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    _assert_equal_runs(_run(compiled, x, upstream), _run(layer, x, upstream))
    assert layer.last_stats.capacity == layer.capacity(21)


def test_compiled_expert_biases_with_dropped_tokens_equal_eager():
    """Expert biases (a moefied GPT-2's MLPs) with a capacity that drops tokens: the compiled
    plan's padding rows belong to no expert and get no bias; values and gradients equal eager."""
    torch.manual_seed(0)
    layer = MoELayer(**{**BASE, "expert_bias": True, "capacity_factor": 1.0, "min_capacity": 1})
    with torch.no_grad():
        for bias in (layer.experts.b1_EF, layer.experts.b2_ED):
            bias.normal_()  # initialised to zeros: make them count in values and gradients
    x, upstream = torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    want = _run(layer, x, upstream)
    padded_rows = min(21 * 2, 4 * layer.capacity(21))  # the compiled plan's rows
    assert 0 < layer.last_stats.kept_per_expert.sum() < padded_rows  # dropped, and padding rows
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    _assert_equal_runs(_run(compiled, x, upstream), want)


@pytest.mark.parametrize("case", ["capacity_drops", "dropless"])
def test_compiled_layer_does_not_recompile_per_token_count(case):
    """The plan's sizes (capacity, rows) are symbols of the token count, not constants: a layer
    compiled once serves every length from its dynamic graph (the C++ plan operator's schema takes
    them as ``SymInt``; an ``int`` specialised them, one graph per length until the recompile limit,
    which ``fullgraph=True`` turns into an error), with values and gradients equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    layer = MoELayer(**{**BASE, **CASES[case], "kernels": "custom"})
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for tokens in (5, 9, 13, 17, 22, 30, 41):
        x, upstream = torch.randn(tokens, 16), torch.randn(tokens, 16)
        _assert_equal_runs(_run(compiled, x, upstream), _run(layer, x, upstream))
    assert counter.frame_count <= 2  # the first length's static graph, then one dynamic graph


def test_compiled_recompute_replay_reuses_the_recorded_decision():
    """A compiled layer under activation checkpointing: the recompute (inside backward) runs the
    same graph, whose replay operator returns the first forward's decision."""
    torch.manual_seed(0)
    options = {
        "router_jitter": 0.3,
        "capacity_factor": 0.75,
        "min_capacity": 1,
        "batch_prioritized_routing": True,
    }
    layer = MoELayer(**{**BASE, **options})
    x, upstream = torch.randn(21, 16), torch.randn(21, 16)
    torch.manual_seed(5)
    plain = _run(layer, x, upstream)
    layer.set_recompute_replay(True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    replayed = _checkpointed_run(compiled, layer, x, upstream, preserve_rng_state=True)
    _assert_equal_runs(replayed, plain)
    assert layer.replay_record_bytes() == 0  # consumed by the recompute

    # Without the RNG state restored the recompute routes differently; the operator must hand it
    # the recorded decision instead.
    seen = []
    exchange = layer.replay.exchange

    def spy(decision, digest, record):
        result = exchange(decision, digest, record)
        seen.append((decision[0].clone(), result[0].clone()))
        return result

    layer.replay.exchange = spy
    _checkpointed_run(compiled, layer, x, upstream, preserve_rng_state=False)
    (fresh_forward, used_forward), (fresh_recompute, used_recompute) = seen
    assert not torch.equal(fresh_forward, fresh_recompute)  # the recompute alone would re-route
    assert torch.equal(used_forward, used_recompute)

    # A compiled forward whose backward never runs leaves a record, skipped by the next recompute.
    abandoned = checkpoint(compiled, torch.randn(21, 16, requires_grad=True), use_reentrant=False)
    del abandoned
    assert layer.replay_record_bytes() > 0
    torch.manual_seed(5)
    _assert_equal_runs(_checkpointed_run(compiled, layer, x, upstream, preserve_rng_state=True), plain)
    assert layer.replay_record_bytes() == 0


def _checkpointed_run(compiled, layer, x, upstream, preserve_rng_state):
    x = x.detach().clone().requires_grad_(True)
    out = checkpoint(compiled, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], upstream, allow_unused=True)
    return [out.detach(), *grads]


def _block():
    torch.manual_seed(0)
    moe = MoEConfig(d_model=32, d_ff=64, num_experts=4, top_k=2, capacity_factor=1.0, shared_expert_d_ff=16)
    return TransformerBlock(LMConfig(d_model=32, num_heads=4, moe=moe))


def test_transformer_block_compiles_to_one_graph_equal_to_eager():
    block = _block()
    x, upstream = torch.randn(2, 10, 32), torch.randn(2, 10, 32)
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    _assert_equal_runs(_run(compiled, x, upstream), _run(block, x, upstream))


@pytest.mark.slow
def test_transformer_block_compiles_with_inductor():
    block = _block()
    x, upstream = torch.randn(2, 10, 32), torch.randn(2, 10, 32)
    compiled = torch.compile(block, fullgraph=True)
    got, want = _run(compiled, x, upstream), _run(block, x, upstream)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # inductor fuses: other rounding


def test_runs_eagerly_defers_dynamo_and_breaks_at_the_method():
    """``@runs_eagerly`` (the dispatchers' exchanges): ``import moetrain`` and an eager layer never
    import ``torch._dynamo``; once prepared, a compiled caller breaks its graph at the method, named
    in the reason, and nowhere else."""
    import subprocess
    import sys

    code = (
        "import sys, torch, moetrain\n"
        "layer = moetrain.MoELayer(d_model=8, d_ff=8, num_experts=2, top_k=1)\n"
        "layer(torch.randn(3, 8)).sum().backward()\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

    from moetrain.layers.eager import prepare_eager_methods, runs_eagerly

    class Exchange:
        @runs_eagerly
        def swap(self, x):
            return x.flip(0)

        def compute(self, x):
            return self.swap(x.sin()).cos()

    prepare_eager_methods(Exchange)
    exchange = Exchange()
    x = torch.randn(4)
    explained = torch._dynamo.explain(exchange.compute)(x)
    assert (explained.graph_count, explained.graph_break_count) == (2, 1), explained.break_reasons
    reason = explained.break_reasons[0].reason
    assert "torch.compiler.disable" in reason and "Exchange.swap" in reason, reason
    assert torch.equal(torch.compile(exchange.compute, backend="aot_eager")(x), exchange.compute(x))
