"""Expert parallelism on real gloo ranks against single-process references.

World 4 is emulated as 2 nodes x 2 local ranks and world 8 as 2 nodes x 4 (``local_world_size``).
Every rank builds the single-process reference itself from the same seed: the EP layer's
per-expert initialisation depends only on the global expert index, so the reference holds the
very experts that are spread over the EP group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoEConfig, MoELayer, set_aux_loss_scale, shard_experts
from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, exchange_counts
from moetrain.grad_sync import ExpertGradReducer, clip_grad_norm_, global_grad_norm, wrap_data_parallel
from moetrain.parallel import ParallelContext, node_grid
from tests.helpers.dist_utils import run_distributed

D_MODEL, D_FF, EXPERTS = 16, 24, 8
# Relative error bound (vs max |reference|) for reduced-precision payloads: each row is rounded on
# the way out and the output rows again on the way back, unit roundoff u = 2^-9 (bf16) or 2^-11
# (fp16 after the exact power-of-two scaling); with fp32 accumulation elsewhere, 8u covers both
# roundings and their propagation through the expert FFN and the gate-weighted sum.
PAYLOAD_RTOL = {None: 1e-5, "bf16": 8 * 2**-9, "fp16": 8 * 2**-11}


def _inputs(rank: int, tokens: int):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(tokens, D_MODEL, generator=g), torch.randn(tokens, D_MODEL, generator=g)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def layer_equivalence_worker(rank, world, local_world, cases):
    errors = []
    for ep_size, layout, algorithm, comm_dtype, capacity_factor, tokens_of in cases:
        ctx = ParallelContext(
            ep_size=ep_size,
            ep_layout=layout,
            all_to_all=algorithm,
            comm_dtype=comm_dtype,
            local_world_size=local_world,
        )
        cfg = MoEConfig(
            d_model=D_MODEL,
            d_ff=D_FF,
            num_experts=EXPERTS,
            top_k=2,
            capacity_factor=capacity_factor,
            min_capacity=1,
            aux_loss_coef=0.01,
        )
        torch.manual_seed(1234)
        layer = shard_experts(MoELayer(cfg), ctx)
        torch.manual_seed(1234)
        reference = MoELayer(cfg)
        if tokens_of == "skewed":  # every token to experts 0 and 1: the other EP ranks' experts get nothing
            with torch.no_grad():
                for m in (layer, reference):
                    m.router.weight[2:] -= 100.0 * m.router.weight[2:].sign()
                    m.router.weight[:2] = 0
        tokens = {
            "even": lambda r: 20,
            "uneven": lambda r: 5 + 7 * r,
            "skewed": lambda r: 12,
            "one_empty": lambda r: 0 if r == 1 else 9,
        }[tokens_of]

        x, upstream = _inputs(rank, tokens(rank))
        x.requires_grad_(True)
        out = layer(x)
        out.backward(upstream)

        ref_x = x.detach().clone().requires_grad_(True)
        ref_out = reference(ref_x)
        ref_out.backward(upstream)
        # The EP experts' gradients sum the contributions of every rank of the EP group.
        reference.zero_grad()
        for src in ctx.ep_ranks:
            xs, us = _inputs(src, tokens(src))
            reference(xs).backward(us)
        local = ctx.local_experts(EXPERTS)
        rtol = PAYLOAD_RTOL[comm_dtype]
        errors.append(
            {
                "case": (ep_size, layout, ctx.all_to_all, comm_dtype, capacity_factor, tokens_of),
                "rtol": rtol,
                "out": _rel_err(out.detach(), ref_out.detach()),
                "grad_x": _rel_err(x.grad, ref_x.grad),
                "w1": _rel_err(
                    layer.experts.w1_EDF.grad, reference.experts.w1_EDF.grad[local.start : local.stop]
                ),
                "w2": _rel_err(
                    layer.experts.w2_EFD.grad, reference.experts.w2_EFD.grad[local.start : local.stop]
                ),
            }
        )
    return errors


def _check(all_errors):
    for rank_errors in all_errors:
        for e in rank_errors:
            for key in ("out", "grad_x", "w1", "w2"):
                assert e[key] <= e["rtol"], (
                    f"{e['case']}: {key} relative error {e[key]:.2e} > {e['rtol']:.1e}"
                )


WORLD4_CASES = [
    (2, "packed", "flat", None, None, "even"),
    (2, "spread", "flat", None, 0.75, "uneven"),
    (4, "packed", "flat", None, None, "uneven"),
    (4, "packed", "hierarchical", None, None, "uneven"),
    (4, "packed", "hierarchical", None, 0.75, "even"),
    (4, "packed", "auto", None, None, "skewed"),
    (4, "packed", "hierarchical", None, None, "one_empty"),
    (2, "spread", "hierarchical", None, None, "uneven"),
    (4, "packed", "hierarchical", "bf16", None, "uneven"),
    (4, "packed", "hierarchical", "fp16", None, "uneven"),
    (2, "packed", "flat", "fp16", 1.0, "even"),
]

WORLD8_CASES = [
    (2, "packed", "flat", None, None, "uneven"),
    (4, "packed", "flat", None, None, "even"),
    (4, "spread", "hierarchical", None, None, "uneven"),
    (8, "packed", "flat", None, None, "uneven"),
    (8, "packed", "hierarchical", None, 0.75, "uneven"),
    (8, "packed", "auto", "bf16", None, "skewed"),
    (8, "packed", "hierarchical", "fp16", None, "one_empty"),
]


@pytest.mark.timeout(300)
def test_moe_layer_world4_two_nodes_matches_single_process():
    _check(run_distributed(layer_equivalence_worker, 4, 2, WORLD4_CASES))


@pytest.mark.timeout(300)
def test_moe_layer_world8_two_nodes_matches_single_process():
    _check(run_distributed(layer_equivalence_worker, 8, 4, WORLD8_CASES))


def round_trip_worker(rank, world, local_world):
    results = []
    for algorithm in ("flat", "hierarchical"):
        ctx = ParallelContext(ep_size=world, all_to_all=algorithm, local_world_size=local_world)
        g = torch.Generator().manual_seed(rank)
        counts = torch.randint(0, 4, (world, 2), generator=g)
        counts[(rank + 1) % world] = 0  # zeros in the counts
        if rank == 2:
            counts.zero_()  # a rank that sends nothing
        recv_counts, plan = exchange_counts(counts, ctx)
        x = torch.randn(int(counts.sum()), 5, generator=g, requires_grad=True)
        received = all_to_all(x, plan)
        back = all_to_all_reverse(received, plan)
        back.backward(torch.ones_like(back))
        results.append(
            {
                "algorithm": ctx.all_to_all,
                "exact": torch.equal(back.detach(), x.detach()),
                "grad_ones": bool((x.grad == 1).all()),
                "rows": received.shape[0] == int(recv_counts.sum()),
                "sent_counts": counts.tolist(),
                "recv_counts": recv_counts.tolist(),
                "received_first_value_by_source": received.detach().tolist(),
            }
        )
    return results


@pytest.mark.timeout(120)
def test_all_to_all_round_trip_and_counts():
    results = run_distributed(round_trip_worker, 4, 2)
    for rank, per_algorithm in enumerate(results):
        for r in per_algorithm:
            assert r["exact"] and r["grad_ones"] and r["rows"], (rank, r["algorithm"])
            # recv_counts[src] is what src sent to this rank
            for src in range(4):
                assert r["recv_counts"][src] == results[src][0]["sent_counts"][rank]
    # both algorithms deliver identical rows in identical order
    for per_algorithm in results:
        assert (
            per_algorithm[0]["received_first_value_by_source"]
            == per_algorithm[1]["received_first_value_by_source"]
        )


class TinyMoENet(nn.Module):
    def __init__(self, parallel=None):
        """With ``parallel``: the MoE layer's experts sharded over its EP group."""
        super().__init__()
        self.inp = nn.Linear(6, D_MODEL)
        cfg = MoEConfig(
            d_model=D_MODEL, d_ff=D_FF, num_experts=4, top_k=2, capacity_factor=None, aux_loss_coef=0.05
        )
        self.moe = MoELayer(cfg)
        if parallel is not None:
            shard_experts(self.moe, parallel)
        self.out = nn.Linear(D_MODEL, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(self.inp(x))))


def _batch(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)


def optimizer_step_worker(rank, world, local_world, layouts):
    reports = []
    for ep_size, comm_hook in layouts:
        ctx = ParallelContext(ep_size=ep_size, local_world_size=local_world)
        torch.manual_seed(7)
        model = TinyMoENet(ctx)
        torch.manual_seed(7)
        reference = TinyMoENet()
        set_aux_loss_scale(reference, 1.0 / world)  # its loss averages `world` separate forward calls
        ddp = wrap_data_parallel(model, ctx, comm_hook=comm_hook)
        reducer = ExpertGradReducer(model, ctx)
        x, y = _batch(rank)
        F.mse_loss(ddp(x), y).backward()
        reducer.reduce()
        norm = global_grad_norm(model, ctx)
        clipped_norm = clip_grad_norm_(model, max_norm=0.5 * float(norm), parallel=ctx)
        torch.optim.SGD(model.parameters(), lr=0.1).step()

        total = sum(F.mse_loss(reference(*_batch(r)[:1]), _batch(r)[1]) for r in range(world)) / world
        total.backward()
        ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters()))
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5 * float(ref_norm))
        torch.optim.SGD(reference.parameters(), lr=0.1).step()

        local = ctx.local_experts(4)
        ref_params = dict(reference.named_parameters())
        worst = 0.0
        for name, p in model.named_parameters():
            want = ref_params[name]
            if name.startswith("moe.experts."):
                want = want[local.start : local.stop]
            worst = max(worst, float((p - want).detach().abs().max()))
        reports.append(
            {
                "ep_size": ep_size,
                "comm_hook": comm_hook,
                "param_err": worst,
                "norm": float(norm),
                "ref_norm": float(ref_norm),
                "clipped_norm": float(clipped_norm),
            }
        )
    return reports


@pytest.mark.timeout(300)
def test_optimizer_step_and_grad_norm_for_dp_x_ep_layouts():
    """DP x EP in {4x1, 2x2, 1x4}: one clipped SGD step equals one process on the same global batch."""
    layouts = [(1, None), (2, None), (4, None), (2, "fp16"), (1, "fp16")]
    results = run_distributed(optimizer_step_worker, 4, 2, layouts)
    for rank_reports in results:
        for r in rank_reports:
            # Compressed DDP hooks round the dense gradients once (bf16: relative 2^-9, fp16: 2^-11);
            # with lr 0.1 and |grad| < 1 that moves a parameter by well under 1e-3.
            exact = r["comm_hook"] is None
            assert r["param_err"] < (1e-6 if exact else 1e-3), r
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5 if exact else 1e-2), r
            assert r["clipped_norm"] == pytest.approx(r["norm"], rel=1e-6), r


def context_errors_worker(rank, world):
    messages = []
    for options in (
        {"ep_size": 3},
        {"ep_size": 2, "local_world_size": 3},
        {"ep_size": 4, "ep_layout": "spread", "all_to_all": "hierarchical", "local_world_size": 4},
    ):
        try:
            ParallelContext(**options)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    ctx = ParallelContext(ep_size=4, local_world_size=2)
    for build in (
        lambda: shard_experts(MoELayer(d_model=8, d_ff=8, num_experts=6, top_k=2), ctx),
        lambda: wrap_data_parallel(TinyMoENet(ctx), ctx, comm_hook="bf16"),  # gloo has no bf16 hook
    ):
        try:
            build()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages, repr(ctx), ctx.all_to_all


@pytest.mark.timeout(120)
def test_impossible_layouts_raise_value_errors_naming_the_numbers():
    messages, description, algorithm = run_distributed(context_errors_worker, 4)[0]
    assert "ep_size = 3 must divide the world size = 4" in messages[0]
    assert "local_world_size = 3" in messages[1]
    assert messages[2] is None  # spread over one node: a 1 x 4 grid, which the 2-D exchange handles
    assert "num_experts = 6 must be divisible by ep_size = 4" in messages[3]
    assert "needs the nccl backend" in messages[4]
    assert algorithm == "hierarchical" and "ep_size=4" in description


def test_node_grid_needs_the_same_member_count_on_every_node():
    assert node_grid([0, 1, 2, 3], 2) == (2, 2)
    assert node_grid([0, 2, 4, 6], 2) == (4, 1)
    assert node_grid([0, 1, 2], 2) is None  # 2 members on node 0, 1 on node 1: no M x L grid
    assert node_grid([1, 2, 3, 4], 2) is None


def replay_worker(rank, world, local_world):
    import torch.distributed as dist

    ctx = ParallelContext(ep_size=world, all_to_all="hierarchical", local_world_size=local_world)
    cfg = MoEConfig(
        d_model=D_MODEL, d_ff=D_FF, num_experts=EXPERTS, top_k=2, router_jitter=0.1, capacity_factor=1.0
    )
    torch.manual_seed(5)
    layer = shard_experts(MoELayer(cfg), ctx)
    x, upstream = _inputs(rank, 11)
    calls = {"n": 0}
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        grads, counts = [], []
        for checkpointed in (False, True):
            layer.set_recompute_replay(checkpointed)
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            torch.manual_seed(rank)
            calls["n"] = 0
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False)
            else:
                out = layer(xi)
            out.backward(upstream)
            counts.append(calls["n"])
            grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    finally:
        dist.all_to_all_single = original
    worst = max(float((a - b).abs().max()) for a, b in zip(grads[0], grads[1], strict=True))
    return worst, counts


@pytest.mark.timeout(120)
def test_checkpoint_recompute_replays_instead_of_communicating():
    for worst, (plain_calls, checkpointed_calls) in run_distributed(replay_worker, 4, 2):
        assert worst < 1e-6
        assert checkpointed_calls == plain_calls  # the recompute sent nothing


def compile_worker(rank, world, local_world):
    """Per case: dynamo's graphs and breaks for one EP layer forward, and the compiled layer's
    output and gradients against the eager layer's (aot_eager backend)."""
    results = []
    for algorithm, comm_dtype, capacity_factor in (("flat", "fp16", 0.75),):
        ctx = ParallelContext(
            ep_size=world, all_to_all=algorithm, comm_dtype=comm_dtype, local_world_size=local_world
        )
        cfg = MoEConfig(
            d_model=D_MODEL,
            d_ff=D_FF,
            num_experts=EXPERTS,
            top_k=2,
            capacity_factor=capacity_factor,
            min_capacity=1,
        )
        torch.manual_seed(1234)
        layer = shard_experts(MoELayer(cfg), ctx)
        x, upstream = _inputs(rank, 5 + 3 * rank)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(x)
        runs = []
        for module in (layer, torch.compile(layer, backend="aot_eager")):
            xi = x.clone().requires_grad_(True)
            module(xi).backward(upstream)
            runs.append([xi.grad, *(p.grad.clone() for p in layer.parameters())])
            layer.zero_grad(set_to_none=True)
        results.append(
            {
                "case": (algorithm, comm_dtype, capacity_factor),
                "graphs": explained.graph_count,
                "breaks": explained.graph_break_count,
                "reasons": [reason.reason for reason in explained.break_reasons],
                "error": max(_rel_err(a, b) for a, b in zip(*runs, strict=True)),
            }
        )
    return results


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compiled_ep_layer_breaks_only_around_the_exchanges():
    """Under expert parallelism the graph breaks exactly twice, at the dispatch and combine
    exchanges (eager by ``torch.compiler.disable``); the rest of the layer compiles, and the
    compiled layer's gradients equal the eager layer's."""
    for rank_results in run_distributed(compile_worker, 2, 2):
        for result in rank_results:
            assert (result["graphs"], result["breaks"]) == (3, 2), result
            for reason in result["reasons"]:
                assert "torch.compiler.disable" in reason and "AllToAllTokenDispatcher" in reason, reason
            assert result["error"] < 1e-6, result


def test_global_grad_norm_of_an_fp64_model_is_computed_in_fp64():
    """Each gradient's squares are summed in fp64 from its own dtype: an fp64 model's norm is exact
    to fp64 rounding (casting each gradient to fp32 first left a ~1e-9 relative error)."""
    torch.manual_seed(0)
    layer = MoELayer(d_model=D_MODEL, d_ff=D_FF, num_experts=4, top_k=2).double()
    layer(torch.randn(40, D_MODEL, dtype=torch.float64)).square().sum().backward()
    with torch.no_grad():
        layer.router.weight.grad.mul_(1 + 2**-30)  # values fp32 cannot hold
    norm = global_grad_norm(layer)
    exact = torch.sqrt(sum((p.grad**2).sum() for p in layer.parameters()))
    assert norm.dtype == torch.float64
    assert float((norm - exact).abs() / exact) < 1e-15
