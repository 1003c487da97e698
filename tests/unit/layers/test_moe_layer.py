"""MoELayer against the per-token loop reference (fp64), dense equivalence, losses, config errors."""

import dataclasses
from copy import deepcopy

import pytest
import torch

from moetrain import MoEConfig, MoELayer, collect_moe_stats
from moetrain.layers.exchange import Exchanger
from moetrain.layers.experts import DenseFFN
from moetrain.layers.losses import load_balancing_loss
from moetrain.layers.replay import ReplayedRoute, ReplayingExchanger
from moetrain.layers.route import RouteStep
from tests.helpers.reference import naive_moe_forward

BASE = {
    "d_model": 12,
    "d_ff": 10,
    "num_experts": 4,
    "top_k": 2,
    "capacity_factor": None,
    "aux_loss_coef": 0.1,
}

# Every gating option of the issue, with capacity drops where they matter.
GATING_CASES = {
    "dropless_softmax_top2": {},
    "capacity_drops": {"capacity_factor": 0.5, "min_capacity": 1},
    "batch_prioritized_drops": {"capacity_factor": 0.5, "min_capacity": 1, "batch_prioritized_routing": True},
    "top1_unnormalized": {"top_k": 1, "capacity_factor": 1.0, "min_capacity": 1},
    "min_capacity_sets_capacity": {"capacity_factor": 0.1, "min_capacity": 3},
    "top3_of_5_normalized": {"num_experts": 5, "top_k": 3},
    "top_k_equals_E": {"top_k": 4},
    "sigmoid_normalized": {"score_function": "sigmoid", "normalize_gates": True},
    "sigmoid_raw": {"score_function": "sigmoid", "normalize_gates": False, "capacity_factor": 0.75},
    "prototypes_k_top1_drops": {
        "num_experts": 6,
        "num_prototypes": 2,
        "capacity_factor": 0.6,
        "min_capacity": 1,
    },
    "prototypes_top2_each": {"num_experts": 8, "num_prototypes": 2, "top_k": 4},
    "relu": {"activation": "relu"},
    "swiglu": {"activation": "swiglu"},
    "shared_expert": {"shared_expert_d_ff": 6},
    "z_loss": {"z_loss_coef": 0.05},
    "no_aux": {"aux_loss_coef": 0.0},
    "jitter": {"router_jitter": 0.1},
}


def _grads(layer, x, output, aux, upstream):
    params = list(layer.parameters())
    loss = (output * upstream).sum() + aux
    return torch.autograd.grad(loss, [x, *params], allow_unused=True)


@pytest.mark.parametrize("case", sorted(GATING_CASES))
@pytest.mark.parametrize("training", [True, False])
def test_layer_matches_per_token_reference(case, training):
    config = MoEConfig(**{**BASE, **GATING_CASES[case]})
    layer = MoELayer(config).double().train(training)
    x = torch.randn(3, 7, config.d_model, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn_like(x)

    torch.manual_seed(123)
    out = layer(x)
    got = _grads(layer, x, out, torch.zeros((), dtype=torch.float64), upstream)  # aux is injected

    torch.manual_seed(123)
    noise = None
    if training and config.router_jitter:
        noise = torch.empty(21, config.d_model, dtype=torch.float64).uniform_(
            1 - config.router_jitter, 1 + config.router_jitter
        )
    ref_out, ref_aux = naive_moe_forward(layer, x, noise)
    want = _grads(layer, x, ref_out, ref_aux, upstream)

    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            assert a is None or not a.any(), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    stats = layer.last_stats
    torch.testing.assert_close(stats.aux_loss, ref_aux.detach())


def test_capacity_cases_really_drop_tokens():
    for case in ("capacity_drops", "batch_prioritized_drops", "prototypes_k_top1_drops"):
        layer = MoELayer(**{**BASE, **GATING_CASES[case]}).double()
        layer(torch.randn(21, BASE["d_model"], dtype=torch.float64))
        assert layer.last_stats.dropped_fraction > 0, case


def test_min_capacity_is_the_floor_of_the_capacity():
    layer = MoELayer(**{**BASE, **GATING_CASES["min_capacity_sets_capacity"]}).double()
    layer(torch.randn(21, BASE["d_model"], dtype=torch.float64))  # ceil(0.1 * 21 * 2 / 4) = 2 < 3
    assert layer.last_stats.capacity == 3
    assert int(layer.last_stats.kept_per_expert.max()) <= 3 and layer.last_stats.dropped_fraction > 0


def test_batch_prioritized_routing_keeps_highest_scores():
    config = {**BASE, "capacity_factor": 0.25, "min_capacity": 1, "top_k": 1}
    x = torch.randn(40, BASE["d_model"])
    for prioritized in (True, False):
        layer = MoELayer(**config, batch_prioritized_routing=prioritized)
        kept_T = layer(x).abs().sum(-1) > 0  # top-1, no shared expert: a dropped token outputs 0
        top = layer.router(x).probs_TE.max(-1)
        for e in range(BASE["num_experts"]):
            mine = top.indices == e
            capacity = layer.last_stats.capacity
            if mine.sum() <= capacity:
                continue
            best = torch.zeros_like(kept_T)
            best[torch.nonzero(mine).view(-1)[top.values[mine].argsort(descending=True)[:capacity]]] = True
            first = torch.zeros_like(kept_T)
            first[torch.nonzero(mine).view(-1)[:capacity]] = True
            assert torch.equal(kept_T & mine, best if prioritized else first)


def test_single_expert_dropless_equals_dense_ffn():
    for activation in ("gelu", "swiglu"):
        layer = MoELayer(
            d_model=16, d_ff=24, num_experts=1, top_k=1, capacity_factor=None, activation=activation
        )
        dense = DenseFFN(16, 24, activation)
        with torch.no_grad():
            dense.w1_DF.copy_(layer.experts.w1_EDF[0])
            dense.w2_FD.copy_(layer.experts.w2_EFD[0])
        x = torch.randn(5, 9, 16, requires_grad=True)
        out = layer(x)
        torch.testing.assert_close(out, dense(x))
        (g_layer,) = torch.autograd.grad(out.square().sum(), x)
        (g_dense,) = torch.autograd.grad(dense(x).square().sum(), x)
        torch.testing.assert_close(g_layer, g_dense)


def test_load_balancing_loss_hand_computed():
    # 2 tokens, 2 experts, top-1. probs: t0 = [0.8, 0.2] -> e0, t1 = [0.4, 0.6] -> e1.
    # f = [1/2, 1/2], P = [0.6, 0.4]; loss = E * sum f_e P_e = 2 * (0.3 + 0.2) = 1.0
    probs = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    assert load_balancing_loss(probs, torch.tensor([[0], [1]])).item() == pytest.approx(1.0)
    # both tokens to e0: f = [1, 0]; loss = 2 * 0.6 = 1.2
    assert load_balancing_loss(probs, torch.tensor([[0], [0]])).item() == pytest.approx(1.2)
    # top-2 with 3 experts: every token picks {0, 1}; f = [1/2, 1/2, 0]; P = [0.5, 0.3, 0.2]
    probs3 = torch.tensor([[0.6, 0.3, 0.1], [0.4, 0.3, 0.3]])
    assert load_balancing_loss(probs3, torch.tensor([[0, 1], [0, 1]])).item() == pytest.approx(
        3 * (0.25 + 0.15)
    )


def test_aux_loss_reaches_router_without_being_returned():
    layer = MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=1.0)
    x = torch.randn(10, 8)
    out = layer(x)
    (out * 0).sum().backward()  # the task loss contributes nothing: the router grad is the aux loss's
    assert layer.router.weight.grad.abs().sum() > 0
    stats = collect_moe_stats(layer)
    assert stats.aux_loss.item() == pytest.approx(layer.last_stats.aux_loss.item())


def test_collect_moe_stats_sums_layers():
    model = torch.nn.Sequential(MoELayer(**BASE), MoELayer(**{**BASE, "z_loss_coef": 0.5}))
    model(torch.randn(6, BASE["d_model"]))
    stats = collect_moe_stats(model)
    assert len(stats.layers) == 2
    total = model[0].last_stats.aux_loss + model[1].last_stats.aux_loss
    torch.testing.assert_close(stats.aux_loss, total)
    assert stats.z_loss > 0
    assert stats.layers[0].token_share.sum().item() == pytest.approx(1.0)


def test_empty_input_and_fewer_tokens_than_experts():
    layer = MoELayer(d_model=8, d_ff=8, num_experts=16, top_k=2, capacity_factor=1.0)
    for tokens in (0, 3):
        x = torch.randn(tokens, 8, requires_grad=True)
        out = layer(x)
        out.sum().backward()
        assert out.shape == x.shape and x.grad.shape == x.shape


def test_bf16_autocast_on_cpu():
    layer = MoELayer(d_model=32, d_ff=64, num_experts=4, top_k=2, shared_expert_d_ff=16)
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        routing = layer.router(x.reshape(-1, 32))
    assert out.dtype == torch.bfloat16
    assert routing.probs_TE.dtype == torch.float32 and routing.logits_TE.dtype == torch.float32
    out.float().sum().backward()
    assert layer.experts.w1_EDF.grad.dtype == torch.float32
    reference = layer(x)
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


def test_eval_uses_eval_capacity_factor():
    layer = MoELayer(**{**BASE, "capacity_factor": 0.5, "eval_capacity_factor": None, "min_capacity": 1})
    x = torch.randn(30, BASE["d_model"])
    layer.train()(x)
    assert layer.last_stats.dropped_fraction > 0
    layer.eval()(x)
    assert layer.last_stats.dropped_fraction == 0 and layer.last_stats.capacity is None


BAD_CONFIGS = [
    ({"top_k": 5}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"num_experts": 0}, "num_experts"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
    ({"eval_capacity_factor": float("nan")}, "eval_capacity_factor"),
    ({"score_function": "tanh"}, "score_function.*'softmax', 'sigmoid'"),
    ({"activation": "silu"}, "activation.*'relu', 'gelu', 'gelu_tanh', 'swiglu'"),
    ({"num_prototypes": 3}, "num_prototypes"),
    ({"num_prototypes": 4, "top_k": 2}, "top_k must be a multiple of num_prototypes"),
    ({"router_jitter": 1.5}, "router_jitter"),
    ({"min_capacity": -1}, "min_capacity"),
    ({"d_model": 2.5}, "d_model"),
    ({"normalize_gates": "yes"}, "normalize_gates"),
    ({"shared_expert_d_ff": 0}, "shared_expert_d_ff"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef"),
    ({"capcity_factor": 1.0}, "unknown key 'capcity_factor'; allowed keys there: .*capacity_factor"),
]


@pytest.mark.parametrize("override,pattern", BAD_CONFIGS)
def test_bad_config_raises_value_error_naming_field(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoELayer(**{**BASE, **override})


def test_config_and_options_are_exclusive_and_input_checked():
    config = MoEConfig(**BASE)
    with pytest.raises(ValueError, match="either a MoEConfig or keyword"):
        MoELayer(config, top_k=1)
    assert dataclasses.replace(config, top_k=1).top_k == 1
    layer = MoELayer(config)
    expected = r"expects inputs \[\.\.\., d_model=12\] of dtype float32, float64, bfloat16 or float16, got "
    for bad, got in [
        (torch.randn(3, 5), r"torch.float32 \(3, 5\)"),
        (torch.tensor(1.0), r"torch.float32 \(\)"),  # 0-d: was an IndexError
        (torch.ones(4, 12, dtype=torch.int64), r"torch.int64 \(4, 12\)"),  # was a C++ RuntimeError
        (torch.ones(4, 12, dtype=torch.bool), r"torch.bool \(4, 12\)"),
        ([[0.0] * 12], "list"),
    ]:
        with pytest.raises(ValueError, match=expected + got):
            layer(bad)


def _grads_of(layer, x, upstream, checkpointed, preserve_rng_state=True):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(99)
    if checkpointed:
        out = torch.utils.checkpoint.checkpoint(
            layer, x, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )
    else:
        out = layer(x)
    out.backward(upstream)
    return [x.grad] + [p.grad for p in layer.parameters()]


def test_recompute_replay_reuses_the_routing_decision():
    config = {
        **BASE,
        "router_jitter": 0.2,
        "capacity_factor": 0.75,
        "min_capacity": 1,
        "batch_prioritized_routing": True,
    }
    layer = MoELayer(**config).double()
    x = torch.randn(30, BASE["d_model"], dtype=torch.float64)
    upstream = torch.randn_like(x)
    plain = _grads_of(layer, x, upstream, checkpointed=False)
    layer.set_recompute_replay(True)
    replayed = _grads_of(layer, x, upstream, checkpointed=True)
    for a, b in zip(plain, replayed, strict=True):
        torch.testing.assert_close(a, b)
    assert layer.replay_record_bytes() == 0  # the record was consumed by the recompute and freed

    # Without the RNG state restored, a recompute would draw other jitter noise: the replayed
    # recompute must still use the recorded experts and capacity cut (the dispatch plan).
    chosen = []
    original_dispatch = layer.dispatcher.dispatch

    def spy(x_TD, plan):
        chosen.append(torch.cat([plan.row_of_slot_TK.reshape(-1), plan.slot_of_row_N]))
        return original_dispatch(x_TD, plan)

    layer.dispatcher.dispatch = spy
    _grads_of(layer, x, upstream, checkpointed=True, preserve_rng_state=False)
    assert len(chosen) == 2 and torch.equal(chosen[0], chosen[1])
    layer.set_recompute_replay(False)
    chosen.clear()
    _grads_of(layer, x, upstream, checkpointed=True, preserve_rng_state=False)
    assert len(chosen) == 2 and not torch.equal(chosen[0], chosen[1])  # shows the test can tell


def test_recompute_replay_skips_records_of_forwards_that_never_ran_backward():
    layer = MoELayer(**{**BASE, "router_jitter": 0.3}).double()
    x = torch.randn(25, BASE["d_model"], dtype=torch.float64)
    other = torch.randn(25, BASE["d_model"], dtype=torch.float64)  # same shape: a stale replay would fit
    upstream = torch.randn_like(x)
    plain = _grads_of(layer, x, upstream, checkpointed=False)
    layer.set_recompute_replay(True)
    abandoned = torch.utils.checkpoint.checkpoint(layer, other.requires_grad_(True), use_reentrant=False)
    assert layer.replay_record_bytes() > 0
    del abandoned  # e.g. a step skipped before backward: its graph and record go away
    assert layer.replay_record_bytes() == 0
    replayed = _grads_of(layer, x, upstream, checkpointed=True)
    for a, b in zip(plain, replayed, strict=True):
        torch.testing.assert_close(a, b)


def test_recompute_replay_is_installed_and_removed_as_wrappers():
    """set_recompute_replay wraps the route step and the dispatcher's exchanger (once, however often
    it is called) and removing it restores the plain ones; the dispatcher itself stays. A copy of a
    layer with replay on replays into its own records."""
    layer = MoELayer(**{**BASE, "router_jitter": 0.3}).double()
    dispatcher, route, exchanger = layer.dispatcher, layer.route, layer.dispatcher.exchanger
    assert not layer.recompute_replay and type(exchanger) is Exchanger and type(route) is RouteStep
    layer.set_recompute_replay(True)
    layer.set_recompute_replay(True)
    assert layer.recompute_replay and layer.dispatcher is dispatcher
    assert isinstance(layer.route, ReplayedRoute) and layer.route.inner is route
    assert isinstance(layer.dispatcher.exchanger, ReplayingExchanger)
    assert layer.dispatcher.exchanger.inner is exchanger

    copy = deepcopy(layer)
    assert copy.route.replay is copy.replay is copy.dispatcher.exchanger.replay
    assert copy.replay is not layer.replay and copy.route.inner.router is copy.router
    x = torch.randn(9, BASE["d_model"], dtype=torch.float64, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(copy, x, use_reentrant=False)
    assert copy.replay_record_bytes() > 0 and layer.replay_record_bytes() == 0
    out.sum().backward()
    assert copy.replay_record_bytes() == 0

    layer.set_recompute_replay(False)
    assert not layer.recompute_replay
    assert layer.route is route and layer.dispatcher.exchanger is exchanger
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    assert layer.replay_record_bytes() == 0  # nothing records once the wrappers are gone


def test_expert_weight_gradient_storage_is_reused_only_when_free():
    layer = MoELayer(**BASE)
    x, upstream = torch.randn(20, BASE["d_model"]), torch.randn(20, BASE["d_model"])
    weight = layer.experts.w1_EDF
    layer(x).backward(upstream)
    first = weight.grad.clone()
    layer(x).backward(upstream)  # accumulation into a live .grad must not overwrite it
    torch.testing.assert_close(weight.grad, 2 * first)

    layer.zero_grad(set_to_none=True)
    layer(x).backward(upstream)
    address = weight.grad.data_ptr()
    layer.zero_grad(set_to_none=True)
    layer(x).backward(upstream)
    assert weight.grad.data_ptr() == address  # released storage is written again
    torch.testing.assert_close(weight.grad, first)

    kept = weight.grad  # someone still holds last step's gradient
    layer.zero_grad(set_to_none=True)
    layer(2 * x).backward(upstream)
    assert weight.grad.data_ptr() != kept.data_ptr()
    torch.testing.assert_close(kept, first)
