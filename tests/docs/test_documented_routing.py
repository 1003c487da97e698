"""What docs/routing.md states about the router's bookkeeping, checked on one process: a loss whose
coefficient is 0 reads 0 in ``last_stats``; "the slots an expert received" (what aux-free
balancing counts) are the routed slots before the capacity cut; a token's first choice, the one
that claims capacity first, is its highest *biased* score."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain import MoELayer
from moetrain.layers.dispatch import build_dispatch_plan


@pytest.mark.parametrize("coefs", [(0.0, 0.0), (0.01, 0.0), (0.0, 0.001), (0.01, 0.001)])
def test_a_loss_whose_coefficient_is_zero_reads_zero_in_last_stats(coefs):
    aux, z = coefs
    torch.manual_seed(0)
    layer = MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=1, aux_loss_coef=aux, z_loss_coef=z)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 5.0  # every token to expert 0: a balance loss of ~E if computed
    layer(torch.rand(16, 8) + 0.5)
    stats = layer.last_stats
    assert (float(stats.load_balancing_loss) == 0.0) == (aux == 0.0)
    assert (float(stats.z_loss) == 0.0) == (z == 0.0)
    if aux:
        assert float(stats.load_balancing_loss) > 3.0  # E = 4 experts, nearly all load on one
    expected = aux * float(stats.load_balancing_loss) + z * float(stats.z_loss)
    assert math.isclose(float(stats.aux_loss), expected, rel_tol=1e-6, abs_tol=0.0)
    assert stats.token_share[0] == 1.0  # the balance is still visible without the loss


def _biased_router_layer():
    """4 tokens of two kinds over 4 experts, top-2, capacity 2 per expert. Unbiased probabilities:
    tokens 0, 1 (kind A) ``[0.3, 0.5, 0.1, 0.1]``, tokens 2, 3 (kind B) ``[0.05, 0.6, 0.25, 0.1]``;
    aux-free bias ``+0.5`` on expert 0. Biased scores: A ``[0.8, 0.5, ...]`` -> choices (0, 1);
    B ``[0.55, 0.6, ...]`` -> choices (1, 0). Expert 1 is A's larger gate but its second choice."""
    layer = MoELayer(d_model=4, d_ff=4, num_experts=4, top_k=2, capacity_factor=1.0, min_capacity=1,
                     score_bias_rate=0.001, aux_loss_coef=0.0)  # fmt: skip
    probs = torch.tensor([[0.3, 0.5, 0.1, 0.1], [0.05, 0.6, 0.25, 0.1]])
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :2] = probs.log().t()  # feature 0: kind A, feature 1: kind B
        layer.router.score_bias_E.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))
    x = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 1.0, 0, 0]])
    return layer, x


def test_the_first_choice_is_the_highest_biased_score_and_claims_capacity_first():
    layer, x = _biased_router_layer()
    routing = layer.router(x)
    assert routing.expert_ids_TK.tolist() == [[0, 1], [0, 1], [1, 0], [1, 0]]
    assert routing.gates_TK[0, 1] > routing.gates_TK[0, 0]  # A's second choice has the larger gate
    capacity = layer.capacity(4)
    assert capacity == 2
    plan = build_dispatch_plan(routing.expert_ids_TK, 4, capacity)  # the layer's plan (no priority order)
    # expert 1 has 4 slots for 2 places: B's first choices (tokens 2, 3) win over A's second choices
    # (tokens 0, 1), though A's come first by position and have the larger gate; likewise expert 0
    assert (plan.row_of_slot_TK >= 0).tolist() == [[True, False]] * 4
    layer(x)
    assert layer.last_stats.kept_per_expert.tolist() == [2, 2, 0, 0]


def test_the_slots_an_expert_received_are_counted_before_the_capacity_cut():
    layer, x = _biased_router_layer()
    layer.train()
    layer(x)
    layer(x)  # two micro-steps of one optimizer step
    assert layer.last_stats.routed_per_expert.tolist() == [4, 4, 0, 0]
    assert layer.last_stats.kept_per_expert.tolist() == [2, 2, 0, 0]
    assert layer.router.load_E.tolist() == [8.0, 8.0, 0.0, 0.0]  # routed, not kept (4, 4)
    layer.eval()
    layer(x)  # evaluation forwards do not count
    assert layer.router.load_E.tolist() == [8.0, 8.0, 0.0, 0.0]
