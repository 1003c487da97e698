"""``--calibrate`` and ``--recommend``: which phase times which collective, per-record compute,
implausible records, and ``--global-batch`` under tensor parallelism.

- :func:`~moetrain.planner.calibrate.engine_collectives` puts each planned collective in the
  phase the engine times it in: DDP's dense all-reduce inside the backward, the expert-DP
  all-reduce (and a split parameter's) in the gradient sync, FSDP's reductions in the backward,
  a pipeline's after it.
- The measured compute is each record's ``forward + backward - all_to_all``, then the median: never
  more than the step (the medians of the phases, taken apart, can add up to more).
- A record whose numbers contradict each other or are out of any plausible range is a one-line
  error naming metrics.jsonl:<line> and the key.
- ``recommend(global_batch=...)`` divides the batch over the data streams, ``world / (tp * pp)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moetrain.planner import cluster_preset, recommend
from moetrain.planner.calibrate import calibrate, read_run, run_model
from moetrain.planner.model import resolve_model
from moetrain.planner.plan import make_plan
from moetrain.planner.plan_layout import layout_stage
from moetrain.planner.settings import PlanSettings
from tests.helpers.paths import ROOT
from tests.unit.planner.test_planner_calibrate import write_run


def tiny(tmp_path: Path, **parallel) -> tuple:
    """configs/tiny_lm.yaml with ``parallel`` fields set: (model, default settings)."""
    data = yaml.safe_load((ROOT / "configs" / "tiny_lm.yaml").read_text())
    data["parallel"].update(parallel)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return resolve_model(str(path))


def names(phases: dict) -> dict:
    return {phase: sorted(t.name for t in traffic) for phase, traffic in phases.items()}


def test_each_collective_is_in_the_phase_the_engine_times_it_in(tmp_path):
    from moetrain.planner.calibrate import engine_collectives

    model, defaults = tiny(tmp_path, ep_size=2)
    cluster = cluster_preset("a100-80gb", 1, gpus_per_node=4)  # 4 ranks, ep 2: expert-DP groups of 2
    plan = make_plan(model, cluster, PlanSettings(**defaults), "cpu")
    a2a = ["all_to_all", "all_to_all_counts"]
    assert names(engine_collectives(plan, cluster, "ddp")) == {
        "all_to_all": a2a,
        "grad_sync": ["expert_dp_all_reduce"],  # reduce_gradients: the expert reducer
        "inside": ["dp_all_reduce"],  # DDP: in the last micro-step's backward
    }
    assert names(engine_collectives(plan, cluster, "fsdp")) == {
        "all_to_all": a2a,
        "grad_sync": [],
        "inside": ["dp_all_reduce", "expert_dp_all_reduce"],  # FSDP2 reduces in the backward
    }
    staged = make_plan(model, cluster, PlanSettings(**{**defaults, "pp_size": 2, "grad_accum": 2}), "cpu")
    assert names(engine_collectives(staged, cluster, "ddp"))["grad_sync"] == [
        "dp_all_reduce",
        "expert_dp_all_reduce",
    ]  # a pipeline has no DDP: its reducers run after the schedule


def test_under_tensor_parallelism_the_split_parameters_reduce_in_the_gradient_sync(tmp_path):
    from moetrain.planner.calibrate import engine_collectives

    model, defaults = tiny(tmp_path, tp_size=2)
    assert defaults["tp_size"] == 2 and defaults["strategy"]
    cluster = cluster_preset("a100-80gb", 1, gpus_per_node=4)
    settings = PlanSettings(**defaults)
    plan = make_plan(model, cluster, settings, "cpu")
    layout = layout_stage(model, cluster, settings, "cpu")
    phases = engine_collectives(plan, cluster, "ddp", layout)
    assert names(phases) == {
        "all_to_all": [],
        "grad_sync": ["expert_dp_all_reduce", "split_dp_all_reduce"],  # the reducers after the backward
        "inside": ["dp_all_reduce", "tp_all_reduce"],  # DDP's replicated parameters; the activations'
    }
    ddp = next(t for t in phases["inside"] if t.name == "dp_all_reduce")
    split = next(t for t in phases["grad_sync"] if t.name == "split_dp_all_reduce")
    whole = next(t for t in plan.traffic if t.name == "dp_all_reduce")
    assert 0 < split.intra_bytes < whole.intra_bytes
    assert ddp.intra_bytes + split.intra_bytes == pytest.approx(whole.intra_bytes)


def test_the_measured_compute_is_each_records_own_then_the_median(tmp_path):
    """Medians taken apart: forward 0.09, backward 0.09, i.e. 0.18 s of compute in a 0.1 s step."""
    rows = [(1, 1, 2), (0.09, 0.01, 0.1), (0.01, 0.09, 0.1), (0.09, 0.09, 0.19)]
    records = [
        {"step": i + 1, "time/forward_s": f, "time/backward_s": b, "time/step_s": s}
        for i, (f, b, s) in enumerate(rows)
    ]
    run_dir = tmp_path / "run"
    write_run(run_dir, 1, records)
    run = read_run(run_dir)
    model, defaults = run_model(run)
    result = calibrate(model, cluster_preset("a100-80gb", 1, gpus_per_node=1), PlanSettings(**defaults), run)
    assert result.measured["compute_s"] <= result.measured["step_s"]
    assert result.measured["compute_s"] == pytest.approx(0.1) == run.compute


BASE = {"step": 1, "time/step_s": 0.1}


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"time/forward_s": 0.01, "time/backward_s": 0.01, "time/all_to_all_s": 0.05},
            r"metrics.jsonl:2: time/all_to_all_s must be <= time/forward_s \+ time/backward_s = 0.02 "
            r"\(the exchanges are timed inside them\), got 0.05",
        ),
        (
            {"memory/peak_allocated_bytes": 1000, "memory/peak_reserved_bytes": 500},
            r"metrics.jsonl:2: memory/peak_reserved_bytes must be >= memory/peak_allocated_bytes = 1000",
        ),
        (
            {"memory/peak_allocated_bytes": 1e300},
            r"metrics.jsonl:2: memory/peak_allocated_bytes must be a number in \[0, 1152921504606846976\], "
            r"got 1e\+300",
        ),
        (
            {"time/forward_s": 1e308, "time/backward_s": 1e308},
            r"metrics.jsonl:2: time/forward_s must be a number in \[0, 1000000.0\], got 1e\+308",
        ),
        ({"tokens_per_s": 1e13}, r"metrics.jsonl:2: tokens_per_s must be a number in \(0, 1000000000000.0\]"),
    ],
)
def test_an_implausible_record_is_a_one_line_error(record, message, tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, 1, [BASE, {**BASE, "step": 2, **record}])
    with pytest.raises(ValueError, match=message) as caught:
        read_run(run_dir)
    assert "\n" not in str(caught.value)


def test_global_batch_is_divided_over_the_data_streams(tmp_path):
    """tp_size 2 on 8 GPUs: 4 data streams, each candidate trains the 64 sequences asked for."""
    model, defaults = tiny(tmp_path, tp_size=2)
    cluster = cluster_preset("a100-80gb", 1)
    assert cluster.world_size == 8
    result = recommend(
        model, cluster, PlanSettings(**defaults), ep_sizes=[1], offload=(False,), micro_batches=[1, 2, 4, 32],
        global_batch=64,
    )  # fmt: skip
    planned = [c for c in result.candidates if c.plan is not None]
    assert {c.settings.micro_batch for c in planned} == {1, 2, 4}
    for c in planned:
        t = c.plan.time
        assert c.settings.grad_accum * c.settings.micro_batch * 4 == 64
        assert t["samples_per_s"] * t["step_s"] == pytest.approx(64)
    (invalid,) = [c for c in result.candidates if c.settings.micro_batch == 32]
    assert invalid.status == "invalid"
    assert invalid.reason == (
        "global_batch 64 is not a multiple of the data streams (world_size / (tp_size x pp_size)) x "
        "micro_batch = 128"
    )
    json.dumps(result.to_dict())
