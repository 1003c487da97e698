"""The planner's ``split``: memory and traffic of tensor-parallel layers, the recommendation of where
it pays off, and "plan, then train" in two commands."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from moe_lm import LMConfig, default_lm_strategy, describe_lm
from moetrain.cli import main
from moetrain.planner.hardware import cluster_preset
from moetrain.planner.plan import make_plan
from moetrain.planner.settings import PlanSettings
from moetrain.planner.split import split_units
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT

OWN_MODEL = ROOT / "scripts" / "examples" / "own_model"


def classifier_config(tmp_path: Path, num_classes: int, d_model: int, **extra: str) -> Path:
    """The own-model example's config with another head size (its model module copied beside)."""
    text = (OWN_MODEL / "config.yaml").read_text()
    text = text.replace("num_classes: 10", f"num_classes: {num_classes}").replace(
        "d_model: 32", f"d_model: {d_model}"
    )
    text = text.replace("out_dir: runs/digit_sum", f"out_dir: {tmp_path / 'run'}")
    for key, value in extra.items():
        text += f"{key}: {value}\n"
    (tmp_path / "my_moe_model.py").write_text((OWN_MODEL / "my_moe_model.py").read_text())
    path = tmp_path / f"classifier_{num_classes}.yaml"
    path.write_text(text)
    return path


def plan_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_recommend_splits_a_huge_head_and_keeps_a_small_model_replicated(tmp_path):
    """On 8 nodes of 8 A100s, a 200k-class head's gradient all-reduce costs more than its
    activations' all-reduce inside a node: split.head over tp > 1; the example's 10-class head
    stays replicated (tp_size 1) and the MoE layer is expert-parallel in both."""
    big = plan_json("--model", str(classifier_config(tmp_path, 200_000, 64)), "--cluster", "a100-80gb",
                    "--nodes", "8", "--recommend")  # fmt: skip
    assert big["parallel"]["tp_size"] > 1 and big["strategy"] == {"ffn": "expert", "head": "split.head"}
    head = next(u for u in big["split"]["units"] if u["unit"] == "head")
    assert head["split_s"] < head["replica_s"] and head["choice"] == "split"
    small = plan_json(
        "--model", str(OWN_MODEL / "config.yaml"), "--cluster", "a100-80gb", "--nodes", "8", "--recommend"
    )
    assert small["parallel"]["tp_size"] == 1 and small["strategy"] == {"ffn": "expert"}
    assert all(u["choice"] == "replica" for u in small["split"]["units"])


def test_split_memory_and_traffic_in_the_plan():
    """tp_size 2 with the LM's split strategy: each rank holds half of every split unit's
    parameters (q/k/v/proj of every block, embedding, head), the dense all-reduce runs over the
    world / 2 ranks of a tp index, the activation all-reduces are two per block plus the
    embedding's and the head's (and its three statistics) per micro-step, and a tp pair reads one
    data stream."""
    config = LMConfig()
    model = describe_lm(config)
    cluster = cluster_preset("a100-80gb", 1)
    base = PlanSettings(micro_batch=4, seq_len=64, precision="bf16", recompute="none")
    one = make_plan(model, cluster, base)
    two = make_plan(model, cluster, base.replace(tp_size=2, strategy=default_lm_strategy(config, 2)))
    units = split_units(model, base)
    split = sum(u.weights for u in units)
    assert {u.kind for u in units} == {"attention", "embedding", "head"}
    assert one.params["per_rank"] - two.params["per_rank"] == split // 2
    tp = next(t for t in two.traffic if t.name == "tp_all_reduce")
    assert tp.calls == 2 * config.num_layers + 1 + 1 + 3
    assert two.time["tokens_per_step"] * 2 == one.time["tokens_per_step"]
    dp_one = next(t for t in one.traffic if t.name == "dp_all_reduce")
    dp_two = next(t for t in two.traffic if t.name == "dp_all_reduce")
    assert dp_two.intra_bytes < dp_one.intra_bytes
    with pytest.raises(ValueError, match="tp_size = 2 needs a strategy"):
        base.replace(tp_size=2)


def _train_with(rank, world, config, strategy):
    from moetrain.cli import main as cli

    options = ["steps=2", "device=cpu", "data.micro_batch_size=4", "checkpoint_every=0", "log_every=1"]
    return cli(["train", "--config", config, "--strategy", strategy, *(f"--set={o}" for o in options)])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_then_train_in_two_commands(tmp_path):
    """`moetrain plan --recommend --json > plan.json`, then `moetrain train --strategy plan.json` on
    the two ranks planned for: the head is split (tp_size 2) and the run trains to its end."""
    config = classifier_config(tmp_path, 200_000, 64)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cluster = ["--cluster", "a100-80gb", "--nodes", "1", "--gpus-per-node", "2"]
        code = main(["plan", "--model", str(config), *cluster, "--ep-size", "1", "--recommend", "--json"])
    assert code == 0
    plan = tmp_path / "plan.json"
    plan.write_text(out.getvalue())
    recommended = json.loads(out.getvalue())
    assert recommended["parallel"] == {"ep_size": 1, "tp_size": 2}
    assert recommended["strategy"]["head"] == "split.head"
    assert run_distributed(_train_with, 2, str(config), str(plan)) == [0, 0]
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (
        recorded["parallel"]["tp_size"] == 2 and recorded["parallel"]["strategy"] == recommended["strategy"]
    )
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]


def test_a_model_built_with_scopes_is_planned_with_its_marks_at_tp2(tmp_path, caplog):
    """``moetrain plan`` on a config whose model is written with Whale's annotations (no strategy
    hook, no strategy key) takes the marks' strategy at ``tp_size`` 2 (split embedding, head by
    heads, experts); ``scope.auto()`` parts are planned replicated, with a warning saying so."""
    import yaml

    from moetrain.planner.model import resolve_model
    from moetrain.planner.settings import PlanSettings

    def write(name: str, model: dict) -> str:
        config = {
            "imports": ["tests.helpers.scoped_lm"],
            "model": model,
            "data": {"micro_batch_size": 2, "seq_len": 16},
            "parallel": {"tp_size": 2},
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return str(path)

    staged = write("staged", {"name": "staged_lm", "stages": [0, 0]})
    model, defaults = resolve_model(staged)
    strategy = defaults["strategy"]
    assert strategy["embed"] == "split" and strategy["head"] == "split.head", strategy
    assert strategy["blocks.0.ffn"] == "expert", strategy
    plan = make_plan(model, cluster_preset("a100-80gb", 1, gpus_per_node=2), PlanSettings(**defaults))
    unsplit = make_plan(
        model,
        cluster_preset("a100-80gb", 1, gpus_per_node=2),
        PlanSettings(**{**defaults, "strategy": {"embed": "replica", "head": "replica"}}),
    )
    assert (
        plan.params["per_rank"] < unsplit.params["per_rank"]
    )  # the split halves embedding and head per rank
    with caplog.at_level("WARNING", logger="moetrain.planner.model"):
        _, auto_defaults = resolve_model(write("auto", {"name": "auto_lm"}))
    assert "scope.auto() planned replicated" in caplog.text
    assert not any(kind.startswith("split") for kind in auto_defaults["strategy"].values())
