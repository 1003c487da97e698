"""auto_checkpoint: candidates, the exact solver against exhaustive search, the memory budget measured
with saved-tensor hooks, gradients (with and without router jitter) and state_dict keys unchanged."""

import copy
import itertools
import logging
import math
import random

import pytest
import torch
import torch.nn.functional as F

from moe_lm import LMConfig, MoETransformerLM
from moetrain import MoEConfig, MoELayer
from moetrain.recompute import (
    RecomputeOption,
    apply_recompute_plan,
    auto_checkpoint,
    default_candidates,
    measure_saved_bytes,
    plan_recompute,
    profile_activations,
    recomputed_modules,
    remove_recompute,
    solve_recompute,
)

VOCAB, BATCH, SEQ = 64, 4, 32


def make_lm(router_jitter: float = 0.0, seed: int = 0) -> MoETransformerLM:
    torch.manual_seed(seed)
    moe = MoEConfig(
        d_model=32, d_ff=128, num_experts=4, top_k=2, capacity_factor=None, router_jitter=router_jitter
    )
    config = LMConfig(vocab_size=VOCAB, d_model=32, num_layers=3, num_heads=4, max_seq_len=SEQ, moe=moe)
    return MoETransformerLM(config).train()


def make_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, tokens, targets, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # router jitter draws from the global RNG
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def lm_profile():
    model = make_lm()
    tokens, _ = make_batch()
    return model, tokens, profile_activations(model, tokens, timing_repeats=1)


def held_replay_bytes(model, tokens) -> int:
    """Bytes the MoE layers' replay records actually hold after one forward (then dropped)."""
    output = model(tokens)  # the records live as long as this forward's graph
    total = sum(layer.replay_record_bytes() for layer in model.modules() if isinstance(layer, MoELayer))
    del output
    return total


# --- candidates and profile ------------------------------------------------------------------


def test_default_candidates_are_layers_and_their_attention_and_moe():
    expected = [f"blocks.{i}{sub}" for i in range(3) for sub in ("", ".attn", ".ffn")]
    assert default_candidates(make_lm()) == expected


def test_profile_counts_every_saved_storage_once(lm_profile):
    model, tokens, profile = lm_profile
    assert profile.baseline_bytes == measure_saved_bytes(model, tokens)
    assert len(profile.groups) == 3
    assert [o.recomputed for o in profile.groups[1]] == [
        (),
        ("blocks.1.ffn",),
        ("blocks.1.attn",),
        ("blocks.1.attn", "blocks.1.ffn"),
        ("blocks.1",),
    ]
    layer, attn, ffn = (profile.blocks[n] for n in ("blocks.1", "blocks.1.attn", "blocks.1.ffn"))
    assert layer.saved_bytes > attn.saved_bytes + ffn.saved_bytes
    # d_model 32 fp32 activations of B*S tokens are the boundary of each block.
    assert layer.input_bytes == attn.input_bytes == ffn.input_bytes == BATCH * SEQ * 32 * 4
    # replay keeps the expert ids, T*k int64 (no all-to-all rows without expert parallelism).
    assert ffn.replay_bytes == layer.replay_bytes == BATCH * SEQ * 2 * 8
    assert attn.replay_bytes == 0


# --- the solver is exact ---------------------------------------------------------------------


def brute_force(groups, capacity):
    best = None
    for choice in itertools.product(*(range(len(g)) for g in groups)):
        nbytes = sum(g[j].activation_bytes for g, j in zip(groups, choice, strict=True))
        ms = sum(g[j].recompute_ms for g, j in zip(groups, choice, strict=True))
        if nbytes <= capacity and (best is None or ms < best):
            best = ms
    return best


def test_solver_matches_exhaustive_search_on_random_instances():
    rng = random.Random(0)
    for _ in range(300):
        groups = []
        for g in range(rng.randint(1, 5)):
            options = [RecomputeOption((), rng.randint(50, 100), 0.0)]
            for j in range(rng.randint(0, 4)):
                options.append(RecomputeOption((f"g{g}.{j}",), rng.randint(5, 100), rng.uniform(0.1, 5.0)))
            groups.append(options)
        capacity = rng.randint(0, 100 * len(groups))
        choice = solve_recompute(groups, capacity)
        best = brute_force(groups, capacity)
        if best is None:
            assert choice is None
            continue
        chosen = [g[j] for g, j in zip(groups, choice, strict=True)]
        assert sum(o.activation_bytes for o in chosen) <= capacity
        assert sum(o.recompute_ms for o in chosen) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_plan_is_optimal_on_the_profiled_model(lm_profile, fraction):
    _, _, profile = lm_profile
    budget = int(fraction * profile.baseline_bytes)
    plan = plan_recompute(profile, budget)
    assert plan.activation_bytes <= budget
    assert profile.cost_of(plan.recomputed) == (plan.activation_bytes, pytest.approx(plan.recompute_ms))
    assert plan.recompute_ms == pytest.approx(brute_force(profile.groups, budget - profile.outside_bytes))
    all_layers = [f"blocks.{i}" for i in range(3)]
    all_layers_bytes, all_layers_ms = profile.cost_of(all_layers)
    if all_layers_bytes <= budget:
        assert plan.recompute_ms <= all_layers_ms + 1e-12


def test_budget_above_baseline_recomputes_nothing(lm_profile):
    _, _, profile = lm_profile
    plan = plan_recompute(profile, profile.baseline_bytes)
    assert plan.recomputed == () and plan.recompute_ms == 0 and plan.saved_bytes == 0


def test_impossible_budget_names_the_minimum(lm_profile):
    model, tokens, profile = lm_profile
    minimum = profile.min_activation_bytes
    assert minimum == profile.cost_of([f"blocks.{i}" for i in range(3)])[0]  # whole layers are cheapest here
    plan_recompute(profile, minimum)  # exactly the minimum fits
    with pytest.raises(ValueError, match=f"minimum achievable activation memory {minimum} bytes"):
        plan_recompute(profile, minimum - 1)
    with pytest.raises(ValueError, match=f"at least {minimum}"):
        auto_checkpoint(model, tokens, minimum - 1, verbose=False, timing_repeats=1)
    assert recomputed_modules(model) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_budget_bytes": -1}, "memory_budget_bytes must be a finite number >= 0 \\(bytes\\)"),
        ({"memory_budget_bytes": math.inf}, "memory_budget_bytes must be a finite number"),
        ({"candidates": "blocks.0"}, "candidates must be a list of module names"),
        ({"candidates": ["blocks.9"]}, "candidates must name submodules of the model, got 'blocks.9'"),
        ({"candidates": ["blocks.0.attn_norm", "blocks.0.attn_norm"]}, "candidates must be distinct modules"),
        ({"example_batch": "tokens"}, "example_batch must be a tensor"),
        ({"loss_fn": 3}, "loss_fn must be callable"),
        ({"timing_repeats": 0}, "timing_repeats must be an integer >= 1"),
        ({"verbose": "yes"}, "verbose must be True or False"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    model = make_lm()
    tokens, _ = make_batch()
    arguments = {"example_batch": tokens, "memory_budget_bytes": 10**9, "verbose": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        auto_checkpoint(model, **arguments)


def test_candidate_that_never_runs_is_an_error():
    model = make_lm()
    model.unused = torch.nn.Linear(2, 2)
    tokens, _ = make_batch()
    with pytest.raises(ValueError, match=r"never called: \['unused'\]"):
        profile_activations(model, tokens, candidates=["blocks.0", "unused"], timing_repeats=1)


def test_explicit_candidates_and_custom_loss(lm_profile):
    _, tokens, _ = lm_profile
    model = make_lm()
    rng_state = torch.get_rng_state()
    profile = profile_activations(
        model,
        tokens,
        candidates=["blocks.0.ffn", "blocks.2"],
        loss_fn=lambda out: out.sum(),
        timing_repeats=1,
    )
    assert sorted(profile.blocks) == ["blocks.0.ffn", "blocks.2"]
    assert [o.recomputed for o in profile.groups[0]] == [(), ("blocks.0.ffn",)]
    assert all(p.grad is None for p in model.parameters())  # profiling leaves .grad alone
    assert torch.equal(torch.get_rng_state(), rng_state)  # ... and the RNG stream


# --- wrapping: MoE replay, memory, gradients --------------------------------------------------


def test_state_dict_and_parameter_names_unchanged_and_removable(lm_profile):
    _, tokens, profile = lm_profile
    model = make_lm()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    replayed = apply_recompute_plan(model, ["blocks.0", "blocks.1.attn", "blocks.2.ffn"])
    assert replayed == ["blocks.0.ffn", "blocks.2.ffn"]
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert recomputed_modules(model) == ["blocks.0", "blocks.1.attn", "blocks.2.ffn"]
    assert isinstance(model.blocks[2].ffn, MoELayer)
    with pytest.raises(ValueError, match="already recomputes"):
        apply_recompute_plan(model, ["blocks.1"])
    model.load_state_dict(make_lm(seed=5).state_dict())  # same keys load into the wrapped model
    assert remove_recompute(model) == ["blocks.0", "blocks.1.attn", "blocks.2.ffn"]
    assert recomputed_modules(model) == [] and "forward" not in model.blocks[0].__dict__


def test_nested_plan_is_rejected():
    with pytest.raises(ValueError, match="must not nest"):
        apply_recompute_plan(make_lm(), ["blocks.0", "blocks.0.ffn"])


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_measured_activation_bytes_fit_the_budget(lm_profile, fraction, caplog):
    base_model, tokens, _ = lm_profile
    model = copy.deepcopy(base_model)
    baseline = measure_saved_bytes(model, tokens)
    budget = int(fraction * baseline)
    with caplog.at_level(logging.INFO, logger="moetrain.recompute"):
        plan = auto_checkpoint(model, tokens, budget, timing_repeats=1)
    assert "auto_checkpoint: budget" in caplog.text
    # Saved tensors outside recomputed blocks + their checkpoint inputs, seen by saved-tensor hooks,
    # plus the routing replay the MoE layers keep outside autograd.
    measured = measure_saved_bytes(model, tokens) + held_replay_bytes(model, tokens)
    assert measured <= budget
    assert measured == plan.activation_bytes  # no storage is shared between layers: the model is exact


JITTER_PLANS = {
    "layers": ["blocks.0", "blocks.1", "blocks.2"],
    "sub_blocks": ["blocks.0.attn", "blocks.0.ffn", "blocks.1.ffn", "blocks.2.attn"],
}


@pytest.mark.parametrize("jitter", [0.0, 0.2])
@pytest.mark.parametrize("plan_name", [*JITTER_PLANS, "auto_50"])
def test_gradients_equal_without_recompute(jitter, plan_name):
    reference = make_lm(router_jitter=jitter)
    model = copy.deepcopy(reference)
    tokens, targets = make_batch()
    if plan_name == "auto_50":
        budget = measure_saved_bytes(model, tokens) // 2
        assert auto_checkpoint(model, tokens, budget, verbose=False, timing_repeats=1).recomputed
    else:
        apply_recompute_plan(model, JITTER_PLANS[plan_name])
    routed = {"reference": [], "recompute": []}
    for kind, net in (("reference", reference), ("recompute", model)):
        for name, layer in net.named_modules():
            if isinstance(layer, MoELayer):
                layer.router.register_forward_hook(
                    lambda m, a, out, kind=kind, name=name: routed[kind].append((name, out.expert_ids_TK))
                )
    for step in range(2):  # the second step checks that replay state does not leak between steps
        routed["reference"].clear()
        routed["recompute"].clear()
        loss_ref, grads_ref = train_step(reference, tokens, targets, seed=10 + step)
        loss, grads = train_step(model, tokens, targets, seed=10 + step)
        torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-7, msg=name)
        # Routing identical: every router call (recomputes included) chose the reference's experts.
        reference_ids = dict(routed["reference"])
        assert len(reference_ids) == 3
        for name, ids in routed["recompute"]:
            assert torch.equal(ids, reference_ids[name]), name


def test_recompute_replays_routing_instead_of_rerouting():
    """A router that would choose other experts in the recompute (as nondeterministic kernels or a
    changed RNG could) must not change the gradients: the layer replays the first forward's choice.
    The control run without replay shows that such a re-route would corrupt them."""
    reference = make_lm(router_jitter=0.2)
    tokens, targets = make_batch()
    _, grads_ref = train_step(reference, tokens, targets, seed=3)
    for replay in (True, False):
        model = copy.deepcopy(reference)
        apply_recompute_plan(model, ["blocks.0", "blocks.1.ffn"])
        in_backward = {"on": False}
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.set_recompute_replay(replay)
                layer.router.forward = rerouting_forward(layer.router, in_backward)
        torch.manual_seed(3)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        in_backward["on"] = True
        loss.backward()
        same = all(
            torch.allclose(p.grad, grads_ref[n], rtol=1e-5, atol=1e-7) for n, p in model.named_parameters()
        )
        assert same == replay


class SharedBlock(torch.nn.Module):
    """One MoE block applied twice per forward (weights shared): two calls of the same layer, each
    in its own checkpoint when the block is recomputed, recomputed in reverse order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.ffn = MoELayer(MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2, router_jitter=0.2), seed=1)
        self.block = torch.nn.Sequential(self.norm, self.ffn)

    def forward(self, x):
        x = self.inp(x)
        x = x + self.block(x)
        return x + self.block(torch.tanh(x) * 3)


@pytest.mark.parametrize("plan", [["block"], ["ffn"]])
def test_a_layer_called_twice_per_forward_replays_each_calls_routing(plan):
    reference = SharedBlock()
    model = copy.deepcopy(reference)
    apply_recompute_plan(model, plan)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
    grads = {}
    for kind, net in (("reference", reference), ("recompute", model)):
        torch.manual_seed(5)
        net(x).pow(2).mean().backward()
        grads[kind] = {name: p.grad for name, p in net.named_parameters()}
    for name, grad in grads["reference"].items():
        torch.testing.assert_close(grads["recompute"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def rerouting_forward(router, in_backward):
    original = router.forward

    def forward(x_TD, expert_ids_TK=None):
        if in_backward["on"] and expert_ids_TK is None:  # a fresh routing decision in the recompute
            with torch.no_grad():  # saves nothing, so checkpoint's saved-tensor check still applies
                chosen = original(x_TD).expert_ids_TK
            expert_ids_TK = (chosen + 1) % router.config.num_experts
        return original(x_TD, expert_ids_TK)

    return forward
