"""Models built and run on the ``meta`` device: shapes and dtypes without memory, which is how a
trillion-parameter model is planned. The dispatch plan on ``meta`` keeps the most rows it could
(every slot dropless, ``min(T*K, E*capacity)`` with a capacity): the memory a planner budgets."""

from __future__ import annotations

import pytest
import torch

from m6_moe.config import M6Config
from m6_moe.model import M6Model
from moe_lm import LMConfig, MoETransformerLM
from moetrain import MoELayer
from moetrain.layers import dispatch


@pytest.mark.parametrize("capacity_factor, rows", [(None, 30), (0.5, 4 * 4)])
def test_moe_layer_runs_forward_and_backward_on_meta(capacity_factor, rows, monkeypatch):
    plans = []
    build = dispatch.build_dispatch_plan

    def spy(*args, **kwargs):
        plans.append(build(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr("moetrain.layers.route.build_dispatch_plan", spy)
    with torch.device("meta"):
        layer = MoELayer(
            d_model=16, d_ff=24, num_experts=4, top_k=2, capacity_factor=capacity_factor, shared_expert_d_ff=8
        )
        x = torch.randn(3, 5, 16, dtype=torch.bfloat16, requires_grad=True)
        out = layer(x)
        out.sum().backward()
    assert out.shape == (3, 5, 16) and out.dtype == torch.bfloat16 and out.is_meta
    assert plans[0].slot_of_row_N.shape == (rows,)  # 15 tokens x 2 choices, or 4 experts x capacity 4
    assert x.grad.shape == x.shape and layer.experts.w1_EDF.grad.shape == (4, 16, 24)


def test_language_model_runs_on_meta():
    with torch.device("meta"):
        model = MoETransformerLM(LMConfig(num_layers=2))
        logits = model(torch.randint(0, 256, (2, 12)))
        logits.sum().backward()
    assert logits.shape == (2, 12, 256) and logits.is_meta
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


@pytest.mark.parametrize("preset", ["tiny", "1T"])
def test_m6_runs_forward_on_meta(preset):
    """The 1T preset too: built and run without allocating a byte of its parameters."""
    config = M6Config.preset(preset)
    with torch.device("meta"):
        model = M6Model(config)
        batch, prefix, target = 2, 3, 5
        images = torch.randn(batch, config.image_channels, config.image_size, config.image_size)
        prefix_ids = torch.randint(0, config.vocab_size, (batch, prefix))
        target_ids = torch.randint(0, config.vocab_size, (batch, target))
        logits = model(
            prefix_ids, target_ids, images, target_mask=torch.ones(batch, target, dtype=torch.bool)
        )
    assert logits.shape == (batch, target, config.vocab_size) and logits.is_meta
