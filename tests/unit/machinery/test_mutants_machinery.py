"""Terms the other tests left unchecked (each test names the change to the library it catches):
CPUAdam's ``grad_scale`` under Adam's L2 decay, ``OffloadOptimizer.close()`` writing the delayed
update into the parameters, ``clip_grad_norm_`` on DTensor gradients below and above ``max_norm``,
and the planner's pinned host staging and node_dedup exchange buffers by exact value."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moe_lm import LMConfig, describe_lm
from moetrain.config import MoEConfig
from moetrain.offload import OffloadOptimizer
from moetrain.offload.cpu_adam import CPUAdam
from moetrain.planner import PlanSettings, cluster_preset, make_plan
from moetrain.planner.node_limit import nodes_reached_per_token
from moetrain.planner.plan_layout import layout_stage, wire_row_bytes
from tests.helpers.dist_utils import run_distributed

STEPS = 3
SCALE = 512.0  # a power of two: dividing by it is exact, so the runs agree bit for bit


def _adam_run(grads: list[torch.Tensor], grad_scale: float) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(100))
    optimizer = CPUAdam([param], lr=1e-2, weight_decay=0.1, adamw_mode=False)
    for grad in grads:
        param.grad = grad * grad_scale
        optimizer.step(grad_scale=grad_scale)
    state = optimizer.state[param]
    return param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()


def test_cpu_adam_grad_scale_unscales_the_gradients_under_l2_decay():
    """Adam with L2 decay (``g / s + wd * p``) over 3 steps: gradients scaled by 512 and stepped with
    ``grad_scale=512`` give the unscaled run's weights and moments. Catches ``grad_scale`` not
    passed to the kernel (the single AdamW step of test_cpu_adam.py does not depend on the
    gradient's scale)."""
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(100, generator=generator) for _ in range(STEPS)]
    scaled = _adam_run(grads, SCALE)
    plain = _adam_run(grads, 1.0)
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), scaled, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=name)


def test_offload_close_writes_the_delayed_update_into_the_parameters():
    """``close()`` applies the pending delayed update: afterwards the bf16 parameters equal the fp32
    masters cast, and the weights of the exact optimizer (``overlap="none"``) fed the same
    gradients. The parameters are read before ``optimizer.state`` (reading it applies a pending
    update itself). Catches ``close()`` only waiting for the worker."""
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(64, generator=generator).to(torch.bfloat16)
    grads = [torch.randn(64, generator=generator).to(torch.bfloat16) for _ in range(STEPS)]
    runs = {}
    for overlap in ("delayed", "none"):
        param = nn.Parameter(start.clone())
        optimizer = OffloadOptimizer([param], lr=0.1, overlap=overlap, overlap_after_steps=0)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        optimizer.close()
        runs[overlap] = (param, param.detach().clone(), optimizer)  # the weights before optimizer.state
    param, weights, optimizer = runs["delayed"]
    assert not torch.equal(weights, start)
    assert torch.equal(weights, runs["none"][1])
    assert not optimizer.has_pending
    for overlap, (param, weights, optimizer) in runs.items():
        assert torch.equal(weights, optimizer.state[param]["master"].to(torch.bfloat16)), overlap


def _clip_rank(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """One plain and one DTensor (Shard(0) over a 1-rank mesh) gradient, clipped by ``clip_grad_norm_``
    and, as plain tensors, by ``torch.nn.utils.clip_grad_norm_``, at a max_norm above their norm and
    at one below it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from moetrain.grad_sync import clip_grad_norm_

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(3)
    plain_grad, split_grad = torch.randn(4, generator=generator), torch.randn(4, 2, generator=generator)
    results = {}
    for max_norm in (100.0, 0.5):  # the norm is about 3.5
        model = nn.Module()
        model.plain = nn.Parameter(torch.zeros(4))
        model.split = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
        model.plain.grad = plain_grad.clone()
        model.split.grad = distribute_tensor(split_grad.clone(), mesh, [Shard(0)])
        norm = clip_grad_norm_(model, max_norm=max_norm)
        refs = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, 2))]
        refs[0].grad, refs[1].grad = plain_grad.clone(), split_grad.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(refs, max_norm=max_norm)
        results[str(max_norm)] = [
            norm.float(),
            ref_norm,
            model.plain.grad.clone(),
            model.split.grad.full_tensor(),
            refs[0].grad,
            refs[1].grad,
        ]
    results["inputs"] = [plain_grad, split_grad]
    return results


def test_clip_grad_norm_leaves_dtensor_gradients_below_max_norm_and_scales_them_above_like_torch():
    """``clip_grad_norm_`` scales by ``min(1, max_norm / (norm + 1e-6))``: a DTensor gradient whose norm
    is below max_norm comes back unchanged, one above it is scaled as torch.nn.utils.clip_grad_norm_
    scales the same gradient as a plain tensor. Catches the ``clamp(max=1.0)`` removed (DTensor
    gradients then grew by max_norm / norm)."""
    (results,) = run_distributed(_clip_rank, 1, timeout=120.0)
    plain_grad, split_grad = results["inputs"]
    below = results["100.0"]
    assert below[0].item() < 100.0
    assert torch.equal(below[2], plain_grad) and torch.equal(below[3], split_grad)
    above = results["0.5"]
    torch.testing.assert_close(above[0], above[1], rtol=1e-6, atol=0)
    assert above[0].item() > 0.5
    for got, want in zip(above[2:4], above[4:6], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not torch.allclose(above[3], split_grad)  # it was clipped


def _lm(num_experts: int = 32, top_k: int = 4):
    moe = MoEConfig(d_model=64, d_ff=128, num_experts=num_experts, top_k=top_k)
    return describe_lm(
        LMConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=4, max_seq_len=64, moe=moe)
    )


@pytest.mark.parametrize("groups", [4, 5])
def test_offload_pinned_staging_is_two_apply_groups_of_gradients_and_weights(groups):
    """Without the delayed update each GPU stages two apply groups at once, each a gradient and a
    weight copy of ``ceil(P / groups)`` elements: ``gpus_per_node * 2 * ceil(P / groups) * 2 *
    weight_b`` per node (bf16: weight_b 2). Catches one group counted instead of two."""
    cluster = cluster_preset("a100-80gb", 1)
    settings = PlanSettings(ep_size=8, precision="bf16", offload=True, offload_apply_groups=groups)
    plan = make_plan(_lm(), cluster, settings)
    per_rank, weight_b = plan.params["per_rank"], 2
    group_elements = math.ceil(per_rank / groups)
    assert plan.host_memory["pinned_staging"] == cluster.gpus_per_node * 2 * group_elements * 2 * weight_b
    assert per_rank % 5 != 0  # groups=5 exercises the ceil


def test_node_dedup_exchange_buffers_equal_their_formula():
    """EP 32 over 4 nodes x 8 GPUs, bf16, unchunked: one MoE layer's exchange holds the permuted rows
    sent ``N_s*D*b``, the rows received ``N_r*row_bytes`` and node_dedup's copies sent and received,
    ``ceil(2*N_s*R/K)`` rows (R nodes a token reaches): flat's buffers plus that last term. Catches
    the copies counted once."""
    cluster, model = cluster_preset("a100-80gb", 4), _lm()
    settings = PlanSettings(ep_size=32, micro_batch=2, precision="bf16", all_to_all="node_dedup")
    plan = make_plan(model, cluster, settings)
    flat = make_plan(model, cluster, settings.replace(all_to_all="flat"))
    assert (plan.all_to_all, flat.all_to_all) == ("node_dedup", "flat")
    layout = layout_stage(model, cluster, settings, "cuda")
    assert layout.chunks == 1
    rows, d_model, b = layout.moe_layers[0].rows, 64, 2
    row_bytes = wire_row_bytes(d_model, "bf16", None)
    reached = nodes_reached_per_token(32, 4, 4)  # experts, top_k, nodes
    copies = math.ceil(2 * rows.sent * reached / 4) * row_bytes
    assert flat.gpu_memory["all_to_all_buffers"] == rows.sent * d_model * b + rows.received * row_bytes
    assert plan.gpu_memory["all_to_all_buffers"] == flat.gpu_memory["all_to_all_buffers"] + copies
