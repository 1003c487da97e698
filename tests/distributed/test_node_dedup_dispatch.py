"""The node-deduplicating dispatch (``all_to_all="node_dedup"``, moetrain/layers/node_dispatch.py):
its copy plan against a per-token reference, and the layer on real gloo ranks (world 4 as 2 nodes
x 2, world 8 as 2 nodes x 4 and 4 x 2) against one process and against the flat algorithm, with
the rows that cross nodes counted from the split sizes of the exchanges themselves."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moetrain import MoEConfig, MoELayer, shard_experts
from moetrain.layers.dispatch import build_dispatch_plan
from moetrain.layers.node_dispatch import copies_of_tokens, plan_of_real_slots
from moetrain.parallel import ParallelContext
from tests.helpers.dist_utils import run_distributed

D_MODEL, D_FF, EXPERTS = 16, 12, 16


def reference_copies(expert_ids: list[list[int]], kept: list[list[bool]], experts: int, nodes: int):
    """[(node, token, node-local ids of the token's K slots or -1)] in [node][token] order."""
    per_node = experts // nodes
    copies = []
    for node in range(nodes):
        for t, (ids, keep) in enumerate(zip(expert_ids, kept, strict=True)):
            local = [
                e - node * per_node if k and e // per_node == node else -1
                for e, k in zip(ids, keep, strict=True)
            ]
            if any(i >= 0 for i in local):
                copies.append((node, t, local))
    return copies


@pytest.mark.parametrize("kernels", ["custom", "torch"])
@pytest.mark.parametrize(
    ("experts", "top_k", "nodes", "capacity"), [(8, 3, 2, 2), (16, 4, 4, None), (12, 2, 3, 1)]
)
def test_copies_match_a_per_token_reference(kernels, experts, top_k, nodes, capacity):
    g = torch.Generator().manual_seed(experts + top_k + nodes)
    tokens = 40
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    plan = build_dispatch_plan(ids, experts, capacity, kernels=kernels)
    copy_plan, ids_CK = copies_of_tokens(plan, nodes, kernels)
    want = reference_copies(ids.tolist(), (plan.row_of_slot_TK >= 0).tolist(), experts, nodes)
    slots = copy_plan.slot_of_row_N.tolist()
    assert [(s % nodes, s // nodes) for s in slots] == [(m, t) for m, t, _ in want]
    assert ids_CK.tolist() == [local for _, _, local in want]
    assert copy_plan.kept_per_expert_E.tolist() == [
        sum(1 for m, _, _ in want if m == n) for n in range(nodes)
    ]
    for row, slot in enumerate(slots):  # row_of_slot is the inverse of slot_of_row, -1 elsewhere
        assert copy_plan.row_of_slot_TK.view(-1)[slot] == row
    assert int((copy_plan.row_of_slot_TK >= 0).sum()) == len(slots)


def test_plan_of_real_slots_drops_the_spare_slots():
    ids = torch.tensor([[0, 3], [3, 3], [2, 1], [1, 3]])  # 3: the spare
    plan = plan_of_real_slots(ids, 3, "torch")
    assert plan.kept_per_expert_E.tolist() == [1, 2, 1]
    # choice-major within an expert (the plan's default priority): expert 1 takes slot 6 before 5
    assert plan.row_of_slot_TK.tolist() == [[0, -1], [-1, -1], [3, 2], [1, -1]]
    assert plan.slot_of_row_N.tolist() == [0, 6, 5, 4]


def _inputs(rank: int, tokens: int, dtype):
    g = torch.Generator().manual_seed(700 + rank)
    return torch.randn(tokens, D_MODEL, generator=g).to(dtype), torch.randn(tokens, D_MODEL, generator=g).to(
        dtype
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


TOKENS = {"uneven": lambda r: 6 + 5 * r, "skewed": lambda r: 12, "one_empty": lambda r: 0 if r == 1 else 9}


def _layer(cfg, ctx, tokens_of, dtype):
    if tokens_of == "skewed":
        cfg = replace(cfg, score_bias_rate=0.01)
    torch.manual_seed(1234)
    layer = MoELayer(cfg)
    layer = (layer if ctx is None else shard_experts(layer, ctx)).to(dtype)
    if tokens_of == "skewed":  # every token to experts 0..top_k-1: the other ranks' experts get nothing
        with torch.no_grad():
            layer.router.score_bias_E[: cfg.top_k] = 10.0  # the choice only: the gates stay unbiased
    return layer


def _counting_all_to_all(calls: list):
    import torch.distributed as dist

    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        calls.append((group, input.dtype, list(input_split_sizes or []), input.shape))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    dist.all_to_all_single = counting
    return original


def dedup_worker(rank, world, local_world, cases):
    import torch.distributed as dist

    results = []
    for ep_size, layout, top_k, max_nodes, capacity_factor, comm_dtype, dtype, tokens_of in cases:
        dtype = getattr(torch, dtype)
        options = {"ep_size": ep_size, "ep_layout": layout, "comm_dtype": comm_dtype}
        options["local_world_size"] = local_world
        ctx = ParallelContext(all_to_all="node_dedup", **options)
        flat_ctx = ParallelContext(all_to_all="flat", **options)
        cfg = MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=EXPERTS, top_k=top_k, min_capacity=1,
                        capacity_factor=capacity_factor, max_nodes_per_token=max_nodes,
                        aux_loss_coef=0.01)  # fmt: skip
        layer, flat = _layer(cfg, ctx, tokens_of, dtype), _layer(cfg, flat_ctx, tokens_of, dtype)
        reference = _layer(cfg, None, tokens_of, dtype)
        reference.router.set_expert_nodes(ctx.ep_nodes)
        rounds = []
        dispatch = layer.dispatcher.dispatch

        def capture(x_TD, plan, dispatch=dispatch, rounds=rounds):
            out = dispatch(x_TD, plan)
            rounds.append(out[2])
            return out

        layer.dispatcher.dispatch = capture
        tokens = TOKENS[tokens_of]
        x, upstream = _inputs(rank, tokens(rank), dtype)
        runs = {}
        for name, module in (("dedup", layer), ("flat", flat), ("reference", reference)):
            calls: list = []
            original = _counting_all_to_all(calls)
            try:
                xi = x.clone().requires_grad_(True)
                out = module(xi)
                out.backward(upstream)
            finally:
                dist.all_to_all_single = original
            runs[name] = {"out": out.detach(), "grad_x": xi.grad, "router": module.router.weight.grad.clone(),
                          "calls": calls}  # fmt: skip
        # the expert gradients sum every EP rank's tokens
        reference.zero_grad()
        for src in ctx.ep_ranks:
            xs, us = _inputs(src, tokens(src), dtype)
            reference(xs).backward(us)
        local = ctx.local_experts(EXPERTS)

        # what crossed: the copies exchange is the inter-node group's uint8 message of the forward
        nodes, per_node = ctx.ep_node_grid
        node = ctx.ep_rank // per_node
        copies_calls = [
            c for c in runs["dedup"]["calls"] if c[0] is ctx.inter_node_group and c[1] == torch.uint8
        ]
        sent = copies_calls[0][2]
        # expected: (token, other node) pairs with a slot the capacity cut keeps, from the layer's routing
        with torch.no_grad():
            ids = layer.router(x).expert_ids_TK
        kept = build_dispatch_plan(ids, EXPERTS, layer.capacity(x.shape[0])).row_of_slot_TK >= 0
        node_TK = torch.where(kept, ids // (EXPERTS // nodes), nodes)
        reach_TN = torch.zeros(ids.shape[0], nodes + 1, dtype=torch.bool).scatter_(1, node_TK, True)[
            :, :nodes
        ]
        flat_sent = [c for c in runs["flat"]["calls"] if c[0] is flat_ctx.ep_group and c[1] != torch.int64]
        results.append(
            {
                "case": (
                    ep_size,
                    layout,
                    top_k,
                    max_nodes,
                    capacity_factor,
                    comm_dtype,
                    str(dtype),
                    tokens_of,
                ),
                "grid": (nodes, per_node),
                "out": _rel_err(runs["dedup"]["out"], runs["reference"]["out"]),
                "grad_x": _rel_err(runs["dedup"]["grad_x"], runs["reference"]["grad_x"]),
                "router": _rel_err(runs["dedup"]["router"], runs["reference"]["router"]),
                "w1": _rel_err(
                    layer.experts.w1_EDF.grad, reference.experts.w1_EDF.grad[local.start : local.stop]
                ),
                "w2": _rel_err(
                    layer.experts.w2_EFD.grad, reference.experts.w2_EFD.grad[local.start : local.stop]
                ),
                "vs_flat_out": _rel_err(runs["dedup"]["out"], runs["flat"]["out"]),
                "vs_flat_grad_x": _rel_err(runs["dedup"]["grad_x"], runs["flat"]["grad_x"]),
                "sent_per_node": sent,
                "expected_per_node": reach_TN.sum(0).tolist(),
                "round_cross": rounds[0].a2a_plan.cross_node_copies,
                "cross": sum(n for m, n in enumerate(sent) if m != node),
                "expected_cross": int(reach_TN.sum() - reach_TN[:, node].sum()),
                "flat_cross_rows": sum(n for p, n in enumerate(flat_sent[0][2]) if p // per_node != node),
                "kept_slots": int(kept.sum()),
                "span": int(reach_TN.sum(1).max()) if ids.shape[0] else 0,
                "local_rows": int(layer.experts.w1_EDF.grad.abs().sum() > 0),
            }
        )
    return results


TOLERANCE = {  # relative to max |reference|: fp32 and fp64 sums in another order; a reduced wire
    ("float32", None): 2e-5,  # rounds each row on the way out and each partial row on the way back
    ("float64", None): 1e-12,
    ("float32", "bf16"): 8 * 2**-9,
    ("float32", "fp16"): 8 * 2**-11,
}


def _check(all_results, max_nodes_of=lambda r: r["case"][3]):
    for rank_results in all_results:
        for r in rank_results:
            rtol = TOLERANCE[(r["case"][6].removeprefix("torch."), r["case"][5])]
            for key in ("out", "grad_x", "router", "w1", "w2", "vs_flat_out", "vs_flat_grad_x"):
                assert r[key] <= rtol, (r["case"], key, r[key], rtol)
            assert r["sent_per_node"] == r["expected_per_node"], r
            assert r["cross"] == r["expected_cross"] == r["round_cross"], r
            assert r["cross"] <= r["flat_cross_rows"], r  # never more rows across than one per slot
            if max_nodes_of(r) is not None and r["grid"][0] > max_nodes_of(r):
                assert r["span"] <= max_nodes_of(r), r


WORLD4_CASES = [  # ep, layout, top_k, max_nodes, capacity_factor, comm_dtype, dtype, tokens
    (4, "packed", 4, None, None, None, "float32", "uneven"),
    (4, "packed", 4, 1, 0.75, None, "float32", "uneven"),  # capacity: cut slots do not travel
    (4, "packed", 2, None, None, None, "float64", "uneven"),
    (4, "packed", 2, None, None, "bf16", "float32", "skewed"),  # ranks whose experts get no rows
    (4, "packed", 4, 1, None, "fp16", "float32", "one_empty"),  # a rank without tokens
    (2, "spread", 4, 1, None, None, "float32", "uneven"),  # 2 nodes x 1 rank: no intra-node stage
]


@pytest.mark.timeout(300)
def test_world4_two_nodes_of_two_matches_one_process_and_the_flat_algorithm():
    results = run_distributed(dedup_worker, 4, 2, WORLD4_CASES)
    _check(results)
    skewed = [rank[3] for rank in results]
    assert [r["local_rows"] for r in skewed] == [1, 0, 0, 0]  # only rank 0's experts had rows
    limited = [rank[1] for rank in results]  # M = 1 over 2 nodes: fewer crossings than rows
    assert sum(r["cross"] for r in limited) < sum(r["flat_cross_rows"] for r in limited)


WORLD8_CASES = [  # ranks per node first: 4 (2 nodes x 4) or 2 (4 nodes x 2)
    (4, (8, "packed", 4, None, None, None, "float32", "uneven")),
    (4, (8, "packed", 4, 1, 1.0, None, "float32", "uneven")),
    (4, (8, "packed", 2, None, None, "bf16", "float32", "skewed")),
    (4, (8, "packed", 4, 1, None, "fp16", "float32", "one_empty")),
    (2, (8, "packed", 4, 2, None, None, "float32", "uneven")),
    (2, (8, "packed", 4, 1, 1.25, None, "float32", "uneven")),
]


def world8_worker(rank, world, cases):
    return [dedup_worker(rank, world, local_world, [case])[0] for local_world, case in cases]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world8_as_two_nodes_of_four_and_four_nodes_of_two_matches_one_process_and_flat():
    results = run_distributed(world8_worker, 8, WORLD8_CASES)
    _check(results)
    assert [r["grid"] for r in results[0]] == [(2, 4)] * 4 + [(4, 2)] * 2
    for case in (1, 4, 5):  # node-limited (M = 1 of 2 nodes, M = 2 and 1 of 4): far fewer crossings
        rows = [rank[case] for rank in results]
        assert sum(r["cross"] for r in rows) < 0.6 * sum(r["flat_cross_rows"] for r in rows)


def replay_worker(rank, world, local_world):
    import torch.distributed as dist

    ctx = ParallelContext(
        ep_size=world, all_to_all="node_dedup", comm_dtype="fp16", local_world_size=local_world
    )
    cfg = MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=EXPERTS, top_k=4, router_jitter=0.1,
                    capacity_factor=1.0, max_nodes_per_token=1)  # fmt: skip
    torch.manual_seed(5)
    layer = shard_experts(MoELayer(cfg), ctx)
    x, upstream = _inputs(rank, 11, torch.float32)
    calls: list = []
    original = _counting_all_to_all(calls)
    try:
        grads, counts, record_bytes = [], [], []
        for checkpointed in (False, True):
            layer.set_recompute_replay(checkpointed)
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            torch.manual_seed(rank)
            calls.clear()
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False)
                record_bytes.append(layer.replay_record_bytes())
            else:
                out = layer(xi)
            out.backward(upstream)
            counts.append(len(calls))
            grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    finally:
        dist.all_to_all_single = original
    worst = max(float((a - b).abs().max()) for a, b in zip(grads[0], grads[1], strict=True))
    # the recompute planner's estimate of a record (moetrain.recompute) against the record itself
    from moetrain.recompute import _MoEReplayRecorder

    layer.set_recompute_replay(True)
    recorder = _MoEReplayRecorder({"moe": layer})
    out = layer(x.clone().requires_grad_(True))
    recorder.remove()
    estimate = (recorder.replay_bytes["moe"], layer.replay_record_bytes())
    del out
    return worst, counts, record_bytes, layer.replay_record_bytes(), estimate


@pytest.mark.timeout(120)
def test_checkpoint_recompute_replays_without_communicating():
    for worst, (plain_calls, checkpointed_calls), (held,), after, estimate in run_distributed(
        replay_worker, 4, 2
    ):
        assert worst < 1e-6
        assert checkpointed_calls == plain_calls  # the recompute sent nothing
        assert held > 0 and after == 0  # the record lives with its graph
        assert estimate[0] == estimate[1] > 0  # what recompute's budget counts is what the record holds


def compile_worker(rank, world):
    ctx = ParallelContext(ep_size=world, all_to_all="node_dedup", comm_dtype="bf16", local_world_size=1)
    cfg = MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=EXPERTS, top_k=4, capacity_factor=1.0,
                    min_capacity=1, max_nodes_per_token=1)  # fmt: skip
    torch.manual_seed(3)
    layer = shard_experts(MoELayer(cfg), ctx)
    x, upstream = _inputs(rank, 7 + 2 * rank, torch.float32)
    runs = []
    for module in (layer, torch.compile(layer, backend="aot_eager")):
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        out.backward(upstream)
        runs.append([out.detach(), xi.grad, *(p.grad.clone() for p in layer.parameters())])
        layer.zero_grad(set_to_none=True)
    return max(_rel_err(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compiled_layer_equals_eager():
    """Under torch.compile the dispatcher runs eagerly (a padded dispatch plan comes in); the
    compiled layer's output and gradients equal the eager layer's."""
    for error in run_distributed(compile_worker, 2):
        assert error < 1e-6
