"""Node-limited routing (``max_nodes_per_token``): the router against a per-token reference, the
span property, bit-identity where the limit cannot bind, recompute replay, and the layer under
expert parallelism on real gloo ranks (world 4 emulated as 2 nodes x 2) against one process."""

from __future__ import annotations

import math
import shlex
import subprocess
import sys

import pytest
import torch

from moetrain import MoEConfig, MoELayer, shard_experts
from moetrain.layers.router import node_limited_top_k
from moetrain.parallel import ParallelContext
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT


def reference_expert_ids(
    choice: list[list[float]], top_k: int, nodes: int, max_nodes: int
) -> list[list[int]]:
    """One token at a time, in plain Python: node score = sum of its ceil(K/M) best scores; keep the M
    best nodes (lower index first on ties); the K best experts of those (lower index first on ties)."""
    chosen = []
    for row in choice:
        per_node = len(row) // nodes
        best = math.ceil(top_k / max_nodes)
        node_score = [
            sum(sorted(row[m * per_node : (m + 1) * per_node], reverse=True)[:best]) for m in range(nodes)
        ]
        kept = sorted(range(nodes), key=lambda m: (-node_score[m], m))[:max_nodes]
        allowed = [e for e in range(len(row)) if e // per_node in kept]
        chosen.append(sorted(allowed, key=lambda e: (-row[e], e))[:top_k])
    return chosen


def nodes_spanned(expert_ids_TK: torch.Tensor, per_node: int) -> torch.Tensor:
    node_TK = expert_ids_TK // per_node
    return torch.tensor([len(set(row)) for row in node_TK.tolist()])


@pytest.mark.parametrize(
    ("experts", "top_k", "nodes", "max_nodes"),
    [(8, 2, 2, 1), (16, 4, 4, 1), (16, 4, 4, 2), (16, 3, 4, 2), (24, 6, 8, 2), (12, 4, 6, 3), (8, 4, 2, 1)],
)
def test_node_limited_top_k_matches_the_per_token_reference_with_ties(experts, top_k, nodes, max_nodes):
    g = torch.Generator().manual_seed(experts * 100 + top_k * 10 + nodes)
    # four values only: many ties between experts and between node scores
    choice = torch.randint(0, 4, (200, experts), generator=g).double() / 4
    choice[:50] = torch.rand(50, experts, generator=g, dtype=torch.float64)  # and some without ties
    got = node_limited_top_k(choice, top_k, nodes, max_nodes)
    assert got.tolist() == reference_expert_ids(choice.tolist(), top_k, nodes, max_nodes)
    assert int(nodes_spanned(got, experts // nodes).max()) <= max_nodes


def _router_layer(score_function: str, experts: int, top_k: int, max_nodes, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    layer = MoELayer(d_model=16, d_ff=8, num_experts=experts, top_k=top_k, score_function=score_function,
                     max_nodes_per_token=max_nodes, score_bias_rate=0.01 if bias else 0.0)  # fmt: skip
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        if bias:
            layer.router.score_bias_E.copy_(torch.randn(experts) * 0.05)
    return layer


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("max_nodes", "nodes"), [(1, 2), (1, 4), (2, 4), (1, 8), (2, 8)])
def test_the_router_matches_the_reference(score_function, bias, max_nodes, nodes):
    experts, top_k = 32, 4
    layer = _router_layer(score_function, experts, top_k, max_nodes, bias)
    with torch.no_grad():  # zero rows: the experts of the last node score exactly alike (ties)
        layer.router.weight[-experts // nodes :] = 0
    layer.router.set_expert_nodes(nodes)
    assert layer.router.limits_nodes
    x = torch.randn(300, 16, dtype=torch.float64)
    layer.double()
    routing = layer.router(x)
    choice = routing.probs_TE + (layer.router.score_bias_E if bias else 0)
    assert routing.expert_ids_TK.tolist() == reference_expert_ids(choice.tolist(), top_k, nodes, max_nodes)
    # the gates are the unbiased scores of the chosen experts, normalised over the K choices
    chosen = routing.probs_TE.gather(1, routing.expert_ids_TK)
    torch.testing.assert_close(routing.gates_TK, chosen / chosen.sum(-1, keepdim=True))


@pytest.mark.parametrize("max_nodes", [1, 2, 3])
def test_every_token_s_experts_span_at_most_max_nodes(max_nodes):
    experts, top_k, nodes = 64, 6, 8
    limited = _router_layer("softmax", experts, top_k, max_nodes, bias=False, seed=3)
    limited.router.set_expert_nodes(nodes)
    plain = _router_layer("softmax", experts, top_k, None, bias=False, seed=3)
    x = torch.randn(2000, 16)
    spans = nodes_spanned(limited.router(x).expert_ids_TK, experts // nodes)
    assert int(spans.max()) <= max_nodes
    assert int(nodes_spanned(plain.router(x).expert_ids_TK, experts // nodes).max()) > max_nodes  # it binds


def _output_and_grads(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = layer(x)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], upstream)
    return [out.detach(), *grads]


@pytest.mark.parametrize(("max_nodes", "nodes"), [(2, 2), (4, 2), (4, 8), (2, 4), (5, 8)])
def test_bit_identical_to_the_plain_router_where_the_limit_cannot_bind(max_nodes, nodes):
    """M >= nodes or M >= top_k (= 2 or 4 here): the same experts, gates, output and gradients."""
    top_k = 2 if max_nodes == 2 and nodes == 4 else 4
    options = {"d_model": 16, "d_ff": 8, "num_experts": 16, "top_k": top_k, "capacity_factor": 1.0}
    torch.manual_seed(0)
    plain = MoELayer(**options)
    torch.manual_seed(0)
    limited = MoELayer(**options, max_nodes_per_token=max_nodes)
    limited.router.set_expert_nodes(nodes)
    assert not limited.router.limits_nodes
    x, upstream = torch.randn(2, 30, 16), torch.randn(2, 30, 16)
    for a, b in zip(
        _output_and_grads(limited, x, upstream), _output_and_grads(plain, x, upstream), strict=True
    ):
        assert torch.equal(a, b)


def test_recompute_replays_the_recorded_node_limited_choice():
    """Activation checkpointing with recompute replay: the backward equals the plain one, and the
    recompute reuses the recorded expert ids even where it would route differently (router jitter
    with the RNG state not restored), so the limit holds for the replayed choice as recorded."""
    torch.manual_seed(0)
    layer = MoELayer(d_model=16, d_ff=8, num_experts=8, top_k=4, max_nodes_per_token=1, router_jitter=0.5,
                     capacity_factor=None)  # fmt: skip
    layer.router.set_expert_nodes(2)
    x, upstream = torch.randn(40, 16), torch.randn(40, 16)
    recorded = []
    layer.router.register_forward_hook(lambda m, args, out: recorded.append(out.expert_ids_TK))

    def grads(checkpointed: bool, replay: bool, preserve_rng_state: bool = True) -> list[torch.Tensor]:
        layer.set_recompute_replay(replay)
        torch.manual_seed(1)
        xi = x.clone().requires_grad_(True)
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(
                layer, xi, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )
        else:
            out = layer(xi)
        out.backward(upstream)
        result = [xi.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return result

    plain = grads(checkpointed=False, replay=False)
    for a, b in zip(grads(checkpointed=True, replay=True), plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert len(recorded) == 3 and torch.equal(recorded[0], recorded[2])
    recorded.clear()
    grads(checkpointed=True, replay=True, preserve_rng_state=False)  # the recompute's jitter differs
    assert torch.equal(recorded[0], recorded[1])  # ... but it replayed the recorded choice
    grads(checkpointed=True, replay=False, preserve_rng_state=False)
    assert not torch.equal(recorded[2], recorded[3])  # without replay it routes anew
    assert all(int(nodes_spanned(ids, 4).max()) == 1 for ids in recorded)


def test_bad_settings_are_one_line_value_errors():
    base = {"d_model": 8, "d_ff": 8, "num_experts": 8, "top_k": 2}
    for value in (0, True, 1.0, "1"):
        with pytest.raises(ValueError, match=r"max_nodes_per_token must be an integer >= 1 or None"):
            MoEConfig(**base, max_nodes_per_token=value)
    with pytest.raises(ValueError, match=r"cannot be combined with num_prototypes = 2"):
        MoEConfig(**base, num_prototypes=2, max_nodes_per_token=1)
    MoEConfig(**base, num_prototypes=2, max_nodes_per_token=2)  # >= top_k: never binds, allowed
    layer = MoELayer(**{**base, "top_k": 4}, max_nodes_per_token=1)
    with pytest.raises(ValueError, match=r"1 of the 4 nodes hold 2 experts, fewer than top_k = 4"):
        layer.router.set_expert_nodes(4)
    with pytest.raises(ValueError, match=r"expert nodes must be an integer >= 1 dividing num_experts = 8"):
        layer.router.set_expert_nodes(3)
    with pytest.raises(ValueError, match=r"needs every node to hold the same number"):
        layer.router.set_expert_nodes(None)
    MoELayer(**base, max_nodes_per_token=2).router.set_expert_nodes(None)  # cannot bind: allowed


@pytest.mark.slow
def test_compiles_to_one_graph_equal_to_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoELayer(d_model=16, d_ff=8, num_experts=8, top_k=4, max_nodes_per_token=1, score_bias_rate=0.01)
    layer.router.set_expert_nodes(2)
    x, upstream = torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for a, b in zip(
        _output_and_grads(compiled, x, upstream), _output_and_grads(layer, x, upstream), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


D_MODEL, EXPERTS = 16, 8


def _tokens(rank: int, count: int):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randn(count, D_MODEL, generator=g), torch.randn(count, D_MODEL, generator=g)


def ep_worker(rank, world, cases):
    results = []
    for ep_size, layout, algorithm, top_k, max_nodes, bias in cases:
        ctx = ParallelContext(ep_size=ep_size, ep_layout=layout, all_to_all=algorithm, local_world_size=2)
        cfg = MoEConfig(d_model=D_MODEL, d_ff=12, num_experts=EXPERTS, top_k=top_k, capacity_factor=None,
                        max_nodes_per_token=max_nodes, score_bias_rate=0.01 if bias else 0.0)  # fmt: skip
        torch.manual_seed(7)
        layer = shard_experts(MoELayer(cfg), ctx)
        torch.manual_seed(7)
        reference = MoELayer(cfg)
        reference.router.set_expert_nodes(ctx.ep_nodes)  # one process, told the same node count
        if bias:
            with torch.no_grad():
                for m in (layer, reference):
                    m.router.score_bias_E.copy_(torch.linspace(-0.05, 0.05, EXPERTS))
        x, upstream = _tokens(rank, 9 + 4 * rank)
        x.requires_grad_(True)
        out = layer(x)
        out.backward(upstream)
        ref_x = x.detach().clone().requires_grad_(True)
        ref_out = reference(ref_x)
        ref_out.backward(upstream)
        ref_router_grad = reference.router.weight.grad.clone()  # dense: from this rank's tokens only
        reference.zero_grad()  # the expert gradients sum over every rank of the EP group
        for src in ctx.ep_ranks:
            xs, us = _tokens(src, 9 + 4 * src)
            reference(xs).backward(us)
        local = ctx.local_experts(EXPERTS)
        ids = layer.router(x.detach()).expert_ids_TK
        results.append(
            {
                "case": (ep_size, layout, ctx.all_to_all, top_k, max_nodes, bias),
                "nodes": ctx.ep_nodes,
                "limits": layer.router.limits_nodes,
                "span": int(nodes_spanned(ids, EXPERTS // ctx.ep_nodes).max()),
                "out": (out.detach() - ref_out.detach()).abs().max().item(),
                "grad_x": (x.grad - ref_x.grad).abs().max().item(),
                "w1": (layer.experts.w1_EDF.grad - reference.experts.w1_EDF.grad[local.start : local.stop])
                .abs()
                .max()
                .item(),
                "router": (layer.router.weight.grad - ref_router_grad).abs().max().item(),
            }
        )
    return results


EP_CASES = [
    (4, "packed", "flat", 4, 1, False),  # 2 nodes x 2 ranks, 4 experts per node
    (4, "packed", "hierarchical", 4, 1, True),
    (4, "packed", "hierarchical", 2, 1, False),
    (2, "spread", "flat", 4, 1, False),  # ranks 0 and 2: 2 nodes x 1
    (2, "packed", "flat", 4, 1, False),  # both on one node: nothing to limit
]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_expert_parallel_layer_equals_one_process_with_the_same_node_count():
    for rank_results in run_distributed(ep_worker, 4, EP_CASES):
        for r in rank_results:
            ep_size, layout = r["case"][:2]
            expected_nodes = 1 if (ep_size, layout) == (2, "packed") else 2
            assert (r["nodes"], r["limits"]) == (expected_nodes, expected_nodes == 2), r
            assert r["span"] <= (1 if expected_nodes == 2 else 2), r
            for key in ("out", "grad_x", "w1", "router"):
                assert r[key] < 1e-5, (r["case"], key, r[key])


ROUTING_DOC = ROOT / "docs" / "routing.md"


def _node_limited_section() -> str:
    return ROUTING_DOC.read_text(encoding="utf-8").split("## Node-limited routing", 1)[1]


def test_the_documented_example_runs(capsys):
    blocks = _node_limited_section().split("```python\n")[1:]
    assert len(blocks) == 1
    exec(compile(blocks[0].split("```", 1)[0], str(ROUTING_DOC), "exec"), {})  # noqa: S102 - our own docs
    assert capsys.readouterr().out == "True\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_documented_quality_runs_start(tmp_path):
    """The quality section's demo commands (the first pair; the second differs only by its seed) run
    as written but for 2 steps and 4 held-out images."""
    section = _node_limited_section().split("### Quality cost on the demo task", 1)[1]
    commands = [
        shlex.split(line) for line in section.splitlines() if line.startswith("python scripts/demo.py")
    ]
    assert len(commands) == 4

    def without_limit_out_dir_and_seed(words: list[str]) -> list[str]:
        drop = {i + d for i, w in enumerate(words) for d in (0, 1) if w == "--out-dir"}
        drop |= {
            i + d
            for i, w in enumerate(words)
            for d in (-1, 0)
            if w.startswith(("model.moe.max_nodes", "seed="))
        }
        return [w for i, w in enumerate(words) if i not in drop]

    assert len({tuple(without_limit_out_dir_and_seed(c)) for c in commands}) == 1  # the same run otherwise
    assert ["model.moe.max_nodes_per_token=1" in c for c in commands] == [False, True, False, True]
    assert ["seed=1" in c for c in commands] == [False, False, True, True]
    commands = commands[:2]
    root = ROUTING_DOC.parents[1]
    for index, words in enumerate(commands):
        words = [*words, "--steps", "2", "--eval-limit", "4"]
        words[words.index("--out-dir") + 1] = str(tmp_path / f"run{index}")
        result = subprocess.run(
            [sys.executable, *words[1:]], cwd=root, capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "caption accuracy (exact match, held-out)" in result.stdout
        limited = "routing as in training: experts over 2 nodes, max_nodes_per_token 1" in result.stdout
        assert limited == (index == 1)
