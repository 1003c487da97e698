"""The planner's model of the delayed offloaded-optimizer update (``optim_overlap="delayed"``):
step = device work + max(0, host step - device work) + the weight copy back; host staging = every
gradient and weight copy once; ``--recommend`` tries it; M6-1T's step 17.4 s -> 12.2 s."""

from __future__ import annotations

import argparse

import pytest

from moetrain.planner import cluster_preset
from moetrain.planner.cli import add_plan_parser
from moetrain.planner.hardware import gbps_to_bytes
from moetrain.planner.model import resolve_model
from moetrain.planner.plan import CPU_ADAM_STATE_TRAFFIC, make_plan
from moetrain.planner.search import recommend
from moetrain.planner.settings import PlanSettings

M6_CLUSTER = cluster_preset("v100-32gb", 60, inter_node_bandwidth=gbps_to_bytes(35))


@pytest.fixture(scope="module")
def m6():
    model, defaults = resolve_model("configs/m6_1t.yaml")
    assert defaults["optim_overlap"] == "delayed"  # the config's optim.overlap
    settings = PlanSettings(**defaults)
    return (
        model,
        make_plan(model, M6_CLUSTER, settings),
        make_plan(model, M6_CLUSTER, settings.replace(optim_overlap="none")),
    )


def test_m6_1t_step_with_the_delayed_update(m6):
    _, delayed, exact = m6
    assert exact.time["step_s"] == pytest.approx(17.38, abs=0.01)
    assert exact.time["optimizer_exposed_s"] == exact.time["optimizer_s"]
    assert delayed.time["step_s"] == pytest.approx(12.21, abs=0.01)
    t = delayed.time
    device = t["step_s"] - t["optimizer_exposed_s"]
    assert device == pytest.approx(exact.time["step_s"] - exact.time["optimizer_s"])
    # the host step (5.8 s) hides behind the device work (11.6 s): only the weight copy back stays
    per_rank, weight_b = delayed.params["per_rank"], 4  # fp32 weights (autocast)
    pcie = per_rank * weight_b / M6_CLUSTER.gpu.pcie_bandwidth
    cpu = 8 * per_rank * (CPU_ADAM_STATE_TRAFFIC + 2 * weight_b) / M6_CLUSTER.host_memory_bandwidth
    groups = delayed.settings.offload_apply_groups
    assert t["optimizer_s"] == pytest.approx(pcie / groups + max(pcie * (groups - 1) / groups, cpu))
    assert t["optimizer_s"] < device
    assert t["optimizer_exposed_s"] == pytest.approx(pcie)
    assert t["tokens_per_s"] / exact.time["tokens_per_s"] == pytest.approx(17.38 / 12.21, rel=1e-3)
    # host memory: every gradient and weight copy once per GPU, pinned, instead of two apply groups
    assert delayed.host_memory["pinned_staging"] == 8 * per_rank * 2 * weight_b
    assert exact.host_memory["pinned_staging"] < delayed.host_memory["pinned_staging"]
    assert delayed.fits and "delayed update" in delayed.format_table()


def test_recompute_auto_is_feasible_whenever_its_peak_fits_and_recomputes_no_more_than_needed(m6):
    """M6-1T at micro-batch 1 x 16: the first, pessimistic budget of "auto" is 0 (full recompute,
    the knapsack's "infeasible"); its peak fits, so the plan fits, and a choice keeping more fits
    too. The knapsack does not count the weight copies of the layers it keeps, so its first such
    choice went over the room and the plan was reported infeasible with no reason."""
    model, plan, _ = m6
    small = make_plan(model, M6_CLUSTER, plan.settings.replace(micro_batch=1, grad_accum=16))
    assert small.recompute.mode == "auto" and small.recompute.feasible
    assert small.fits and small.overflow is None and small.gpu_total <= small.gpu_usable
    assert 0 < small.recompute.layers_recomputed < model.arch.num_layers


def test_a_host_step_longer_than_the_device_work_is_partly_exposed():
    model, defaults = resolve_model("configs/tiny_lm.yaml")
    cluster = cluster_preset("a100-80gb", 1, host_memory_bandwidth=1e9)  # a slow host
    settings = PlanSettings(**{**defaults, "offload": True, "optim_overlap": "delayed"})
    t = make_plan(model, cluster, settings).time
    exact = make_plan(model, cluster, settings.replace(optim_overlap="none")).time
    device = exact["step_s"] - exact["optimizer_s"]
    assert t["optimizer_s"] > device
    pcie = t["optimizer_exposed_s"] - (t["optimizer_s"] - device)
    assert pcie > 0
    assert t["step_s"] == pytest.approx(t["optimizer_s"] + pcie)
    assert t["step_s"] < exact["step_s"]


def test_settings_refuse_delayed_without_offload():
    with pytest.raises(ValueError, match="optim_overlap 'delayed' needs offload"):
        PlanSettings(optim_overlap="delayed")
    with pytest.raises(ValueError, match="optim_overlap must be one of 'none', 'delayed', got 'async'"):
        PlanSettings(offload=True, optim_overlap="async")


def test_settings_refuse_an_unknown_experts_init():
    with pytest.raises(ValueError, match="experts_init must be one of 'whole', 'local', got 'lazy'"):
        PlanSettings(experts_init="lazy")


def test_recommend_tries_the_delayed_update_for_offloaded_candidates():
    model, defaults = resolve_model("configs/tiny_lm.yaml")
    cluster = cluster_preset("a100-80gb", 1)
    base = PlanSettings(**{**defaults, "optim_overlap": "none"})
    result = recommend(
        model, cluster, base, ep_sizes=[1], micro_batches=[1], optim_overlaps=("none", "delayed")
    )
    layouts = sorted((c.settings.offload, c.settings.optim_overlap) for c in result.candidates)
    assert layouts == [(False, "none"), (True, "delayed"), (True, "none")]
    times = {(c.settings.offload, c.settings.optim_overlap): c.plan.time["step_s"] for c in result.candidates}
    assert times[(True, "delayed")] < times[(True, "none")]
    assert "delayed" in result.format_table()


def test_plan_command_option(capsys):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    common = ["plan", "--model", "configs/tiny_lm.yaml", "--cluster", "a100-80gb", "--nodes", "1"]
    args = parser.parse_args([*common, "--offload", "--optim-overlap", "delayed"])
    assert args.run(args) == 0
    assert "offload on (delayed update)" in capsys.readouterr().out
    args = parser.parse_args([*common, "--optim-overlap", "delayed"])
    with pytest.raises(ValueError, match="optim_overlap 'delayed' needs offload"):
        args.run(args)


@pytest.mark.parametrize(
    "config, flags, expected",
    [
        ("configs/m6_1t.yaml", ["--precision", "fp32"], ("fp32", False)),  # was refused: autocast kept
        ("configs/m6_1t.yaml", ["--precision", "bf16"], ("bf16", True)),
        ("configs/tiny_lm.yaml", ["--precision", "bf16"], ("bf16", True)),  # was bf16 weights, no offload
        ("configs/tiny_lm.yaml", ["--precision", "bf16", "--offload"], ("bf16", True)),
        ("m6-base", [], ("bf16", True)),  # a preset's low precision without offload: autocast
        ("m6-base", ["--offload"], ("bf16", False)),  # weights stored low beside the offloaded masters
    ],
)
def test_the_planned_layout_is_one_the_engine_runs(config, flags, expected):
    """``--precision`` over a config plans what ``--set precision=...`` trains (fp32 weights with
    autocast compute unless the run stores its weights low, param_dtype with offload); low-precision
    weights without the offloaded optimizer are planned with autocast, as the engine runs them."""
    from moetrain.planner.cli import cluster_and_settings

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--model", config, "--cluster", "a100-80gb", "--nodes", "1", *flags])
    _, settings = cluster_and_settings(args, resolve_model(config)[1])
    assert (settings.precision, settings.autocast) == expected


def test_recommend_plans_autocast_for_every_candidate_without_offload():
    model, _ = resolve_model("m6-base")
    base = PlanSettings(seq_len=128, precision="bf16")  # autocast False: weights stored in bf16
    result = recommend(model, cluster_preset("a100-80gb", 1), base, ep_sizes=[8], micro_batches=[4])
    layouts = sorted((c.settings.offload, c.settings.autocast) for c in result.candidates)
    assert layouts == [(False, True), (True, False)]
