"""The planner's model of node-limited routing (moetrain/planner/node_limit.py) against routing random
tokens through real routers, and its place in a plan, the CLI and docs/planner.md."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess

import pytest
import torch

from moe_lm import LMConfig, describe_lm
from moetrain.config import MoEConfig
from moetrain.layers.router import TopKRouter
from moetrain.planner import PlanSettings, cluster_preset, make_plan
from moetrain.planner.cli import add_plan_parser
from moetrain.planner.comm import group_layout
from moetrain.planner.node_limit import cross_node_row_share, nodes_reached_per_token, remote_nodes_per_token
from tests.helpers.paths import ROOT


def simulate(experts: int, top_k: int, nodes: int, prototypes: int = 1, max_nodes=None, tokens: int = 20000):
    """Routes ``tokens`` random tokens through a router whose weight rows are orthonormal (so the
    logits are i.i.d. standard normal: uniform routing), the token t starting on node t mod N:
    (share of rows crossing nodes, mean nodes reached, mean remote nodes reached) per token."""
    g = torch.Generator().manual_seed(experts * 7 + top_k * 5 + nodes)
    config = MoEConfig(d_model=experts, d_ff=4, num_experts=experts, top_k=top_k, num_prototypes=prototypes,
                       max_nodes_per_token=max_nodes)  # fmt: skip
    router = TopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(
            torch.linalg.qr(torch.randn(experts, experts, generator=g, dtype=torch.float64))[0]
        )
    router.set_expert_nodes(nodes)
    x = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
    node_TK = router(x).expert_ids_TK // (experts // nodes)
    home_T1 = (torch.arange(tokens) % nodes).view(-1, 1)
    reached_TN = torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
    remote = reached_TN.sum(1) - reached_TN.gather(1, home_T1).squeeze(1).long()
    cross = (node_TK != home_T1).double().mean()
    return float(cross), float(reached_TN.sum(1).double().mean()), float(remote.double().mean())


@pytest.mark.parametrize(
    ("experts", "top_k", "nodes", "prototypes", "max_nodes"),
    [
        (16, 4, 2, 1, None),
        (16, 4, 2, 1, 1),
        (32, 4, 4, 1, None),
        (32, 4, 4, 1, 1),
        (32, 8, 8, 1, None),
        (16, 4, 4, 2, None),  # prototype groups on nodes {0, 1} and {2, 3}
        (12, 2, 3, 2, None),  # node 1 straddles the two prototype groups
    ],
)
def test_the_formulas_match_a_simulation(experts, top_k, nodes, prototypes, max_nodes):
    cross, reached, remote = simulate(experts, top_k, nodes, prototypes, max_nodes)
    assert cross == pytest.approx(cross_node_row_share(nodes), abs=0.015)  # the limit changes nothing here
    assert reached == pytest.approx(
        nodes_reached_per_token(experts, top_k, nodes, prototypes, max_nodes), abs=0.03
    )
    assert remote == pytest.approx(
        remote_nodes_per_token(experts, top_k, nodes, prototypes, max_nodes), abs=0.03
    )


def test_a_binding_limit_above_one_node_is_an_upper_bound():
    cross, reached, _ = simulate(32, 4, 4, max_nodes=2)
    assert nodes_reached_per_token(32, 4, 4, max_nodes=2) == 2.0
    assert 1.9 < reached <= 2.0 and cross == pytest.approx(0.75, abs=0.015)
    assert nodes_reached_per_token(32, 4, 4) == pytest.approx(4 * (1 - 10626 / 35960))  # C(24,4) / C(32,4)


def lm(num_experts: int = 32, top_k: int = 4, prototypes: int = 1, max_nodes=None):
    moe = MoEConfig(d_model=64, d_ff=128, num_experts=num_experts, top_k=top_k, num_prototypes=prototypes,
                    max_nodes_per_token=max_nodes)  # fmt: skip
    return describe_lm(
        LMConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=4, max_seq_len=64, moe=moe)
    )


def test_the_plan_reports_the_limit_and_leaves_the_all_to_all_bytes_alone():
    cluster = cluster_preset("a100-80gb", 4)  # 4 nodes x 8 GPUs
    settings = PlanSettings(ep_size=32, micro_batch=2)
    plain = make_plan(lm(), cluster, settings)
    assert plain.node_limit is None and "node-limited" not in plain.format_table()
    limited = make_plan(lm(), cluster, settings.replace(max_nodes_per_token=1))
    from_model = make_plan(lm(max_nodes=1), cluster, settings)
    assert from_model.node_limit == limited.node_limit
    nl = limited.node_limit
    inter = next(t.inter_bytes for t in plain.traffic if t.name == "all_to_all")
    assert [t.to_dict() for t in limited.traffic] == [t.to_dict() for t in plain.traffic]
    assert (nl["ep_nodes"], nl["binds"], nl["exact"], nl["nodes_reached_per_token"]) == (4, True, True, 1.0)
    assert nl["all_to_all_inter_node_bytes"] == nl["per_slot_inter_node_bytes"] == inter
    assert nl["cross_node_row_share"] == 0.75 and nl["all_to_all"] == "hierarchical"
    # node_dedup: one copy per node reached instead of K rows, + 12 K bytes of ids and gates per copy
    # beside the 4 trips of a w = 64 x 2-byte row: inter * reached / K * (1 + 3 K / w)
    metadata = 1 + 3 * 4 / 128
    assert nl["node_dedup_inter_node_bytes"] == pytest.approx(inter / 4 * metadata)
    unlimited = nodes_reached_per_token(32, 4, 4)
    assert nl["node_dedup_inter_node_bytes_unlimited"] == pytest.approx(inter * unlimited / 4 * metadata)
    table = limited.format_table()
    assert f"a token's 4 rows reach 1.00 nodes ({unlimited:.2f} without the limit)" in table
    assert "hierarchical (one row per routed slot; 75.0% of the rows cross nodes, limit or not)" in table
    assert limited.to_dict()["node_limit"] == nl
    unset = make_plan(lm(max_nodes=1), cluster, settings.replace(max_nodes_per_token=None))
    assert unset.node_limit is None
    two = make_plan(lm(), cluster, settings.replace(max_nodes_per_token=2)).node_limit
    assert (two["exact"], two["nodes_reached_per_token"]) == (False, 2.0)
    assert (
        "reach at most 2 nodes"
        in make_plan(lm(), cluster, settings.replace(max_nodes_per_token=2)).format_table()
    )
    loose = make_plan(lm(), cluster, settings.replace(max_nodes_per_token=4)).node_limit
    assert (
        not loose["binds"]
        and loose["node_dedup_inter_node_bytes"] == loose["node_dedup_inter_node_bytes_unlimited"]
    )


def test_planning_with_node_dedup_models_its_bytes_and_compares_with_the_per_slot_algorithm():
    cluster = cluster_preset("a100-80gb", 4)  # EP 32 over 4 nodes x 8 GPUs
    settings = PlanSettings(ep_size=32, micro_batch=2, all_to_all="node_dedup")
    limited = make_plan(lm(max_nodes=1), cluster, settings)
    hier = make_plan(lm(max_nodes=1), cluster, settings.replace(all_to_all="hierarchical"))
    assert (limited.all_to_all, hier.all_to_all) == ("node_dedup", "hierarchical")
    rows = next(t for t in limited.traffic if t.name == "all_to_all")
    per_slot = next(t for t in hier.traffic if t.name == "all_to_all")
    layers = 2  # micro-steps 1
    assert rows.calls == 10 * layers and rows.inter_messages == 6 * 3 * layers
    assert rows.intra_bytes == pytest.approx(per_slot.intra_bytes)  # the same K rows fan out in the node
    assert rows.inter_bytes == pytest.approx(per_slot.inter_bytes / 4 * (1 + 3 * 4 / 128))  # 1 node of 4
    assert limited.all_to_all_alternative.name == "all_to_all_hierarchical"
    nl = limited.node_limit
    assert nl["all_to_all"] == "node_dedup" and nl["all_to_all_inter_node_bytes"] == rows.inter_bytes
    assert nl["per_slot_inter_node_bytes"] == per_slot.inter_bytes
    table = limited.format_table()
    assert "all_to_all (node_dedup)" in table and "all_to_all (hierarchical, not used)" in table
    assert table.count(", used") == 1 and "without the limit), used" in table
    from moetrain.planner.plan import plan_communicators

    layout = group_layout(list(range(32)), 8)
    names = [c.name for c in plan_communicators(32, 32, 1, "node_dedup", layout)]
    assert names == ["world", "ep", "ep_intra_node", "ep_inter_node"]  # node_dedup's two subgroups
    # without a limit node_dedup still pays where a token's K experts share nodes
    plain = make_plan(lm(), cluster, settings)
    reached = nodes_reached_per_token(32, 4, 4)
    plain_rows = next(t for t in plain.traffic if t.name == "all_to_all")
    assert plain_rows.inter_bytes == pytest.approx(per_slot.inter_bytes * reached / 4 * (1 + 3 * 4 / 128))
    with pytest.raises(ValueError, match="all_to_all = 'node_dedup' needs every expert-parallel group"):
        make_plan(
            lm(num_experts=24),
            cluster_preset("a100-80gb", 3),
            PlanSettings(ep_size=12, all_to_all="node_dedup"),
        )


def test_limits_the_model_or_layout_cannot_take_are_value_errors():
    cluster = cluster_preset("a100-80gb", 4)
    with pytest.raises(ValueError, match="cannot be combined with num_prototypes = 2"):
        make_plan(lm(prototypes=2), cluster, PlanSettings(ep_size=32, max_nodes_per_token=1))
    with pytest.raises(ValueError, match="1 of the 4 nodes hold 2 experts, fewer than top_k = 4"):
        make_plan(
            lm(num_experts=8), cluster, PlanSettings(ep_size=8, ep_layout="spread", max_nodes_per_token=1)
        )
    with pytest.raises(ValueError, match="max_nodes_per_token must be an integer >= 1 or 'model' or None"):
        PlanSettings(max_nodes_per_token=0)
    ragged = cluster_preset("a100-80gb", 3)  # EP groups of 12 packed on nodes of 8: 8 + 4 ranks
    with pytest.raises(ValueError, match="needs every node to hold the same number"):
        make_plan(lm(num_experts=24), ragged, PlanSettings(ep_size=12, max_nodes_per_token=1))


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moetrain")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_the_m6_1t_section_of_docs_planner_md_is_the_planner_s_output(capsys, monkeypatch, tmp_path):
    """The section's commands run (the plain top-2 config made by its sed line), every line quoted
    from their output is in what they print today, and the figures in its text follow from the
    formulas and the plans."""
    monkeypatch.chdir(ROOT)
    doc = (ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    section = doc.split("### Node-limited routing and node_dedup on M6-1T", 1)[1].split("\n## ", 1)[0]
    command, quoted, top2_commands, top2_quoted = section.split("```\n")[1::2]
    words = shlex.split(command.replace("\\\n", " "))
    assert _run(words[1:]) == 1  # node_dedup's buffers leave it over the usable memory, as the section says
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    for line in quoted.strip("\n").splitlines():
        assert line in out, line
    with pytest.raises(ValueError, match="cannot be combined with num_prototypes = 2"):
        _run(words[1:-1] + ["1"])
    assert _run([*words[1:], "--json"]) == 1
    dedup = json.loads(capsys.readouterr().out)
    assert _run([*words[1:10], "--json"]) == 0  # the config's hierarchical all-to-all, no limit
    hier = json.loads(capsys.readouterr().out)
    unchunked = dedup["all_to_all_alternative"]  # the hierarchical all-to-all in one chunk
    assert unchunked["name"] == "all_to_all_hierarchical" and dedup["time"]["a2a_chunks"] == 1
    extra = dedup["time"]["all_to_all_s"] - unchunked["seconds"]
    flowing = " ".join(section.split())
    assert f"{extra * 1e3:.0f} ms more all-to-all per step than it" in flowing
    assert dedup["time"]["all_to_all_hidden_s"] == 0 and hier["time"]["all_to_all_hidden_s"] > 0
    t = hier["time"]
    assert (
        f"in {t['a2a_chunks']} chunks pays {t['all_to_all_chunk_latency_s']:.2f} s more latency but hides "
        f"{t['all_to_all_hidden_s']:.2f} s behind the experts" in flowing
    )
    exposed = dedup["time"]["all_to_all_s"] - (t["all_to_all_s"] - t["all_to_all_hidden_s"])
    assert f"node_dedup's exchanges take {exposed:.2f} s more of the step" in flowing
    assert (
        f"the step takes {dedup['time']['step_s']:.1f} s instead of {hier['time']['step_s']:.1f} s" in flowing
    )

    sed, plan = top2_commands.replace("\\\n", " ").strip().splitlines()
    sed = sed.replace("configs/m6_1t.yaml", str(ROOT / "configs" / "m6_1t.yaml"))
    subprocess.run(["bash", "-c", sed], cwd=tmp_path, check=True)
    assert "num_prototypes: 1 " in (tmp_path / "m6_1t_top2.yaml").read_text()
    words = shlex.split(plan.replace("m6_1t_top2.yaml", str(tmp_path / "m6_1t_top2.yaml")))
    assert _run(words[1:]) == 0
    out = capsys.readouterr().out
    for line in top2_quoted.strip("\n").splitlines():
        assert line in out, line
    assert _run([*words[1:], "--json"]) == 0
    top2 = json.loads(capsys.readouterr().out)
    nl = top2["node_limit"]
    assert _run([*words[1:10], "--json"]) == 0  # the config's chunked hierarchical all-to-all, no limit
    top2_hier = json.loads(capsys.readouterr().out)
    steps = f"takes {top2['time']['step_s']:.1f} s instead of the chunked hierarchical all-to-all's"
    assert f"{steps} {top2_hier['time']['step_s']:.1f} s" in flowing
    gib = 2**30
    reached = nodes_reached_per_token(960, 2, 60)
    assert f"{reached:.3f} nodes" in section and f"{remote_nodes_per_token(960, 2, 60):.3f}" in section
    dedup_gib, per_slot_gib = nl["node_dedup_inter_node_bytes"] / gib, nl["per_slot_inter_node_bytes"] / gib
    assert f"{dedup_gib:.2f} GiB instead of {per_slot_gib:.2f} GiB" in section
    unlimited = nl["node_dedup_inter_node_bytes_unlimited"]
    saved = 1 - unlimited / nl["per_slot_inter_node_bytes"]
    assert f"saves {100 * saved:.1f}% ({unlimited / gib:.2f} GiB)" in section


def test_the_flag_overrides_the_config_and_zero_means_no_limit(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    base = ["plan", "--model", "configs/tiny_lm.yaml", "--cluster", "a100-80gb", "--nodes", "2"]
    base += ["--gpus-per-node", "2", "--ep-size", "4"]  # the EP group: 2 nodes x 2 GPUs, 2 experts each
    config = tmp_path / "limited.yaml"
    config.write_text(
        (ROOT / "configs" / "tiny_lm.yaml")
        .read_text()
        .replace("    top_k: 2\n", "    top_k: 2\n    max_nodes_per_token: 1\n")
    )
    assert _run(base) == 0 and "node-limited" not in capsys.readouterr().out
    assert _run([*base, "--max-nodes-per-token", "1"]) == 0
    assert "a token's 2 rows reach 1.00 nodes" in capsys.readouterr().out
    limited = [*base[:2], str(config), *base[3:]]
    assert _run(limited) == 0 and "a token's 2 rows reach 1.00 nodes" in capsys.readouterr().out
    assert (
        _run([*limited, "--max-nodes-per-token", "0"]) == 0 and "node-limited" not in capsys.readouterr().out
    )
