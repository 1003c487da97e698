"""Layer review, round 4: sequence lengths that cannot index out of bounds, capacities beyond
``T * K``, and the tie-breaking of the plain top-k (the lower expert index)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moetrain import MoELayer
from moetrain.layers.dispatch import compute_capacity
from moetrain.layers.losses import sequence_balance_loss

# --- sequence_lengths -------------------------------------------------------------------------


def test_lengths_whose_sum_wraps_to_t_are_refused():
    """Four lengths of about 2**62 sum, in int64, to 2**64 + 6 = 6 = T: the check passed them and
    the loss then wrote out of bounds (a segfault); now each length must also be <= T."""
    code = (
        "import torch\n"
        "from moetrain import MoELayer\n"
        "layer = MoELayer(d_model=4, d_ff=4, num_experts=4, top_k=2, seq_aux_loss_coef=0.1, seed=0)\n"
        "layer(torch.randn(6, 4), sequence_lengths=torch.tensor([2**62] * 3 + [2**62 + 6]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: sequence_lengths must be 1-D integers >= 0 summing to T = 6, got "), (
        last
    )


def test_unchecked_lengths_in_compiled_code_give_a_loss_not_a_crash():
    """Compiled code does not check the values (that would break the graph); lengths that are
    negative, wrap around or do not sum to T used to segfault or fail inside repeat_interleave.
    Now the token -> sequence map cannot leave [0, B): the forward and backward run."""
    code = (
        "import torch\n"
        "from moetrain import MoELayer\n"
        "torch.manual_seed(0)\n"
        "layer = MoELayer(d_model=4, d_ff=4, num_experts=4, top_k=2, seq_aux_loss_coef=0.1, seed=0)\n"
        "compiled = torch.compile(layer, fullgraph=True, backend='aot_eager')\n"
        "for lengths in ([-1, 7], [10, -4], [2**62] * 3 + [2**62 + 6], [5, 5], [0, 0], [100, 2]):\n"
        "    x = torch.randn(6, 4, requires_grad=True)\n"
        "    compiled(x, sequence_lengths=torch.tensor(lengths)).sum().backward()\n"
        "    assert torch.isfinite(layer.last_stats.aux_loss), lengths\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_varlen_loss_equals_the_per_sequence_loop(dtype):
    """Valid lengths, empty sequences included (left out of the mean), any integer dtype: the
    loss and its gradient are those of the sequences taken one at a time."""
    torch.manual_seed(0)
    lengths = [0, 3, 1, 0, 5, 2, 0]
    probs_TE = torch.rand(sum(lengths), 6, dtype=torch.float64).softmax(-1).requires_grad_()
    ids_TK = torch.rand(sum(lengths), 6).argsort(-1)[:, :2]
    got = sequence_balance_loss(probs_TE, ids_TK, None, torch.tensor(lengths, dtype=dtype))
    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    want = torch.stack(
        [
            sequence_balance_loss(probs_TE[s : s + n], ids_TK[s : s + n], n)
            for s, n in zip(starts, lengths, strict=True)
            if n
        ]
    ).mean()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    (got_grad,) = torch.autograd.grad(got, probs_TE)
    (want_grad,) = torch.autograd.grad(want, probs_TE)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)


# --- capacity ---------------------------------------------------------------------------------


def test_compute_capacity_is_capped_at_the_slots():
    assert compute_capacity(10, 4, 2, 1.25, 4) == 7  # ceil(1.25 * 20 / 4), unchanged
    assert compute_capacity(10, 4, 2, 0.1, 4) == 4  # min_capacity, unchanged
    assert compute_capacity(10, 4, 2, 4.0, 0) == 20  # cf = E: T * K
    assert compute_capacity(10, 4, 2, 1e308, 4) == 20
    assert compute_capacity(10, 4, 2, 1.25, 2**63) == 20
    assert compute_capacity(1, 4, 2, 1.25, 4) == 2  # min_capacity above T * K
    assert compute_capacity(0, 4, 2, 1.25, 4) == 0
    assert compute_capacity(10, 4, 2, None, 4) is None and compute_capacity(10, 4, 2, 0.0, 4) is None


@pytest.mark.parametrize("kernels", ["custom", "torch"])
@pytest.mark.parametrize(
    "options", [{"capacity_factor": 1e308}, {"capacity_factor": 1e19}, {"min_capacity": 2**63}]
)
def test_huge_capacity_runs_as_dropless(kernels, options):
    """Capacities the config accepts but a C++ int64 (or a float) cannot hold crashed the forward
    with errors naming neither option; every slot is kept, as dropless keeps them."""
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    layer = MoELayer(d_model=8, d_ff=6, num_experts=4, top_k=2, kernels=kernels, seed=0, **options)
    dropless = MoELayer(
        d_model=8, d_ff=6, num_experts=4, top_k=2, kernels=kernels, seed=0, capacity_factor=None
    )
    dropless.load_state_dict(layer.state_dict())
    y = layer(x)
    assert layer.last_stats.capacity == 10 * 2
    assert int(layer.last_stats.kept_per_expert.sum()) == 10 * 2
    torch.testing.assert_close(y, dropless(x), rtol=0, atol=0)


# --- ties in the plain top-k ------------------------------------------------------------------


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (64, 6), (8, 1)])
def test_equal_scores_pick_the_lowest_expert_indices(score_function, num_experts, top_k):
    """A zero router gives every expert the same score: each token picks experts 0 .. K-1, in
    that order (torch.topk picked e.g. [44, 41, 42, 43, 46, 47] of 64)."""
    layer = MoELayer(
        d_model=8, d_ff=4, num_experts=num_experts, top_k=top_k, score_function=score_function, seed=0
    )
    with torch.no_grad():
        layer.router.weight.zero_()
    ids_TK = layer.router(torch.randn(300, 8)).expert_ids_TK
    assert torch.equal(ids_TK, torch.arange(top_k).expand(300, top_k))


def test_saturated_sigmoid_ties_pick_the_lowest_expert_indices():
    layer = MoELayer(d_model=4, d_ff=4, num_experts=8, top_k=2, score_function="sigmoid", seed=0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[30.0 + e, 0, 0, 0] for e in range(8)]))
    out = layer.router(torch.tensor([[1.0, 0, 0, 0]]))
    assert bool((out.probs_TE == 1.0).all())  # fp32 sigmoid saturates: an eight-way tie
    assert out.expert_ids_TK.tolist() == [[0, 1]]


@pytest.mark.parametrize(
    "options",
    [
        {"num_experts": 8, "top_k": 2, "num_prototypes": 2},
        {"num_experts": 8, "top_k": 2, "batch_prioritized_routing": True, "capacity_factor": 0.5},
        {"num_experts": 8, "top_k": 3, "score_bias_rate": 0.01},
        {"num_experts": 8, "top_k": 2, "max_nodes_per_token": 2},  # cannot bind: the plain top-k
    ],
    ids=["prototypes", "batch_prioritized", "score_bias", "node_limit_not_binding"],
)
def test_ties_with_other_options_eager_and_compiled(options):
    """Ties by the lower index with prototypes (within each group), batch-prioritised routing,
    aux-free biases (equal biases keep the tie) and a node limit that cannot bind, in eager and
    in a full graph."""
    torch._dynamo.reset()
    layer = MoELayer(d_model=8, d_ff=4, seed=0, **options)
    with torch.no_grad():
        layer.router.weight.zero_()
    cfg = layer.config
    per_group = cfg.num_experts // cfg.num_prototypes
    want_K = torch.cat(
        [torch.arange(cfg.top_k_per_prototype) + g * per_group for g in range(cfg.num_prototypes)]
    )
    x = torch.randn(12, 8)
    compiled_router = torch.compile(layer.router, fullgraph=True, backend="aot_eager")
    try:
        for router in (layer.router, compiled_router):
            assert torch.equal(router(x).expert_ids_TK, want_K.expand(12, cfg.top_k))
        torch.compile(layer, fullgraph=True, backend="aot_eager")(x).sum().backward()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    "options",
    [
        {"num_experts": 64, "top_k": 6},
        {"num_experts": 8, "top_k": 1},
        {"num_experts": 12, "top_k": 4, "num_prototypes": 2},
        {"num_experts": 16, "top_k": 4, "score_bias_rate": 0.01},
    ],
)
def test_without_ties_the_choice_is_torch_topk_bit_for_bit(score_function, options):
    torch.manual_seed(1)
    layer = MoELayer(d_model=16, d_ff=4, score_function=score_function, seed=0, **options)
    router, cfg = layer.router, layer.config
    if router.score_bias_E is not None:
        router.score_bias_E.copy_(torch.randn(cfg.num_experts) * 0.01)
    out = router(torch.randn(2000, 16))
    choice_TE = out.probs_TE if router.score_bias_E is None else out.probs_TE + router.score_bias_E
    groups, per_group = cfg.num_prototypes, cfg.num_experts // cfg.num_prototypes
    choice_TGe = choice_TE.view(-1, groups, per_group)
    distinct_T = (choice_TGe.sort(dim=-1).values.diff(dim=-1) != 0).all(dim=-1).all(dim=-1)
    assert int(distinct_T.sum()) > 1900  # the rows compared below
    topk_TK = (
        choice_TGe.topk(cfg.top_k_per_prototype, dim=-1).indices
        + torch.arange(groups).view(groups, 1) * per_group
    ).reshape(-1, cfg.top_k)
    assert torch.equal(out.expert_ids_TK[distinct_T], topk_TK[distinct_T])
