"""Aux-loss-free balancing (per-expert score biases) and the sequence-level balance loss."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain import MoELayer
from moetrain.config import TrainConfig, config_from_dict
from moetrain.layers import update_score_biases
from moetrain.layers.losses import sequence_balance_loss
from tests.helpers.dist_utils import run_distributed

E = 8


def skewed_layer(rate: float, seed: int = 0) -> MoELayer:
    """A router whose logits favour the low-numbered experts for every input."""
    torch.manual_seed(seed)
    layer = MoELayer(d_model=16, d_ff=16, num_experts=E, top_k=2, capacity_factor=None, aux_loss_coef=0.0,
                     score_bias_rate=rate)  # fmt: skip
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        layer.router.weight[:, 0] = torch.linspace(3.0, 0.0, E)  # input feature 0 is always ~1 below
    return layer


def tokens(step: int, rank: int = 0) -> torch.Tensor:
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(1000 * rank + step))
    x[:, 0] = 1.0 + 0.1 * x[:, 0]
    return x


def load_cv(layer: MoELayer) -> float:
    counts = layer.last_stats.routed_per_expert.double()
    return float(counts.std(unbiased=False) / counts.mean())


def test_aux_free_biases_even_out_a_skewed_router_without_any_aux_loss():
    layer, plain = skewed_layer(rate=0.01), skewed_layer(rate=0.0)
    with torch.no_grad():
        layer(tokens(0))
        plain(tokens(0))
    start = load_cv(layer)
    assert start > 0.5 and load_cv(plain) == start
    cvs = []
    for step in range(1, 301):
        with torch.no_grad():
            x = tokens(step)
            out = layer(x)
            plain(x)
        update_score_biases(layer)
        cvs.append(load_cv(layer))
    final = sum(cvs[-20:]) / 20
    print(f"expert load CV: {start:.3f} at the start, {final:.3f} after 300 updates (no aux loss)")
    assert final < 0.15 and load_cv(plain) > 0.5
    # the choice uses the biases, the gates do not: they are the chosen unbiased scores, normalised
    routing = layer.router(x)
    torch.testing.assert_close(layer.router.gates(routing.probs_TE, routing.expert_ids_TK), routing.gates_TK)
    assert torch.allclose(routing.probs_TE, plain.router(x).probs_TE)
    assert out.shape == x.shape


def test_score_biases_are_state_and_counts_are_not():
    layer = skewed_layer(rate=0.01)
    state = layer.state_dict()
    assert "router.score_bias_E" in state and "router.load_E" not in state
    assert "router.score_bias_E" not in skewed_layer(rate=0.0).state_dict()
    layer.train()
    layer(tokens(0))
    layer.eval()
    layer(tokens(1))  # evaluation does not count
    assert int(layer.router.load_E.sum()) == 512 * 2


def _replica(rank, world, steps):
    layer = skewed_layer(rate=0.01)
    for step in range(steps):
        with torch.no_grad():
            layer(tokens(step, rank))
        update_score_biases(layer)
    return layer.router.score_bias_E.clone()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_layer_cast_to_half_weights_keeps_exact_counts_and_fp32_biases(dtype):
    """``param_dtype`` bf16 / fp16 casts the model: the counts stay integers (bf16 stops counting
    at 256, fp16 overflows at 65504) and the biases fp32 (a 0.001 step is lost beside 0.5 in bf16)."""
    layer = skewed_layer(rate=0.001)
    with torch.no_grad():
        layer.router.score_bias_E.fill_(0.5)
    layer = layer.to(dtype)
    router = layer.router
    assert router.weight.dtype == dtype
    assert router.score_bias_E.dtype == torch.float32 and torch.equal(
        router.score_bias_E, torch.full((E,), 0.5)
    )
    load = torch.tensor([70001, 70002, 70000, 70001, 1, 2, 3, 4])
    for _ in range(3):
        router.observe(load)
    assert torch.equal(router.load_E, 3 * load)
    update_score_biases(layer)
    expected = 0.5 + 0.001 * torch.sign(load.double().mean() - load.double())
    assert torch.equal(router.score_bias_E, expected.float())
    assert torch.equal(router.load_E, torch.zeros(E, dtype=router.load_E.dtype))


def test_replicas_stay_bit_identical_and_equal_one_process_on_four_ranks():
    steps = 12
    biases = run_distributed(_replica, 4, steps)
    for bias in biases[1:]:
        assert torch.equal(bias, biases[0])
    single = skewed_layer(rate=0.01)
    for step in range(steps):
        for rank in range(4):  # the counts of all four ranks' batches accumulate, then one update
            with torch.no_grad():
                single(tokens(step, rank))
        update_score_biases(single)
    assert torch.equal(single.router.score_bias_E, biases[0]) and biases[0].abs().sum() > 0


def test_sequence_balance_loss_matches_a_per_sequence_reference():
    torch.manual_seed(2)
    batch, seq, k = 3, 5, 2
    probs = torch.rand(batch * seq, E, dtype=torch.float64).softmax(-1).requires_grad_(True)
    ids = torch.randint(0, E, (batch * seq, k))
    got = sequence_balance_loss(probs, ids, seq)
    reference = 0.0
    normalised = probs / probs.sum(dim=-1, keepdim=True)  # P: the normalised probabilities
    for b in range(batch):
        rows = slice(b * seq, (b + 1) * seq)
        share = torch.bincount(ids[rows].reshape(-1), minlength=E).double() / (seq * k)
        reference = reference + E * (share * normalised[rows].mean(0)).sum()
    reference = reference / batch
    torch.testing.assert_close(got, reference)
    torch.testing.assert_close(torch.autograd.grad(got, probs)[0], torch.autograd.grad(reference, probs)[0])
    uniform = torch.full((seq * E, E), 1.0 / E, dtype=torch.float64)
    balanced = torch.arange(seq * E * k).remainder(E).view(seq * E, k)
    assert float(sequence_balance_loss(uniform, balanced, seq * E)) == pytest.approx(1.0)


def test_sequence_balance_loss_of_unequal_lengths_matches_a_per_sequence_reference():
    torch.manual_seed(3)
    lengths, k = [4, 0, 7, 1], 2  # a sequence without tokens is left out of the mean
    tokens = sum(lengths)
    probs = torch.rand(tokens, E, dtype=torch.float64).softmax(-1).requires_grad_(True)
    ids = torch.randint(0, E, (tokens, k))
    got = sequence_balance_loss(probs, ids, sequence_lengths_B=torch.tensor(lengths))
    parts, start = [], 0
    for n in lengths:
        if n:
            parts.append(sequence_balance_loss(probs[start : start + n], ids[start : start + n], n))
        start += n
    reference = sum(parts) / len(parts)
    torch.testing.assert_close(got, reference)
    torch.testing.assert_close(torch.autograd.grad(got, probs)[0], torch.autograd.grad(reference, probs)[0])
    equal = sequence_balance_loss(probs[:12], ids[:12], sequence_lengths_B=torch.tensor([3, 3, 3, 3]))
    torch.testing.assert_close(equal, sequence_balance_loss(probs[:12], ids[:12], 3))


def test_the_layer_balances_flattened_tokens_within_the_sequence_lengths_given():
    torch.manual_seed(0)
    layer = MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.0, seq_aux_loss_coef=0.1)
    x = torch.randn(9, 8)
    lengths = torch.tensor([2, 7])
    layer(x, sequence_lengths=lengths)
    routing = layer.router(x)
    probs, ids = routing.probs_TE, routing.expert_ids_TK
    expected = 0.1 * sequence_balance_loss(probs, ids, sequence_lengths_B=lengths)
    torch.testing.assert_close(layer.last_stats.aux_loss, expected.detach())
    whole = 0.1 * sequence_balance_loss(probs, ids, 9)
    assert not torch.allclose(layer.last_stats.aux_loss, whole)  # the lengths matter


def test_the_layer_adds_the_sequence_loss_to_its_aux_loss_and_needs_sequences():
    torch.manual_seed(0)
    layer = MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.0, seq_aux_loss_coef=0.1)
    x = torch.randn(2, 6, 8)
    layer(x)
    routing = layer.router(x.reshape(-1, 8))
    expected = 0.1 * sequence_balance_loss(routing.probs_TE, routing.expert_ids_TK, 6)
    torch.testing.assert_close(layer.last_stats.aux_loss, expected.detach())
    with pytest.raises(ValueError, match=r"seq_aux_loss_coef needs inputs \[..., seq_len, d_model\] or seq"):
        layer(torch.randn(12, 8))


def test_engine_updates_saves_and_restores_the_score_biases(tmp_path):
    from moetrain.engine import Trainer

    config = {
        "model": {"name": "moe_lm", "d_model": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 16,
                  "moe": {"d_ff": 32, "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.0,
                          "score_bias_rate": 0.01}},
        "data": {"micro_batch_size": 4, "seq_len": 16}, "optim": {"lr": 3e-3, "warmup_steps": 2}, "steps": 4,
        "grad_accum": 2, "out_dir": str(tmp_path / "run"), "threads": 1, "log_every": 1, "device": "cpu",
    }  # fmt: skip
    trainer = Trainer(config_from_dict(TrainConfig, config))
    trainer.train()
    bias = trainer.model.blocks[0].ffn.router.score_bias_E.clone()
    trainer.close()
    assert bias.abs().sum() > 0 and bias.abs().max() <= 4 * 0.01 + 1e-9  # one update per optimizer step
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["score_bias_range"][0] == pytest.approx(float(bias.max() - bias.min()))
    from moe_lm import MoETransformerLM
    from moetrain.checkpoint import load_checkpoint

    fresh = MoETransformerLM(config_from_dict(TrainConfig, config).model)
    assert not torch.equal(fresh.blocks[0].ffn.router.score_bias_E, bias)
    load_checkpoint(tmp_path / "run" / "checkpoints", model=fresh)
    assert torch.equal(fresh.blocks[0].ffn.router.score_bias_E, bias)


def test_a_skipped_step_discards_its_routed_counts_and_leaves_the_biases(tmp_path, monkeypatch):
    """A step skipped for a non-finite gradient norm changes nothing, the routing state included:
    the next update moves the biases by the next step's counts alone."""
    from moetrain.engine import Trainer

    config = {
        "model": {"name": "moe_lm", "d_model": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 16,
                  "moe": {"d_ff": 32, "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.0,
                          "score_bias_rate": 0.01}},
        "data": {"micro_batch_size": 4, "seq_len": 16}, "steps": 4, "grad_accum": 2,
        "out_dir": str(tmp_path / "run"), "threads": 1, "device": "cpu",
    }  # fmt: skip
    trainer = Trainer(config_from_dict(TrainConfig, config))
    real_clip = trainer.trained.clip_grad_norm_
    calls = []

    def clip_with_an_overflow_first(*args, **kwargs):
        calls.append(1)
        norm = real_clip(*args, **kwargs)
        return torch.full_like(norm, float("inf")) if len(calls) == 1 else norm

    monkeypatch.setattr(trainer.trained, "clip_grad_norm_", clip_with_an_overflow_first)
    router = trainer.model.blocks[0].ffn.router
    observed = []
    observe = router.observe
    router.observe = lambda counts_E: (observed.append(counts_E.double().clone()), observe(counts_E))
    trainer.train_step()
    assert trainer.skipped_steps == 1 and len(observed) == 2  # two micro-steps routed
    assert router.load_E.abs().sum() == 0 and router.score_bias_E.abs().sum() == 0
    trainer.train_step()
    assert trainer.skipped_steps == 1 and len(observed) == 4
    load_E = observed[2] + observed[3]  # the second step's micro-steps only
    expected = (0.01 * torch.sign(load_E.mean() - load_E)).float()
    assert torch.equal(router.score_bias_E, expected) and expected.abs().sum() > 0
    trainer.close()
