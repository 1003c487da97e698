"""Models written with :mod:`moetrain.scope` on real gloo ranks: ``parallelize(model, mesh)`` (the
scopes' marks) against ``parallelize(model, mesh, pattern_table)`` on the same model, data and seed.

- the LM at tp2 (DDP) and ep2 (FSDP2), and built on ``meta`` then materialised: the same
  assignments, losses and weights after three AdamW steps;
- M6 at tp2: the same;
- stage scopes as the pipeline's cut points (pp2), gradients equal one process;
- ``moetrain train``'s Trainer on a registered model whose builder uses scopes (``staged_lm``, no
  strategy hook, pp2 cut by its stage marks) equals the LM's run cut by ``pp_layers``;
- the Whale MoE example (scripts/examples/whale_moe.py) under ``moetrain launch`` on 2 ranks.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy, lm_loss
from moetrain import MoEConfig, ParallelConfig, ParallelContext, parallelize, strategy_from_scopes
from tests.distributed.test_parallelize import LM, _tokens, full
from tests.helpers.dist_utils import run_distributed


def _train_lm(model, parallel, strategy, steps: int = 3, materialize: bool = False):
    """``steps`` AdamW steps of ``model`` parallelized by ``strategy`` (None: its scopes); returns
    the assignments, the losses and the weights (global values)."""
    trained = parallelize(model, parallel, strategy)
    if materialize:
        torch.manual_seed(11)  # the same non-expert initialisation for both builds
        trained.materialize("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        inputs, targets = _tokens(parallel.data_index * 10 + step)
        out = trained(inputs)
        with trained.loss_context(out):
            loss = lm_loss(out, targets)
            loss.backward()
        trained.reduce_gradients()
        trained.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(full(loss.detach())))
    weights = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
    return sorted((a.name, a.kind) for a in trained.assignments), losses, weights


def lm_worker(rank, world):
    reports = []
    for ep, tp, replica, meta in ((1, 2, "ddp", False), (2, 1, "fsdp", False), (1, 2, "ddp", True)):
        runs = []
        for strategy in (None, default_lm_strategy(LM, tp)):
            parallel = ParallelContext(ParallelConfig(ep_size=ep, tp_size=tp, replica=replica))
            torch.manual_seed(0)
            with torch.device("meta" if meta else "cpu"):
                model = MoETransformerLM(LM, seed=3)
            runs.append(_train_lm(model, parallel, strategy, materialize=meta))
        (marked, marked_losses, marked_weights), (table, table_losses, table_weights) = runs
        reports.append(
            {
                "layout": (ep, tp, replica, meta),
                "same_assignments": marked == table,
                "kinds": sorted({kind for _, kind in marked}),
                "losses": (marked_losses, table_losses),
                "weights_equal": all(torch.equal(marked_weights[n], table_weights[n]) for n in table_weights),
            }
        )
    return reports


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_lm_with_scopes_trains_as_its_pattern_table_on_gloo():
    """tp2 (DDP), ep2 (FSDP2) and tp2 built on meta: parallelize(model, mesh) with no strategy takes
    exactly the table's assignments and trains to bit-equal losses and weights."""
    for rank_reports in run_distributed(lm_worker, 2):
        for r in rank_reports:
            assert r["same_assignments"], r["layout"]
            assert r["losses"][0] == r["losses"][1] and r["weights_equal"], r
            assert len(set(r["losses"][0])) == 3  # three different batches, three steps taken
            if r["layout"][1] == 2:
                assert {"split", "split.row", "split.head", "expert"} <= set(r["kinds"])


def m6_worker(rank, world):
    from m6_moe import M6Model, m6_loss
    from m6_moe.model import default_m6_strategy
    from tests.distributed.test_parallelize import _m6_batch, m6_config

    config = m6_config()
    runs = []
    for strategy in (None, default_m6_strategy(config, tp_size=2)):
        parallel = ParallelContext(ParallelConfig(tp_size=2))
        torch.manual_seed(0)
        model = M6Model(config, seed=5)
        trained = parallelize(model, parallel, strategy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            inputs, labels = _m6_batch(parallel.data_index + step)
            logits = trained(**inputs)
            with trained.loss_context(logits):
                loss = m6_loss(logits, labels)
                loss.backward()
            trained.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(full(loss.detach())))
        weights = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
        runs.append((sorted((a.name, a.kind) for a in trained.assignments), losses, weights))
    (marked, marked_losses, mw), (table, table_losses, tw) = runs
    return {
        "same_assignments": marked == table,
        "split": sum(kind.startswith("split") for _, kind in marked),
        "losses": (marked_losses, table_losses),
        "weights_equal": all(torch.equal(mw[n], tw[n]) for n in tw),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_m6_with_scopes_trains_as_its_pattern_table_on_gloo():
    for r in run_distributed(m6_worker, 2):
        assert r["same_assignments"] and r["split"] > 0, r
        assert r["losses"][0] == r["losses"][1] and r["weights_equal"], r


def stage_worker(rank, world):
    from tests.helpers.pipeline_reference import pipeline_step_report
    from tests.helpers.scoped_lm import StagedLM

    config = LMConfig(**{**LM.__dict__, "num_layers": 4})
    parallel = ParallelContext(ParallelConfig(pp_size=2, pp_schedule="gpipe"))
    torch.manual_seed(0)
    model = StagedLM(config, [0, 0, 0, 1], seed=3)
    assert strategy_from_scopes(model, parallel)["blocks"] == "pipeline"

    def loss_of(net, inputs, targets):
        return lm_loss(net(inputs), targets)

    report = pipeline_step_report(model, parallel, None, 2, _tokens, lm_loss, loss_of)
    explicit = ParallelContext(ParallelConfig(pp_size=2, pp_layers=[2]))  # overrides the stage marks
    ranges = parallelize(StagedLM(config, [0, 0, 0, 1]), explicit).pipeline.ranges
    errors = []
    try:  # three stages marked, two pipeline ranks
        parallelize(StagedLM(config, [0, 1, 2, 2]), ParallelContext(ParallelConfig(pp_size=2)))
    except ValueError as error:
        errors.append(str(error))
    return {**report, "errors": errors, "explicit_ranges": [list(r) for r in ranges]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage_scopes_give_the_pipeline_cut_points():
    """Four layers staged 0, 0, 0, 1 on pp2: rank 0 holds blocks 0-2, rank 1 block 3 (balance would
    cut at 2); the pipeline step's gradients equal one process. parallel.pp_layers, when set, cuts
    instead. Three stage marks on two ranks are one error naming the stack."""
    for r in run_distributed(stage_worker, 2):
        blocks = {name.split(".")[1] for name in r["params"] if name.startswith("blocks.")}
        assert blocks == ({"0", "1", "2"} if r["stage"] == 0 else {"3"}), blocks
        worst = max(r["grads"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-4, worst
        assert r["explicit_ranges"] == [[0, 1], [2, 3]]
        assert r["errors"] == [
            "the scope.stage marks of 'blocks' cut it into 3 stages, pp_size * pp_virtual = 2: make them "
            "agree (or set parallel.pp_layers)"
        ]


def _run_trainer(config: dict):
    """``moetrain train``'s Trainer on ``config``: each step's loss, aux loss and gradient norm, and
    the kinds its strategy gave (module name -> kind)."""
    from moetrain.config import TrainConfig, config_from_dict
    from moetrain.engine import Trainer

    trainer = Trainer(config_from_dict(TrainConfig, config))
    try:
        history = trainer.train()
        kinds = {a.name: a.kind for a in trainer.trained.assignments}
    finally:
        trainer.close()
    return [(m["loss"], m["aux_loss"], m["grad_norm"]) for m in history], kinds


def train_worker(rank, world, out_dir):
    from tests.unit.engine.test_engine import tiny

    common = {"model.num_layers": 4, "model.moe.router_jitter": 0.0, "grad_accum": 2, "steps": 3}
    common.update({"parallel.pp_size": 2, "parallel.pp_schedule": "gpipe"})
    table = tiny(f"{out_dir}/table", **common, **{"parallel.pp_layers": [3]})
    scoped = tiny(f"{out_dir}/scoped", **common)
    scoped["imports"] = ["tests.helpers.scoped_lm"]
    scoped["model"] = {**scoped["model"], "name": "staged_lm", "stages": [0, 0, 0, 1]}
    return _run_trainer(scoped), _run_trainer(table)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moetrain_train_runs_a_registered_model_built_with_scopes(tmp_path):
    """``staged_lm`` (registered by its config's ``imports``, no strategy hook) trains under pp2 cut
    by its stage marks at layer 3, with its split / replica / expert marks; its metrics equal the
    LM's run with the pattern table and ``pp_layers: [3]``."""
    for rank, ((scoped, kinds), (table, table_kinds)) in enumerate(
        run_distributed(train_worker, 2, str(tmp_path))
    ):
        assert len(scoped) == 3
        assert [x for step in scoped for x in step] == pytest.approx(
            [x for step in table for x in step], rel=1e-6
        )
        # the engine asks default_strategy(model), which has no mesh: split marks stay, idle at tp 1
        assert set(kinds) >= set(table_kinds) and "blocks" in kinds
        for name, kind in kinds.items():
            idle = kind.startswith("split") and table_kinds.get(name) in (None, "replica")
            assert kind == table_kinds.get(name) or idle, (name, kind, table_kinds.get(name))
        held = {name.split(".")[1] for name in kinds if name.startswith("blocks.") and name.count(".") == 1}
        assert held == ({"0", "1", "2"} if rank == 0 else {"3"}), held


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_whale_moe_example_runs_on_two_ranks(tmp_path):
    from tests.helpers.doc_commands import run_moetrain

    words = ["moetrain", "launch", "--standalone", "--nproc-per-node", "2", "scripts/examples/whale_moe.py"]
    stdout, _ = run_moetrain(words, tmp_path, ("scripts/",))
    strategy = next(line for line in stdout.splitlines() if line.startswith("strategy from scopes:"))
    assert "blocks.0.moe: expert" in strategy and "blocks.1.mix: replica" in strategy
    assert "embed: replica" in strategy and "moe.experts" not in strategy
    losses = [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "parallelize: dp 1 x ep 2 x tp 1" in stdout and "expert 2" in stdout


AUTO = LMConfig(
    vocab_size=32768,
    d_model=128,
    num_layers=1,
    num_heads=4,
    max_seq_len=16,
    moe=MoEConfig(d_model=128, d_ff=128, num_experts=4, top_k=2, capacity_factor=None),
)


def auto_worker(rank, world):
    import dataclasses

    from moe_lm import describe_lm
    from moetrain.planner import PlanSettings, cluster_preset
    from moetrain.planner.auto import AutoSplit
    from moetrain.planner.split import recommend_split
    from tests.helpers.scoped_lm import auto_lm

    description = dataclasses.replace(describe_lm(AUTO), build=lambda: auto_lm(AUTO))
    settings = PlanSettings(micro_batch=2, seq_len=16, precision="bf16", autocast=True)
    cluster = cluster_preset("a100-80gb", 2, gpus_per_node=2)
    recommended = recommend_split(description, cluster, settings, 1.0, 0, tp_sizes=[2]).strategy
    runs = []
    for strategy, auto in ((None, AutoSplit(cluster, description, settings)), (recommended, None)):
        parallel = ParallelContext(ParallelConfig(tp_size=2, local_world_size=2))
        torch.manual_seed(0)
        model = auto_lm(AUTO, seed=3)
        trained = parallelize(model, parallel, strategy, auto=auto)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            g = torch.Generator().manual_seed(parallel.data_index * 10 + step)
            ids = torch.randint(0, AUTO.vocab_size, (2, 9), generator=g)
            out = trained(ids[:, :-1])
            with trained.loss_context(out):
                loss = lm_loss(out, ids[:, 1:])
                loss.backward()
            trained.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(full(loss.detach())))
        weights = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
        kinds = {a.name: a.kind for a in trained.assignments if a.kind != "replica"}
        runs.append((kinds, losses, weights))
    (auto_kinds, auto_losses, aw), (rec_kinds, rec_losses, rw) = runs
    return {
        "kinds": (auto_kinds, rec_kinds),
        "losses": (auto_losses, rec_losses),
        "weights_equal": all(torch.equal(aw[n], rw[n]) for n in rw),
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_auto_scopes_split_what_plan_recommend_splits_and_train_alike():
    """The model built under set_default("auto") on 4 ranks (2 emulated nodes x 2, tp2 x dp2):
    parallelize(..., auto=AutoSplit(cluster, description)) splits the units plan --recommend's
    split search splits at tp 2 (the embedding and the head) and trains as that strategy does."""
    for r in run_distributed(auto_worker, 4):
        auto_kinds, rec_kinds = r["kinds"]
        assert auto_kinds == rec_kinds and auto_kinds["embed"] == "split", r["kinds"]
        assert auto_kinds["head"] == "split.head" and auto_kinds["blocks.0.ffn"] == "expert"
        assert r["losses"][0] == r["losses"][1] and r["weights_equal"], r["losses"]


def train_auto_worker(rank, world, out_dir):
    """``moetrain train``'s way in: the config (``auto_lm``, registered by ``imports``) with
    ``parallel.auto_gpu``, the command line's decision object handed to the Trainer."""
    from moetrain.cli import _auto_split
    from moetrain.config import TrainConfig, config_from_dict
    from moetrain.engine import Trainer
    from tests.unit.engine.test_engine import tiny

    def config(**extra):
        data = tiny(f"{out_dir}/run{len(extra)}", steps=2, precision="bf16")
        data["imports"] = ["tests.helpers.scoped_lm"]
        data["model"] = {"name": "auto_lm", "vocab_size": AUTO.vocab_size, "d_model": AUTO.d_model,
                         "num_layers": 1, "num_heads": 4, "max_seq_len": 16,
                         "moe": {"d_ff": 128, "num_experts": 4, "top_k": 2}}  # fmt: skip
        data["data"] = {"micro_batch_size": 2, "seq_len": 16}
        data["parallel"] = {"tp_size": 2, "local_world_size": 2, **extra}
        return config_from_dict(TrainConfig, data)

    try:
        Trainer(config())
        refused = None
    except ValueError as error:
        refused = str(error)
    chosen = config(auto_gpu="a100-80gb")
    trainer = Trainer(chosen, auto=_auto_split(chosen))
    try:
        history = trainer.train()
        kinds = {a.name: a.kind for a in trainer.trained.assignments if a.kind != "replica"}
    finally:
        trainer.close()
    return refused, kinds, [m["loss"] for m in history]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_moetrain_train_decides_auto_scopes_for_the_gpu_the_config_names(tmp_path):
    """A registered model built under scope.auto() through ``moetrain train`` on 4 ranks (2 nodes x
    2, tp2): without ``parallel.auto_gpu`` one error naming it; with ``a100-80gb`` the units split
    are those of the direct parallelize(..., auto=AutoSplit(...)) test above (embedding, head), and
    it trains."""
    for refused, kinds, losses in run_distributed(train_auto_worker, 4, str(tmp_path)):
        assert refused is not None and "parallel.auto_gpu" in refused, refused
        assert kinds["embed"] == "split" and kinds["head"] == "split.head", kinds
        assert kinds["blocks.0.ffn"] == "expert", kinds
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
