"""The planner's pipeline terms (:mod:`moetrain.planner.pipeline`) against hand computation: the
activations in flight per schedule, the bubble, each pipeline rank's parameters and memory, and
``moetrain plan --pp-size``."""

from __future__ import annotations

import pytest

from moetrain.planner import PlanSettings, cluster_preset, make_plan
from moetrain.planner.pipeline import in_flight
from tests.helpers.paths import ROOT


def test_in_flight_per_schedule_by_hand():
    assert [in_flight("gpipe", 4, 8, 1, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2, 1, 0) == 2  # fewer micro-batches than stages
    # interleaved, p 4, v 2, m 8: 2 rounds of q = 4; warm-up (v-1) q + 2 (p-1-r) = 4 + 6 - 2r, + 1
    assert [in_flight("interleaved_1f1b", 4, 8, 2, r) for r in range(4)] == [11, 9, 7, 5]
    assert in_flight("interleaved_1f1b", 2, 2, 4, 0) == 8  # capped at v m


@pytest.fixture(scope="module")
def tiny_m6():
    from moetrain.planner import resolve_model

    root = ROOT
    return resolve_model(str(root / "models" / "m6_moe" / "tiny.yaml"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_plan_pp2_memory_and_time_by_hand(tiny_m6, schedule):
    model, defaults = tiny_m6
    cluster = cluster_preset("a100-80gb", 1)
    base = PlanSettings(**{**defaults, "grad_accum": 8})
    plan = make_plan(model, cluster, base.replace(pp_size=2, pp_schedule=schedule))
    pipe, acts = plan.pipeline, plan.activations
    assert pipe.ranges == ((0, 2), (2, 4))  # four equal layers: two per stage
    assert pipe.bubble == pytest.approx(1 / 9)
    weight_b = 4  # fp32 (the tiny preset's precision)
    inputs, counts = model.input_params, model.layer_params
    rest = model.params.dense - sum(c.dense for c in counts) - inputs
    assert sum(r.dense for r in pipe.ranks) == model.params.dense
    for r, (start, stop) in zip(pipe.ranks, pipe.ranges, strict=True):
        dense = sum(counts[i].dense for i in range(start, stop)) + (inputs if r.rank == 0 else rest)
        experts = sum(counts[i].expert_per_rank(1) for i in range(start, stop))
        assert (r.dense, r.experts) == (dense, experts)
        assert r.weights == r.gradients == (dense + experts) * weight_b
        assert r.optimizer_states == (dense + experts) * 8  # fp32 weights are their own master
        saved = sum(acts.layers[i].saved_bytes for i in range(start, stop))
        outside = {k: v for k, v in acts.outside.items() if (k in ("head_input", "loss")) == (r.rank == 1)}
        flying = 8 if schedule == "gpipe" else 2 - r.rank
        assert r.in_flight == flying and r.activations == flying * (saved + sum(outside.values()))
    largest = pipe.ranks[pipe.largest]
    assert plan.gpu_memory["weights"] == largest.weights
    assert plan.step_memory.total == largest.activations + largest.gradients + largest.working
    flops = cluster.gpu.flops_for(plan.settings.precision) * plan.settings.compute_efficiency
    slowest = max(r.forward_flops for r in pipe.ranks)
    assert plan.time["compute_s"] == pytest.approx((8 + 1) * 3 * slowest / flops)
    assert plan.time["pipeline_bubble_s"] == pytest.approx(3 * slowest / flops)
    assert plan.time["pipeline_p2p_s"] > 0
    single = make_plan(model, cluster, base)
    assert plan.time["tokens_per_step"] * 2 == single.time["tokens_per_step"]  # one stream per pipeline
    assert plan.gpu_memory["weights"] < single.gpu_memory["weights"]


def test_plan_pipeline_settings_are_validated():
    with pytest.raises(ValueError, match="pp_virtual must be > 1"):
        PlanSettings(pp_size=2, pp_schedule="interleaved_1f1b", grad_accum=4)
    with pytest.raises(ValueError, match=r"grad_accum = 1 .* must be >= pp_size = 2"):
        PlanSettings(pp_size=2)
    with pytest.raises(ValueError, match="recompute must be 'none' or 'auto' with pp_size > 1"):
        PlanSettings(pp_size=2, grad_accum=2, recompute="full")
    with pytest.raises(ValueError, match="pp_schedule must be one of"):
        PlanSettings(pp_schedule="zb")


def test_the_plans_split_is_a_setting_moetrain_train_takes(capsys, tmp_path):
    """The plan prints its FLOP-balanced stage split as a --set line; that line gives the run those
    stages (here a 4-layer LM on 2 stages of 2 ranks each: layers 0-1 and 2-3)."""
    import shlex

    from moetrain.cli import build_train_config, main

    root = ROOT
    config = tmp_path / "lm.yaml"
    config.write_text(
        (root / "configs" / "tiny_lm.yaml").read_text().replace("num_layers: 2", "num_layers: 4")
    )
    argv = ["plan", "--model", str(config), "--cluster", "a100-80gb", "--nodes", "1", "--gpus-per-node", "4"]
    assert main([*argv, "--pp-size", "2", "--ep-size", "2", "--grad-accum", "4"]) == 0
    line = next(text for text in capsys.readouterr().out.splitlines() if "parallel.pp_layers" in text)
    overrides = shlex.split(line.split(": ", 1)[1])[1::2]
    expected = ["grad_accum=4", "parallel.pp_size=2", "parallel.pp_schedule=1f1b", "parallel.pp_layers=[2]"]
    assert overrides == expected
    train = build_train_config(str(config), overrides)
    parallel = train.parallel
    assert (train.grad_accum, parallel.pp_size, parallel.pp_schedule, list(parallel.pp_layers)) == (
        4,
        2,
        "1f1b",
        [2],
    )
