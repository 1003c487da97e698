"""Planner unit tests: presets, settings, exact parameter counts, formulas, search, CLI, M6-1T."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from moe_lm import LMConfig, MoETransformerLM, describe_lm
from moetrain.config import MoEConfig
from moetrain.layers.experts import GroupedExperts
from moetrain.planner import (
    GPU_PRESETS,
    ClusterSpec,
    PlanSettings,
    cluster_preset,
    gbps_to_bytes,
    make_plan,
    recommend,
)
from moetrain.planner.cli import add_plan_parser
from moetrain.planner.comm import all_to_all_exchange, choose_all_to_all, expert_groups, group_layout
from moetrain.planner.model import build_on_meta, count_parameters
from tests.helpers.paths import ROOT

GiB = 2**30


def one_t_like_lm() -> LMConfig:
    """An LMConfig with M6-1T's MoE shape (the planner's CPU-independent stand-in for the preset)."""
    moe = MoEConfig(
        d_model=1024, d_ff=21248, num_experts=960, top_k=2, num_prototypes=2, capacity_factor=1.25
    )
    return LMConfig(vocab_size=21128, d_model=1024, num_layers=24, num_heads=16, max_seq_len=1024, moe=moe)


def m6_cluster() -> ClusterSpec:
    return cluster_preset("v100-32gb", 60, inter_node_bandwidth=gbps_to_bytes(35))


M6_SETTINGS = PlanSettings(
    ep_size=480, micro_batch=8, seq_len=512, precision="fp16", offload=True, async_checkpoint=False
)


# ---------------------------------------------------------------------------------------------
# hardware and settings
# ---------------------------------------------------------------------------------------------


def test_gpu_presets_carry_datasheet_figures():
    v100, a100, h100 = (GPU_PRESETS[k] for k in ("v100-32gb", "a100-80gb", "h100-80gb"))
    assert v100.flops_for("fp16") == 125e12 and a100.flops_for("bf16") == 312e12
    assert h100.flops_for("bf16") == 989e12
    assert (v100.memory_bytes, a100.memory_bytes, h100.memory_bytes) == (32 * GiB, 80 * GiB, 80 * GiB)
    with pytest.raises(ValueError, match="precision 'bf16' has no fast path on V100.*'fp16'"):
        v100.flops_for("bf16")
    # NVLink datasheet totals count both directions: 300 / 600 / 900 GB/s -> per direction
    bandwidths = [cluster_preset(k, 1).intra_node_bandwidth for k in ("v100-32gb", "a100-80gb", "h100-80gb")]
    assert bandwidths == [150e9, 300e9, 450e9]


def test_cluster_overrides_and_errors_name_the_field():
    cluster = m6_cluster()
    assert cluster.world_size == 480 and cluster.inter_node_bandwidth == 35e9 / 8
    assert cluster_preset("V100-32GB", 2, gpus_per_node=4).world_size == 8
    with pytest.raises(ValueError, match="cluster must be one of 'v100-32gb'"):
        cluster_preset("k80", 1)
    with pytest.raises(ValueError, match="unknown cluster field 'nics'; allowed: .*gpu_reserved_bytes"):
        cluster_preset("v100-32gb", 1, nics=4)
    with pytest.raises(ValueError, match="nodes must be an integer >= 1, got 0"):
        cluster_preset("v100-32gb", 0)
    with pytest.raises(ValueError, match="inter_node_bandwidth must be a finite number > 0"):
        cluster_preset("v100-32gb", 1, inter_node_bandwidth=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ep_size": 0}, "ep_size must be an integer >= 1"),
        ({"precision": "fp8"}, "precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
        ({"recompute": "some"}, "recompute must be one of 'none', 'full', 'fraction', 'budget', 'auto'"),
        ({"recompute": "fraction"}, "recompute_fraction must be a number in \\[0, 1\\]"),
        ({"recompute_budget_bytes": 10}, "recompute_budget_bytes is only used with recompute = 'budget'"),
        ({"capacity_factor": -1.0}, "capacity_factor must be 'model', a finite number >= 0, or None"),
        ({"compute_efficiency": 1.5}, "compute_efficiency must be a number in \\(0, 1\\]"),
        ({"autocast": True, "precision": "fp32"}, "autocast must be False with precision 'fp32'"),
        ({"all_to_all": "ring"}, "all_to_all must be one of 'auto', 'flat', 'hierarchical'"),
        ({"seq_len": 512, "target_len": 600}, "target_len must be <= seq_len = 512"),
        ({"memory_headroom": 1.0}, "memory_headroom must be a number in \\[0, 1\\)"),
        ({"memory_headroom": -0.1}, "memory_headroom must be a number in \\[0, 1\\)"),
    ],
)
def test_settings_errors_name_field_and_allowed_values(changes, message):
    with pytest.raises(ValueError, match=message):
        PlanSettings(**changes)


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------


def test_parameter_counts_on_meta_are_exact():
    config = LMConfig(
        vocab_size=50, d_model=16, num_layers=3, moe=MoEConfig(d_model=16, d_ff=24, num_experts=6)
    )
    counted = describe_lm(config).params
    real = MoETransformerLM(config)
    experts = sum(p.numel() for m in real.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    assert counted.total == sum(p.numel() for p in real.parameters())
    assert counted.expert_total == experts and counted.dense == counted.total - experts
    assert counted.expert_per_rank(3) == experts // 3 and counted.per_rank(6) == counted.dense + experts // 6
    with pytest.raises(ValueError, match="ep_size = 4 must divide num_experts = 6"):
        counted.expert_per_rank(4)


def test_input_side_parameters_are_counted_for_the_step_peak():
    """The parameters whose gradients arrive after layer 0's backward (embeddings, positions, the
    image stem): what ``ModelArch.input_modules`` names, counted on meta."""
    from dataclasses import replace

    from m6_moe.config import M6Config
    from m6_moe.model import M6Model
    from m6_moe.planning import describe_m6

    config = LMConfig(
        vocab_size=50, d_model=16, num_layers=2, moe=MoEConfig(d_model=16, d_ff=24, num_experts=4)
    )
    real = dict(MoETransformerLM(config).named_parameters())
    assert describe_lm(config).input_params == real["embed.weight"].numel() + real["pos"].numel() > 0
    for tied in (True, False):
        m6 = replace(M6Config.preset("tiny"), tie_embeddings=tied)
        inputs = ("stem.", "patch_pos", "text_pos", "segment_embed.") + (() if tied else ("text_embed.",))
        expected = sum(p.numel() for n, p in M6Model(m6).named_parameters() if n.startswith(inputs))
        assert describe_m6(m6).input_params == expected > 0


def test_meta_build_of_a_trillion_parameters_takes_no_memory():
    model = build_on_meta(lambda: MoETransformerLM(one_t_like_lm()))
    assert all(p.device.type == "meta" for p in model.parameters())
    counted = count_parameters(model)
    assert 0.99e12 < counted.total < 1.01e12  # 24 layers x 960 experts x 2 x 1024 x 21248 + dense
    assert counted.per_rank(480) == counted.dense + 24 * 2 * 2 * 1024 * 21248


def test_m6_presets_resolve_and_count_exactly():
    from m6_moe.config import M6Config
    from m6_moe.model import M6Model
    from moetrain.planner.model import resolve_model

    tiny, _ = resolve_model("m6-tiny")
    real = M6Model(M6Config.preset("tiny"))
    assert tiny.params.total == sum(p.numel() for p in real.parameters())
    one_t, _ = resolve_model("M6-1T")
    assert one_t.arch.moe.num_experts == 960 and one_t.arch.num_moe_layers == 24
    assert 0.95e12 < one_t.params.total < 1.05e12
    with pytest.raises(
        ValueError, match=r"model must be a model preset \(m6-tiny, m6-base, m6-10B, m6-100B, m6-1T\)"
    ):
        resolve_model("m6-2T")


# ---------------------------------------------------------------------------------------------
# communication formulas
# ---------------------------------------------------------------------------------------------


def test_hierarchical_sends_the_same_bytes_across_nodes_in_fewer_messages():
    groups, _ = expert_groups(480, 480, "packed")
    layout = group_layout(groups[0], 8)
    assert (layout.nodes, layout.per_node) == (60, 8)
    flat = all_to_all_exchange(layout, "flat", 100.0)
    hier = all_to_all_exchange(layout, "hierarchical", 100.0)
    assert flat[1] == hier[1] == (480 - 8) * 100.0  # inter-node bytes
    assert flat[0] == 7 * 100.0 and hier[0] == 7 * 60 * 100.0  # stage 1 carries every node's rows
    assert (flat[2] + flat[3], hier[2] + hier[3]) == (479, 7 + 59)


def test_all_to_all_choice_mirrors_parallel_context():
    groups, _ = expert_groups(16, 8, "packed")
    assert choose_all_to_all("auto", 8, groups, 4) == "hierarchical"  # 2 nodes x 4
    assert choose_all_to_all("auto", 8, groups, 8) == "flat"  # one node
    groups, _ = expert_groups(16, 2, "spread")
    assert choose_all_to_all("auto", 2, groups, 4) == "flat"  # 2 nodes x 1
    groups, _ = expert_groups(24, 12, "packed")
    with pytest.raises(ValueError, match="hierarchical' needs every expert-parallel group"):
        choose_all_to_all("hierarchical", 12, groups, 8)


# ---------------------------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------------------------


def test_m6_1t_shaped_model_fits_480_v100_only_with_offload():
    model = describe_lm(one_t_like_lm(), "1T-like")
    plan = make_plan(model, m6_cluster(), M6_SETTINGS.replace(seq_len=708))
    assert plan.fits, plan.overflow
    assert plan.all_to_all == "hierarchical" and plan.expert_dp_size == 1
    assert plan.params["experts_per_rank_per_layer"] == 2
    no_offload = make_plan(model, m6_cluster(), M6_SETTINGS.replace(seq_len=708, offload=False))
    assert not no_offload.fits
    assert "GPU memory" in no_offload.overflow and "optimizer_states" in no_offload.overflow
    assert no_offload.gpu_memory["optimizer_states"] == 12 * plan.params["per_rank"]


def test_m6_1t_preset_on_480_v100_fits_and_recommend_finds_it():
    from moetrain.planner.model import resolve_model

    model, _ = resolve_model("m6-1T")
    plan = make_plan(model, m6_cluster(), M6_SETTINGS)
    assert plan.fits, plan.overflow
    result = recommend(model, m6_cluster(), PlanSettings(seq_len=512, precision="fp16"), micro_batches=[4, 8])
    assert result.best is not None and result.best.fits
    assert result.best.settings.ep_size in (240, 480) and result.best.settings.offload
    assert any("optimizer_states" in c.reason for c in result.rejected if c.status == "does not fit")


def test_recommend_builds_the_model_on_meta_once_for_all_its_candidates():
    """Every candidate layout reads the same meta-built model (counts, split units, strategy
    matches); building it per candidate made M6-1T's search 4.5x slower."""
    import dataclasses

    from moetrain.planner.model import resolve_model

    model, _ = resolve_model("m6-1T")
    builds = []

    def counted_build():
        builds.append(1)
        return model.build()

    counted = dataclasses.replace(model, build=counted_build)
    settings = PlanSettings(seq_len=512, precision="fp16")
    result = recommend(counted, m6_cluster(), settings, micro_batches=[4, 8])
    assert len(result.winners) + len(result.rejected) > 10
    assert len(builds) == 1


def test_recompute_modes_trade_memory_for_flops():
    config = one_t_like_lm()
    model = describe_lm(config)
    cluster = m6_cluster()
    base = M6_SETTINGS.replace(seq_len=708)
    none = make_plan(model, cluster, base.replace(recompute="none"))
    full = make_plan(model, cluster, base.replace(recompute="full"))
    half = make_plan(model, cluster, base.replace(recompute="fraction", recompute_fraction=0.5))
    assert full.recompute.activation_bytes < half.recompute.activation_bytes < none.recompute.activation_bytes
    assert full.time["recompute_s"] > half.time["recompute_s"] > none.time["recompute_s"] == 0
    assert half.recompute.layers_touched == 12
    budget = int(0.5 * none.recompute.activation_bytes)
    chosen = make_plan(model, cluster, base.replace(recompute="budget", recompute_budget_bytes=budget))
    assert chosen.recompute.activation_bytes <= budget
    assert chosen.time["recompute_s"] <= full.time["recompute_s"]
    impossible = make_plan(model, cluster, base.replace(recompute="budget", recompute_budget_bytes=1))
    assert not impossible.fits and "recompute_budget_bytes" in impossible.overflow


def test_plan_errors_name_the_numbers():
    model = describe_lm(one_t_like_lm())
    with pytest.raises(ValueError, match="ep_size = 7 must divide the world size = 480"):
        make_plan(model, m6_cluster(), M6_SETTINGS.replace(ep_size=7))
    with pytest.raises(ValueError, match="ep_size = 128 must divide num_experts = 960"):
        make_plan(model, cluster_preset("v100-32gb", 64), M6_SETTINGS.replace(ep_size=128))
    with pytest.raises(ValueError, match="precision 'bf16' has no fast path"):
        make_plan(model, m6_cluster(), M6_SETTINGS.replace(precision="bf16"))


def test_recommend_orders_winners_and_explains_rejections():
    model = describe_lm(one_t_like_lm())
    base = PlanSettings(seq_len=708, precision="fp16")
    result = recommend(model, m6_cluster(), base, ep_sizes=[120, 480, 7], micro_batches=[2, 8], top=2)
    speeds = [c.plan.tokens_per_s for c in result.winners]
    assert result.best is result.winners[0].plan and speeds == sorted(speeds, reverse=True)
    statuses = {c.status for c in result.candidates}
    assert {"best", "does not fit", "invalid"} <= statuses
    for c in result.rejected:
        assert c.reason
        if c.status == "does not fit":
            assert "GPU memory" in c.reason or "host memory" in c.reason
            assert " by " in c.reason  # how much it overflows
    assert any("ep_size = 7 must divide" in c.reason for c in result.rejected)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["best"]["fits"] and data["candidates"][0]["status"] == "best"
    assert "best configuration:" in result.format_table()


def test_recommend_with_fixed_global_batch_derives_grad_accum():
    model = describe_lm(one_t_like_lm())
    base = PlanSettings(seq_len=708, precision="fp16", offload=True)
    result = recommend(
        model, m6_cluster(), base, ep_sizes=[480], micro_batches=[4, 8, 5], global_batch=480 * 16
    )
    by_micro = {c.settings.micro_batch: c for c in result.candidates}
    assert by_micro[4].settings.grad_accum == 4 and by_micro[8].settings.grad_accum == 2
    assert by_micro[5].status == "invalid" and "not a multiple" in by_micro[5].reason
    fitting = [c.plan for c in result.candidates if c.plan is not None]
    assert len({p.time["tokens_per_step"] for p in fitting}) == 1


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _run(argv):
    parser = argparse.ArgumentParser(prog="moetrain")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def _doc_block(page, name):
    """The fenced block between ``page``'s ``<!-- name:begin`` / ``<!-- name:end`` lines, as
    blank-line-separated groups of lines."""
    text = page.read_text(encoding="utf-8").split(f"<!-- {name}:begin", 1)[1].split(f"<!-- {name}:end", 1)[0]
    body = text.split("```\n", 1)[1].rsplit("```", 1)[0]
    return [group.splitlines() for group in body.split("\n\n")]


def test_cli_plan_with_a_config_file(tmp_path, capsys):
    config = tmp_path / "lm.yaml"
    config.write_text(
        "model:\n  name: moe_lm\n  d_model: 64\n  num_layers: 2\n  moe:\n    d_ff: 128\n    num_experts: 8\n"
        "data:\n  micro_batch_size: 4\n  seq_len: 32\nprecision: bf16\n"
    )
    argv = ["plan", "--model", str(config), "--cluster", "a100-80gb", "--nodes", "2", "--gpus-per-node", "4"]
    assert _run([*argv, "--ep-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "moetrain plan: lm on 2 nodes x 4 A100-SXM4-80GB" in out and "all_to_all (hierarchical)" in out
    assert "micro-batch 4 x 32 tokens" in out and "(autocast, fp32 weights)" in out
    assert _run(["plan", "--model", str(config), "--cluster", "h100-80gb", "--nodes", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["settings"]["precision"] == "bf16" and data["world_size"] == 8
    config.write_text(config.read_text() + "param_dtype: bf16\noptim:\n  name: offload\n")
    assert _run([*argv, "--ep-size", "8"]) == 0  # weights stored in bf16: no autocast copies
    out = capsys.readouterr().out
    assert "(autocast, fp32 weights)" not in out and "offload on" in out


def test_cli_m6_1t_on_480_v100(capsys):
    argv = ["plan", "--model", "m6-1T", "--cluster", "v100-32gb", "--nodes", "60", "--inter-node-gbps", "35"]
    assert _run([*argv, "--ep-size", "480", "--offload", "--micro-batch", "8", "--sync-checkpoint"]) == 0
    out = capsys.readouterr().out
    assert "fp16" in out and "fits" in out and "35 Gb/s per node" in out
    assert _run([*argv, "--ep-size", "480", "--micro-batch", "8", "--sync-checkpoint"]) == 1  # no offload
    assert "does not fit: GPU memory" in capsys.readouterr().out


def test_cli_mixed_cluster_reports_the_balanced_speedup(capsys):
    argv = ["plan", "--model", "m6-base", "--cluster", "v100-32gb", "--nodes", "4", "--precision", "fp16"]
    assert _run([*argv, "--mixed", "p100-16gb:4", "--global-batch", "1024", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    text = json.dumps(result)
    assert "v100-32gb" in text and "p100-16gb" in text
    assert result["balanced_step_s"] < result["uniform_step_s"]  # the V100s take more sequences
    assert _run([*argv, "--mixed", "p100-16gb:4"]) == 0
    assert "speed-up" in capsys.readouterr().out
    quoted = _doc_block(ROOT / "docs" / "planner.md", "mixed-figures")  # the commands docs/planner.md quotes
    assert [lines[0].split()[:4] for lines in quoted] == [["$", "moetrain", "plan", "--model"]] * 2, quoted
    for command, *output in quoted:
        assert _run(shlex.split(command)[2:]) == 0
        assert capsys.readouterr().out.splitlines() == output, command
    for bad, message in (("p100:4", "--mixed takes GPU:NODES"), ("p100-16gb:0", "NODES an integer >= 1")):
        with pytest.raises(ValueError, match=message):
            _run([*argv, "--mixed", bad])
    with pytest.raises(ValueError, match="cannot be combined"):
        _run([*argv, "--mixed", "p100-16gb:4", "--recommend"])


def test_cli_errors_are_value_errors():
    with pytest.raises(ValueError, match="model must be a model preset"):
        _run(["plan", "--model", "no/such/file.yaml", "--cluster", "v100-32gb", "--nodes", "1"])


# ---------------------------------------------------------------------------------------------
# sequence length default, cluster flags, memory headroom
# ---------------------------------------------------------------------------------------------


def small_lm_yaml(tmp_path, max_seq_len: int = 48):
    """A bare moe_lm model config file (no data section: nothing sets the sequence length)."""
    path = tmp_path / "small.yaml"
    path.write_text(
        "name: moe_lm\nd_model: 32\nnum_layers: 2\nnum_heads: 4\nvocab_size: 64\n"
        f"max_seq_len: {max_seq_len}\nmoe:\n  d_ff: 64\n  num_experts: 8\n"
    )
    return str(path)


def test_seq_len_defaults_to_the_model_maximum(tmp_path, capsys):
    from moetrain.planner.model import resolve_model

    model, defaults = resolve_model(small_lm_yaml(tmp_path, 48))
    assert "seq_len" not in defaults and PlanSettings().seq_len is None
    cluster = cluster_preset("a100-80gb", 1)
    plan = make_plan(model, cluster, PlanSettings())
    assert plan.settings.seq_len == 48 and plan.time["tokens_per_step"] == 8 * 48
    assert make_plan(model, cluster, PlanSettings(seq_len=16)).settings.seq_len == 16
    with pytest.raises(ValueError, match="seq_len = 64 exceeds the model's maximum of 48"):
        make_plan(model, cluster, PlanSettings(seq_len=64))
    argv = ["plan", "--model", small_lm_yaml(tmp_path), "--cluster", "a100-80gb", "--nodes", "1", "--json"]
    assert _run(argv) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["seq_len"] == 48
    assert _run([*argv, "--seq-len", "24"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["seq_len"] == 24


def test_cli_m6_tiny_plans_at_its_own_maximum_text_length(capsys):
    from m6_moe.config import M6Config

    maximum = M6Config.preset("tiny").max_text_len
    assert maximum < 512  # the old fixed default, which m6-tiny refused
    argv = ["plan", "--model", "m6-tiny", "--cluster", "a100-80gb", "--nodes", "1"]
    assert _run(argv) == 0
    assert f"micro-batch 1 x {maximum} tokens + 16 image patches" in capsys.readouterr().out
    assert _run([*argv, "--recommend", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {c["settings"]["seq_len"] for c in result["candidates"]} == {maximum}
    assert result["best"]["settings"]["seq_len"] == maximum
    with pytest.raises(ValueError, match=f"seq_len = 512 exceeds the model's maximum of {maximum}"):
        _run([*argv, "--seq-len", "512"])


def test_cli_overrides_every_cluster_figure(tmp_path, capsys):
    base = ["plan", "--model", small_lm_yaml(tmp_path), "--cluster", "v100-32gb", "--nodes", "2", "--json"]
    assert _run(base) == 0
    default = json.loads(capsys.readouterr().out)
    flags = [
        "--gpus-per-node", "4", "--gpu-memory-gib", "16", "--peak-tflops", "100", "--intra-node-gbs", "50",
        "--inter-node-gbps", "25", "--intra-node-latency-us", "5", "--inter-latency-us", "30",
        "--host-memory-gib", "256",
    ]  # fmt: skip
    assert _run([*base, *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    cluster, gpu = data["cluster"], data["cluster"]["gpu"]
    assert cluster["gpus_per_node"] == 4 and data["world_size"] == 8
    assert gpu["memory_bytes"] == data["gpu_capacity"] == 16 * GiB
    assert data["gpu_usable"] == int(16 * GiB * 0.9)
    assert gpu["peak_flops"] == {"fp16": 100e12, "fp32": 15.7e12}  # the training precision's (fp16)
    assert cluster["intra_node_bandwidth"] == 50e9 and cluster["inter_node_bandwidth"] == 25e9 / 8
    assert cluster["intra_node_latency"] == pytest.approx(5e-6)
    assert cluster["inter_node_latency"] == pytest.approx(30e-6)
    assert cluster["host_memory_bytes"] == data["host_capacity"] == 256 * GiB
    # the figures are used: compute time follows the peak, the all-reduce the latencies
    assert data["time"]["compute_s"] == pytest.approx(default["time"]["compute_s"] * 125 / 100)
    assert _run([*base, "--inter-node-latency-us", "0", "--intra-node-latency-us", "0"]) == 0
    no_latency = json.loads(capsys.readouterr().out)
    assert no_latency["time"]["grad_sync_s"] < default["time"]["grad_sync_s"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--gpu-memory-gib", "0", "--gpu-memory-gib must be a finite number > 0 \\(GiB\\), got 0.0"),
        ("--peak-tflops", "-5", "--peak-tflops must be a finite number > 0 \\(TFLOP/s\\), got -5.0"),
        ("--peak-tflops", "inf", "--peak-tflops must be a finite number > 0"),
        ("--intra-node-gbs", "0", "--intra-node-gbs must be a finite number > 0 \\(GB/s\\)"),
        ("--inter-node-gbps", "nan", "--inter-node-gbps must be a finite number > 0 \\(Gb/s\\)"),
        ("--intra-latency-us", "-1", "--intra-node-latency-us must be a finite number >= 0 \\(us\\)"),
        ("--inter-node-latency-us", "-0.5", "--inter-node-latency-us must be a finite number >= 0 \\(us\\)"),
        ("--host-memory-gib", "-1", "--host-memory-gib must be a finite number > 0 \\(GiB\\)"),
        ("--gpus-per-node", "0", "--gpus-per-node must be an integer >= 1, got 0"),
        ("--memory-headroom", "1", "--memory-headroom must be a number in \\[0, 1\\) .*got 1.0"),
        ("--memory-headroom", "-0.1", "--memory-headroom must be a number in \\[0, 1\\)"),
    ],
)
def test_cli_cluster_flags_out_of_range_name_the_flag_and_range(tmp_path, flag, value, message):
    argv = ["plan", "--model", small_lm_yaml(tmp_path), "--cluster", "v100-32gb", "--nodes", "1"]
    with pytest.raises(ValueError, match=message):
        _run([*argv, flag, value])


def test_fit_check_and_auto_recompute_keep_the_memory_headroom():
    model = describe_lm(one_t_like_lm())
    cluster = m6_cluster()
    settings = M6_SETTINGS.replace(seq_len=708, autocast=True, micro_batch=12)
    unguarded = make_plan(model, cluster, settings.replace(memory_headroom=0.0))
    assert unguarded.fits and unguarded.gpu_total > 0.9 * 32 * GiB  # fits only with < 10% free
    plan = make_plan(model, cluster, settings)  # default headroom 10%
    assert (plan.gpu_capacity, plan.gpu_usable) == (32 * GiB, int(0.9 * 32 * GiB))
    assert not plan.fits and plan.gpu_total > plan.gpu_usable
    assert "GPU memory" in plan.overflow and "usable (32.00 GiB less 10% headroom) by" in plan.overflow
    assert "DOES NOT FIT" in plan.format_table() and plan.to_dict()["gpu_usable"] == plan.gpu_usable
    for micro in (2, 4):  # auto recompute budgets against the usable memory, not the capacity
        fitted = make_plan(model, cluster, settings.replace(micro_batch=micro))
        loose = make_plan(model, cluster, settings.replace(micro_batch=micro, memory_headroom=0.0))
        assert fitted.fits and fitted.gpu_total <= fitted.gpu_usable
        assert fitted.recompute.activation_bytes < loose.recompute.activation_bytes
        assert fitted.time["recompute_s"] > loose.time["recompute_s"]
        assert "total / usable" in fitted.format_table() and "less 10% headroom" in fitted.format_table()
    result = recommend(
        model,
        cluster,
        settings,
        ep_sizes=[480],
        offload=(True,),
        micro_batches=[8, 12],
    )
    assert result.best.settings.micro_batch == 8 and result.best.settings.grad_accum == 1
    assert {c.settings.micro_batch: c.status for c in result.candidates}[12] == "does not fit"


def test_m6_1t_config_is_the_recommendation_with_headroom(capsys):
    from moetrain.cli import build_train_config

    path = str(ROOT / "configs" / "m6_1t.yaml")
    config = build_train_config(path, [])
    argv = ["plan", "--model", path, "--cluster", "v100-32gb", "--nodes", "60", "--inter-node-gbps", "35"]
    assert _run([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # an M6 data.seq_len bounds prefix and target each: 2 x 256 text tokens
    assert data["settings"]["seq_len"] == 2 * config.data.seq_len == 512
    assert data["settings"]["autocast"] and data["settings"]["offload"]
    assert data["fits"] and data["gpu_total"] <= data["gpu_usable"] == int(0.9 * 32 * GiB)
    activations = data["recompute"]["activation_bytes"]  # the config's budget is the planner's choice
    assert activations <= config.recompute_budget_mb * 2**20 < activations + 2**20
    assert not data["settings"]["async_checkpoint"] and data["host_memory"]["checkpoint_staging"] == 0
    # a background write's host copy would not fit beside the offloaded optimizer
    from moetrain.planner.model import resolve_model

    model, defaults = resolve_model(path)
    staged = make_plan(model, m6_cluster(), PlanSettings(**{**defaults, "async_checkpoint": True}))
    per_node = 8 * staged.checkpoint["rank_bytes"]
    assert staged.host_memory["checkpoint_staging"] == per_node > 256 * GiB
    assert staged.checkpoint["rank_bytes"] == staged.params["per_rank"] * (4 + 12)  # fp32 weights + Adam
    assert not staged.fits and "host memory per node" in staged.overflow
    # the config builds its experts locally: built whole, every rank's host would first hold all of them
    assert defaults["experts_init"] == "local" and not any("experts_init" in note for note in data["notes"])
    whole = make_plan(model, m6_cluster(), PlanSettings(**{**defaults, "experts_init": "whole"}))
    [note] = [note for note in whole.notes if "experts_init" in note]
    assert "(3,736 GiB in fp32)" in note and "(64 GiB)" in note and "set experts_init: local" in note
    small, small_defaults = resolve_model(str(ROOT / "configs" / "tiny_lm.yaml"))
    tiny_plan = make_plan(small, m6_cluster(), PlanSettings(**small_defaults))
    assert small_defaults["experts_init"] == "whole" and not any("experts_init" in n for n in tiny_plan.notes)
    # micro-batch 12 in one micro-step fits 32 GiB only within the 10% headroom
    assert _run([*argv, "--micro-batch", "12", "--grad-accum", "1"]) == 1
    assert "does not fit: GPU memory" in capsys.readouterr().out
    assert _run([*argv, "--micro-batch", "12", "--grad-accum", "1", "--memory-headroom", "0"]) == 0
    capsys.readouterr()
    best = recommend(
        *_m6_1t_and_cluster(),
        PlanSettings(precision="fp16", autocast=True, offload=True, async_checkpoint=False),
        ep_sizes=[480],
        offload=(True,),
        micro_batches=[4, 8, 16],
        global_batch=480 * config.data.micro_batch_size * config.grad_accum,
    ).best
    assert (
        (best.settings.micro_batch, best.settings.grad_accum)
        == (4, 4)
        == (
            config.data.micro_batch_size,
            config.grad_accum,
        )
    )


def _m6_1t_and_cluster():
    from moetrain.planner.model import resolve_model

    return resolve_model("m6-1T")[0], m6_cluster()


def test_the_commands_at_the_top_of_docs_planner_md_run(capsys, monkeypatch):
    import shlex

    root = ROOT
    monkeypatch.chdir(root)  # the commands name files relative to the repository root
    doc = (root / "docs" / "planner.md").read_text(encoding="utf-8")
    block = doc.split("```\n", 2)[1].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert len(commands) == 3 and all(words[:2] == ["moetrain", "plan"] for words in commands)
    for words in commands:
        assert _run(words[1:]) == 0, capsys.readouterr().out[-2000:]
        assert capsys.readouterr().out


def test_the_configs_auto_gpu_choices_are_the_planners_gpu_presets():
    """``parallel.auto_gpu`` (the config, which must not import the planner) lists the planner's
    GPU presets by name: the two lists are one."""
    from moetrain.config import AUTO_GPUS
    from moetrain.planner.hardware import GPU_PRESETS

    assert set(AUTO_GPUS) == set(GPU_PRESETS)
