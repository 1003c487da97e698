"""The aux-loss scale under gradient accumulation, the schedule of a skipped step, the scale given
to the aux loss's gradient and the node-limit check at its boundary: cases a mutation review found
no test for."""

from __future__ import annotations

import pytest
import torch

from moetrain import MoELayer, set_aux_loss_scale
from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import Trainer
from moetrain.layers.router import check_expert_nodes
from tests.unit.engine.test_engine import tiny


def _trainer(config: dict) -> Trainer:
    return Trainer(config_from_dict(TrainConfig, config))


class _FixedBatches:
    """Stands in for ``trainer.batches``: hands out the given ``(inputs, targets)`` in turn."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self._batches = iter(batches)
        self.tokens_per_batch = batches[0][0].numel()

    def next(self):
        return next(self._batches)


def test_accumulated_router_gradient_equals_one_micro_batch_of_the_same_tokens(tmp_path):
    """grad_accum = 2 of 4 sequences and grad_accum = 1 of the same 8 give the same gradients,
    router included: the z-loss and the sequence balance loss (means over tokens and sequences) are
    scaled by 1 / grad_accum like the loss. Dropless, no jitter, no clipping: nothing else depends
    on the split."""
    losses = {
        "model.moe.router_jitter": 0.0,
        "model.moe.capacity_factor": 0,
        "model.moe.aux_loss_coef": 0.0,
        "model.moe.z_loss_coef": 0.5,
        "model.moe.seq_aux_loss_coef": 0.5,
        "optim.grad_clip": 0.0,
        "steps": 1,
    }
    whole = _trainer(tiny(tmp_path / "whole", grad_accum=1, **{"data.micro_batch_size": 8}, **losses))
    split = _trainer(tiny(tmp_path / "split", grad_accum=2, **{"data.micro_batch_size": 4}, **losses))
    for (name, a), b in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        assert torch.equal(a, b), name  # the same initial weights
    inputs, targets = whole.batches.next()
    whole.batches = _FixedBatches([(inputs, targets)])
    split.batches = _FixedBatches([(inputs[:4], targets[:4]), (inputs[4:], targets[4:])])
    whole.train_step()
    split.train_step()
    layers = [m for m in split.model.modules() if isinstance(m, MoELayer)]
    assert layers and all(m.aux_loss_scale == 0.5 for m in layers)  # loss_scale 1 / grad_accum 2
    for (name, a), b in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    router = "blocks.0.ffn.router.weight"
    assert dict(whole.model.named_parameters())[router].grad.abs().max() > 1e-3
    whole.close()
    split.close()


def test_a_skipped_step_leaves_the_schedule_and_the_score_biases(tmp_path):
    """A NaN loss at step 1: the step is skipped, the LR schedule does not advance (step 2 trains
    at step 1's learning rate, warm-up 1/2) and the aux-free score biases stay at zero."""
    trainer = _trainer(tiny(tmp_path, steps=4, **{"model.moe.score_bias_rate": 0.01}))
    loss_fn = trainer.loss_fn
    trainer.loss_fn = lambda output, targets: loss_fn(output, targets) * float("nan")
    biases = [m.router.score_bias_E.clone() for m in trainer.model.modules() if isinstance(m, MoELayer)]
    assert biases
    first = trainer.train_step()
    assert first["skipped_steps"] == 1 and trainer.scheduler.last_epoch == 0
    after = [m.router.score_bias_E for m in trainer.model.modules() if isinstance(m, MoELayer)]
    assert all(torch.equal(a, b) for a, b in zip(after, biases, strict=True))
    trainer.loss_fn = loss_fn
    second = trainer.train_step()
    assert second["skipped_steps"] == 1 and second["lr"] == first["lr"] == pytest.approx(3e-3 / 2)
    assert trainer.scheduler.last_epoch == 1
    moved = [m.router.score_bias_E for m in trainer.model.modules() if isinstance(m, MoELayer)]
    assert any(not torch.equal(a, b) for a, b in zip(moved, biases, strict=True))  # updates resume
    trainer.close()


@pytest.mark.parametrize("scale", [0.25, 3.0])
def test_the_aux_loss_gradient_scales_with_set_aux_loss_scale(scale):
    """The output unused (loss ``0 * y.sum()``): the router's gradient is the aux loss's alone,
    ``scale * d(aux)/dW`` after ``set_aux_loss_scale(layer, scale)``."""

    def router_grad(s: float) -> torch.Tensor:
        torch.manual_seed(1)
        layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2, aux_loss_coef=0.1).double()
        set_aux_loss_scale(layer, s)
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        (layer(x).sum() * 0.0).backward()
        return layer.router.weight.grad.clone()

    unit = router_grad(1.0)
    assert unit.abs().max() > 0
    torch.testing.assert_close(router_grad(scale), scale * unit, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "nodes", "max_nodes"),
    [(8, 3, 4, 1), (8, 5, 4, 2)],  # the kept nodes hold top_k - 1 experts
)
def test_kept_nodes_one_expert_short_of_top_k_are_refused(num_experts, top_k, nodes, max_nodes):
    with pytest.raises(ValueError, match=f"max_nodes_per_token = {max_nodes}: .*top_k = {top_k}") as info:
        check_expert_nodes(num_experts, top_k, nodes, max_nodes)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "nodes", "max_nodes"),
    [(12, 3, 4, 1), (8, 4, 4, 2)],  # the kept nodes hold exactly top_k experts
)
def test_kept_nodes_holding_exactly_top_k_experts_pass(num_experts, top_k, nodes, max_nodes):
    check_expert_nodes(num_experts, top_k, nodes, max_nodes)
