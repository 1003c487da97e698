"""moefy: swapping and upcycling the FFNs of existing models (plain torch, tiny Hugging Face GPT-2
and Llama built locally from configs with random weights) into MoELayers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain import MoELayer, moefy
from moetrain.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers.dist_utils import run_distributed

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("activation", [nn.ReLU(), nn.GELU(), nn.GELU(approximate="tanh")], ids=str)
def test_upcycled_sequential_ffn_equals_the_dense_one(activation):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 48), activation, nn.Linear(48, 16), nn.Dropout(0.2))
    ).eval()
    x = torch.randn(4, 6, 8)
    dense = model(x)
    assert moefy(model, match="1", num_experts=4, top_k=2) == ["1"]
    moe = model[1][0]
    assert isinstance(moe, MoELayer) and moe.config.expert_bias and moe.config.d_ff == 48
    torch.testing.assert_close(model(x), dense, rtol=0, atol=1e-6)
    # training: the router and every expert get gradients
    model.train()
    model(x).square().mean().backward()
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.b1_EF.grad.abs().sum() > 0


def test_an_eval_model_stays_in_eval_and_drops_no_token_even_with_a_skewed_router():
    """moefy on an ``eval()`` model: the new layers evaluate (no router jitter, the evaluation
    capacity rule), and that rule is dropless too, so a router that sends every token to the same
    experts still gives the dense output (MoEConfig's evaluation default, 2.0, dropped them)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 16))
    ).eval()
    x = torch.randn(4, 6, 8)
    dense = model(x)
    moefy(model, match="1", num_experts=8, top_k=2, router_jitter=0.5)
    moe = model[1]
    assert not moe.training and moe.config.eval_capacity_factor is None
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:2] = 1.0  # experts 0 and 1 win for every token
    torch.testing.assert_close(model(x), dense, rtol=0, atol=1e-6)
    assert moe.last_stats.dropped_fraction == 0.0
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)  # no jitter in evaluation


def test_without_upcycling_the_ffn_is_swapped_for_a_freshly_initialised_layer():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16), nn.Dropout(0.2))
    ).eval()
    x = torch.randn(4, 6, 8)
    dense = model(x)
    w1 = model[1][0].weight.detach().clone()
    torch.manual_seed(5)
    assert moefy(model, match="1", num_experts=4, top_k=2, upcycle=False) == ["1"]
    moe, after = model[1]
    assert isinstance(moe, MoELayer) and isinstance(after, nn.Dropout)  # the FFN's dropout stays after it
    config = moe.config
    assert (config.d_model, config.d_ff, config.activation, config.expert_bias) == (16, 48, "gelu", True)
    assert config.normalize_gates is None and config.capacity_factor is None  # MoEConfig's gates, dropless
    torch.manual_seed(5)
    fresh = MoELayer(config)  # what a plain swap holds: the layer as MoELayer builds it
    for (name, got), want in zip(moe.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert not any(torch.equal(moe.experts.w1_EDF[e], w1.t()) for e in range(4))  # nothing copied
    assert not torch.allclose(model(x), dense, atol=1e-3)
    model.train()
    model(x).square().mean().backward()
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.w1_EDF.grad.abs().sum() > 0


def test_expert_biases_match_a_reference_with_uneven_routing():
    """Experts that differ (after upcycling they drift apart): each row gets its own expert's
    biases, compared with a per-token loop over the chosen experts; values and gradients."""
    torch.manual_seed(3)
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2, capacity_factor=None, expert_bias=True)
    with torch.no_grad():
        for p in (layer.experts.b1_EF, layer.experts.b2_ED):
            p.normal_()
    x = torch.randn(10, 8, requires_grad=True)
    out = layer(x)
    routing = layer.router(x)
    e = layer.experts
    reference = torch.zeros_like(out)
    for t in range(10):
        for j in range(2):
            k = routing.expert_ids_TK[t, j]
            h = torch.nn.functional.gelu(x[t] @ e.w1_EDF[k] + e.b1_EF[k])
            reference[t] += routing.gates_TK[t, j] * (h @ e.w2_EFD[k] + e.b2_ED[k])
    torch.testing.assert_close(out, reference)
    grads = torch.autograd.grad(out.sum(), [x, e.b1_EF, e.b2_ED])
    ref_grads = torch.autograd.grad(reference.sum(), [x, e.b1_EF, e.b2_ED])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_upcycled_hugging_face_model_keeps_its_logits_trains_and_round_trips(build, tmp_path):
    model = build()
    dense = logits(model)
    match = "transformer.h.*.mlp" if build is tiny_gpt2 else "model.layers.*.mlp"
    replaced = moefy(model, match=match, num_experts=4, top_k=2)
    assert len(replaced) == 2
    torch.testing.assert_close(logits(model), dense, rtol=0, atol=1e-5)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    trained = logits(model.eval())
    assert not torch.allclose(trained, dense)

    save_checkpoint(tmp_path, 1, model=model)
    fresh = build(seed=5)
    moefy(fresh, match=match, num_experts=4, top_k=2)
    assert not torch.allclose(logits(fresh), trained)
    assert load_checkpoint(tmp_path, model=fresh)["step"] == 1
    torch.testing.assert_close(logits(fresh.eval()), trained, rtol=0, atol=0)


def _expert_parallel_gpt2(rank, world):
    from moetrain import ParallelContext, shard_experts

    parallel = ParallelContext(ep_size=world)
    model = tiny_gpt2()
    torch.manual_seed(7)  # the routers' initialisation, the same on every rank
    moefy(model, match="transformer.h.*.mlp", num_experts=4, top_k=2)
    for name in [f"transformer.h.{i}.mlp.0" for i in range(len(model.transformer.h))]:
        shard_experts(model.get_submodule(name), parallel)
    layer = model.transformer.h[0].mlp[0]
    tokens = TOKENS[rank : rank + 1]
    out = model(input_ids=tokens).logits
    out.sum().backward()
    return out.detach(), layer.experts.first_expert, layer.experts.num_experts


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_upcycled_gpt2_under_expert_parallelism_equals_one_process():
    results = run_distributed(_expert_parallel_gpt2, 2)
    model = tiny_gpt2()
    torch.manual_seed(7)
    moefy(model, match="transformer.h.*.mlp", num_experts=4, top_k=2)
    for rank, (out, first, count) in enumerate(results):
        assert (first, count) == (2 * rank, 2)
        with torch.no_grad():
            single = model(input_ids=TOKENS[rank : rank + 1]).logits
        torch.testing.assert_close(out, single, rtol=0, atol=1e-5)


def test_errors_name_the_module_and_what_is_supported():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))
    with pytest.raises(ValueError, match=r"module '1' \(Sequential\) is not a supported FFN"):
        moefy(model, match="1", num_experts=2)
    with pytest.raises(ValueError, match="match 'nothing.*' selects no module of Sequential"):
        moefy(model, match="nothing.*", num_experts=2)
    ffn = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
    with pytest.raises(ValueError, match="top_k must satisfy 1 <= top_k <= num_experts = 2, got 3"):
        moefy(ffn, match="0", num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="^moefy: activation, d_ff come from the FFN"):
        moefy(ffn, match="0", num_experts=2, activation="gelu", d_ff=16)
