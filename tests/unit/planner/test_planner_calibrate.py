"""``moetrain plan --calibrate RUN_DIR``: the plan of a run's config against what the run measured.

- A synthetic run directory whose records are made, as the engine times its phases, by the plan
  with known factors (compute 4x slower, links 2x slower, 1.2x the allocated memory, 27%
  fragmentation; DDP's dense all-reduce inside the backward, a chunked all-to-all's hidden part
  left out of it): calibration recovers each factor and the plan made with the constants found
  takes the measured step time.
- Real CPU runs of ``moetrain train`` (1 rank, and 2 ranks with ep_size 2 through ``moetrain
  launch``) with today's records (tokens/s, no phases): the efficiency found makes the step agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from moetrain.config import TrainConfig, config_from_dict
from moetrain.planner import cluster_preset
from moetrain.planner.calibrate import calibrate, read_run, run_model
from moetrain.planner.cli import add_plan_parser
from moetrain.planner.plan import make_plan
from moetrain.planner.settings import PlanSettings
from tests.helpers.doc_commands import run_moetrain
from tests.helpers.paths import ROOT

TINY = {
    "model.d_model": 32,
    "model.moe.d_ff": 64,
    "data.micro_batch_size": 4,
    "data.seq_len": 32,
    "steps": 4,
    "log_every": 1,
    "checkpoint_every": 0,
}


def write_run(
    run_dir: Path, ranks: int, records: list[dict], ep_size: int = 1, a2a_chunks: int = 1, **top: object
) -> None:
    """A run directory as the engine writes it: config.json (its config's fields, no model name;
    ``top``: top-level fields set), metrics.jsonl and one log per rank."""
    data = yaml.safe_load((ROOT / "configs" / "tiny_lm.yaml").read_text())
    data["parallel"].update(ep_size=ep_size, a2a_chunks=a2a_chunks)
    data.update(top)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(config_from_dict(TrainConfig, data))))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "logs").mkdir()
    for rank in range(ranks):
        (run_dir / "logs" / f"rank_{rank}.log").write_text("")


@pytest.mark.parametrize("chunks", [1, 2])
def test_calibration_recovers_known_factors(chunks, tmp_path):
    """4 ranks, ep_size 2 (expert-DP groups of 2): the records hold what the engine times in each
    phase, made by the plan with the links 2x slower and the compute 4x slower: DDP's dense
    all-reduce in the backward, the expert-DP all-reduce in the gradient sync, and the all-to-all's
    exposed part (``a2a_chunks`` 2 hides some of it behind the experts)."""
    run_dir = tmp_path / "run"
    write_run(run_dir, 4, [{"step": 1, "tokens_per_s": 1.0}], ep_size=2, a2a_chunks=chunks)
    model, defaults = run_model(read_run(run_dir))
    assert model.name == "run" and defaults["ep_size"] == 2 and defaults["a2a_chunks"] == chunks
    cluster = cluster_preset("a100-80gb", 1, gpus_per_node=4)
    settings = PlanSettings(**defaults)
    plan = make_plan(model, cluster, settings, "cpu")
    slow = replace(
        cluster,
        intra_node_bandwidth=cluster.intra_node_bandwidth / 2,
        inter_node_bandwidth=cluster.inter_node_bandwidth / 2,
    )
    truth = make_plan(
        model, slow, settings.replace(compute_efficiency=settings.compute_efficiency / 4), "cpu"
    )
    t = truth.time
    seconds = {x.name: x.seconds for x in truth.traffic}
    assert seconds["dp_all_reduce"] > 0 and seconds["expert_dp_all_reduce"] > 0
    assert (t["all_to_all_hidden_s"] > 0) == (chunks > 1)
    compute = t["compute_s"] + t["recompute_s"]
    a2a = t["all_to_all_s"] - t["all_to_all_hidden_s"]  # the exposed wait: what time/all_to_all_s holds
    step = (
        compute + a2a + seconds["dp_all_reduce"] + seconds["expert_dp_all_reduce"] + t["optimizer_exposed_s"]
    )
    assert step == pytest.approx(t["step_s"], rel=1e-12)
    allocated = plan.gpu_total - plan.gpu_memory["reserved"]
    dynamic = plan.gpu_memory["step_peak"] + plan.gpu_memory["all_to_all_buffers"]
    record = {
        "time/step_s": step,
        "time/forward_s": 0.4 * compute + a2a / 2,
        "time/backward_s": 0.6 * compute + a2a / 2 + seconds["dp_all_reduce"],  # DDP: in the last backward
        "time/all_to_all_s": a2a,
        "time/grad_sync_s": seconds["expert_dp_all_reduce"],  # reduce_gradients: the expert reducer
        "time/optimizer_s": t["optimizer_exposed_s"],
        "memory/peak_allocated_bytes": round(1.2 * allocated),
        "memory/peak_reserved_bytes": round(1.2 * allocated + 0.27 * dynamic),
    }
    run_dir = tmp_path / "run2"
    records = [{"step": 1, "tokens_per_s": 1.0, "time/step_s": 99.0}]  # start-up: left out
    records += [{"step": s, "tokens_per_s": t["tokens_per_step"] / step, **record} for s in (2, 3)]
    write_run(run_dir, 4, records, ep_size=2, a2a_chunks=chunks)
    result = calibrate(model, cluster, settings, read_run(run_dir), kernels="cpu")
    c = result.constants
    assert c["compute_efficiency"] == pytest.approx(settings.compute_efficiency / 4)
    assert c["link_bandwidth_factor"] == pytest.approx(0.5)
    assert c["intra_node_gbs"] == pytest.approx(cluster.intra_node_bandwidth / 2e9)
    assert c["allocated_memory_ratio"] == pytest.approx(1.2, rel=1e-6)
    assert c["fragmentation"] == pytest.approx(0.27, rel=1e-4)
    assert result.measured["step_s"] == pytest.approx(step)
    assert result.measured["compute_s"] == pytest.approx(compute)
    assert result.predicted["grad_sync_s"] == pytest.approx(
        next(x.seconds for x in plan.traffic if x.name == "expert_dp_all_reduce")
    )
    calibrated = result.calibrated_plan.time
    assert calibrated["all_to_all_s"] - calibrated["all_to_all_hidden_s"] == pytest.approx(a2a)
    assert calibrated["step_s"] == pytest.approx(step, rel=1e-9)
    assert result.run.records == 2
    table = result.format_table()
    assert "compute_efficiency" in table and "peak allocated memory per GPU" in table
    assert "note: dp_all_reduce run inside time/forward_s + time/backward_s" in table
    json.dumps(result.to_dict())


@pytest.mark.parametrize(
    "budget_mb, recompute, budget_bytes", [(None, "none", None), (0, "full", None), (1.5, "budget", 1572864)]
)
def test_the_plan_recomputes_what_the_run_did(budget_mb, recompute, budget_bytes, tmp_path, capsys):
    """The run's ``recompute_budget_mb`` is the plan's recompute (not the planner's own "auto"
    choice); ``--recompute`` replaces it."""
    run_dir = tmp_path / "run"
    write_run(run_dir, 1, [{"step": 1, "tokens_per_s": 100.0}], recompute_budget_mb=budget_mb)
    cluster = ["--cluster", "a100-80gb", "--nodes", "1", "--gpus-per-node", "1"]
    assert plan_command("--calibrate", str(run_dir), *cluster, "--json") == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["recompute"], settings["recompute_budget_bytes"]) == (recompute, budget_bytes)
    assert plan_command("--calibrate", str(run_dir), *cluster, "--recompute", "auto", "--json") == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["recompute"], settings["recompute_budget_bytes"]) == ("auto", None)


def test_world_size_and_missing_files_are_one_line_errors(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, 2, [{"step": 1, "tokens_per_s": 100.0}], ep_size=2)
    run = read_run(run_dir)
    model, defaults = run_model(run)
    with pytest.raises(ValueError, match="the run had 2 ranks; the cluster must have as many GPUs") as caught:
        calibrate(model, cluster_preset("a100-80gb", 1, gpus_per_node=1), PlanSettings(**defaults), run)
    assert "\n" not in str(caught.value)
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="metrics.jsonl has no logged step"):
        read_run(run_dir)
    with pytest.raises(ValueError, match="no config.json"):
        read_run(tmp_path)


def train(out_dir: Path, tmp_path: Path, ranks: int) -> None:
    options = {**TINY, "out_dir": out_dir}
    sets = [word for key, value in options.items() for word in ("--set", f"{key}={value}")]
    if ranks == 1:
        words = ["moetrain", "train", "--config", "configs/tiny_lm.yaml", *sets]
    else:
        words = ["moetrain", "launch", "--nproc-per-node", str(ranks), "-m", "moetrain.cli", "train"]
        words += ["--config", "configs/tiny_lm.yaml", *sets, "--set", f"parallel.ep_size={ranks}"]
    run_moetrain(words, tmp_path, ("configs/",), timeout=400)


def plan_command(*words: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *words])
    return args.run(args)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 2])
def test_calibrating_on_a_cpu_run(ranks, tmp_path, capsys):
    out = tmp_path / "run"
    train(out, tmp_path, ranks)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    cluster = ["--cluster", "a100-80gb", "--nodes", "1", "--peak-tflops", "0.01"]
    cluster += ["--gpus-per-node", str(ranks)]
    assert plan_command("--calibrate", str(out), *cluster, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["world_size"] == ranks and result["records"] == 3 and result["kernels"] == "cpu"
    used = records[1:]
    tokens_per_step = 4 * 32 * ranks  # micro-batch x seq_len x ranks (ep_size ranks, each its own data)
    step = statistics.median(r["time/step_s"] for r in used)  # the engine logs the step's phases
    assert step == pytest.approx(
        tokens_per_step / statistics.median(r["tokens_per_s"] for r in used), rel=0.05
    )
    assert result["measured"]["step_s"] == pytest.approx(step)
    measured = result["measured"]
    if ranks == 1:  # no exchange, no all-to-all phase, no collective inside forward and backward
        assert not any("time/all_to_all_s" in r for r in records)
        compute = statistics.median(r["time/forward_s"] + r["time/backward_s"] for r in used)
        assert measured["inside_collectives_s"] == 0 and measured["compute_s"] == pytest.approx(compute)
        efficiency = result["calibrated"]["compute_efficiency"]
        assert 0 < efficiency < 1
    else:  # the exchanges inside forward and backward, logged apart; DDP's all-reduce in the backward
        a2a = statistics.median(r["time/all_to_all_s"] for r in used)
        compute = statistics.median(
            r["time/forward_s"] + r["time/backward_s"] - r["time/all_to_all_s"] for r in used
        )  # each record's own, then the median
        assert a2a > 0 and compute > 0
        assert measured["all_to_all_s"] == pytest.approx(a2a)
        inside = measured["inside_collectives_s"]
        assert inside > 0 and any(note.startswith("dp_all_reduce run inside") for note in result["notes"])
        # ep_size = world: no expert-DP reduction, so time/grad_sync_s holds no planned collective
        assert result["predicted"]["grad_sync_s"] == 0
        if compute > inside:
            assert measured["compute_s"] == pytest.approx(compute - inside)
            efficiency = result["calibrated"]["compute_efficiency"]
            assert efficiency > 0  # above 1 when little compute is left: planned again at 1, with a note
            assert (efficiency > 1) == any("> 1: the run computed faster" in n for n in result["notes"])
        else:  # the link factor fitted to the (CPU, gloo) exchanges makes the all-reduce that long
            assert measured["compute_s"] is None and result["calibrated"]["compute_efficiency"] is None
    assert not any("fitted to the whole step" in note for note in result["notes"])
    assert result["measured"]["peak_allocated_bytes"] is None
    assert result["measured"]["grad_sync_s"] == pytest.approx(
        statistics.median(r["time/grad_sync_s"] for r in used)
    )
    if ranks == 2:  # the link constants are fitted to the logged all-to-all, or kept with a note why not
        fitted = "link_bandwidth_factor" in result["calibrated"]
        assert fitted != any("link constants stay as given" in note for note in result["notes"])
        with pytest.raises(ValueError, match="the run had 2 ranks"):
            plan_command("--calibrate", str(out), *cluster[:-1], "1")
    assert plan_command("--calibrate", str(out), *cluster) == 0
    assert "constants that make them agree" in capsys.readouterr().out


def test_the_backward_and_the_optimizer_step_are_compared_apart(tmp_path):
    """CUDA runs log the allocated peak of each phase; the plan's step peak is the larger of its
    backward's and its optimizer step's, and each is compared with its phase."""
    run_dir = tmp_path / "run"
    record = {
        "step": 1,
        "tokens_per_s": 100.0,
        "memory/peak_allocated_bytes": 3 * 2**20,
        "memory/peak_reserved_bytes": 4 * 2**20,
        "memory/peak_backward_bytes": 2 * 2**20,
        "memory/peak_optimizer_bytes": 3 * 2**20,
        "dropped_fraction": [0.5, 0.25],
    }
    write_run(run_dir, 1, [record])
    run = read_run(run_dir)
    assert run.phase_peaks == {"backward": 2 * 2**20, "optimizer": 3 * 2**20}
    assert run.dropped_fraction == 0.375
    model, defaults = run_model(run)
    cluster = cluster_preset("a100-80gb", 1, gpus_per_node=1)
    result = calibrate(model, cluster, PlanSettings(**defaults), run, kernels="cpu")
    plan, step = result.plan, result.plan.step_memory
    fixed = plan.gpu_total - plan.gpu_memory["reserved"] - plan.gpu_memory["step_peak"]
    assert result.predicted["backward_allocated_bytes"] == fixed + step.backward_total
    assert result.predicted["optimizer_allocated_bytes"] == fixed + step.optimizer_total
    assert max(step.backward_total, step.optimizer_total) == step.total
    assert result.measured["peak_optimizer_bytes"] == 3 * 2**20
    table = result.format_table()
    assert "  in the backward" in table and "  in the optimizer step" in table
    assert "note: the run dropped 38% of its routed slots at the experts' capacity" in table
    assert result.to_dict()["measured"]["dropped_fraction"] == 0.375
