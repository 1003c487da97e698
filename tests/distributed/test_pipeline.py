"""Pipeline stages (:mod:`moetrain.pipeline`) on real gloo ranks against one process: world 4 as
pp2 x ep2 and pp2 x dp2 under GPipe and 1F1B (and interleaved 1F1B), the LM cut into stages and
run by ``torch.distributed.pipelining``; the losses, every gradient (MoE aux losses included), the
global gradient norm over all stages and the routed counts summed over stages equal one process
running the same ``m`` micro-batches of every data stream with gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy, lm_loss
from moetrain import MoEConfig, ParallelConfig, ParallelContext
from moetrain.layers import MoELayer
from moetrain.pipeline import balance_layers, bubble_fraction, stage_layers
from tests.helpers.dist_utils import run_distributed
from tests.helpers.pipeline_reference import pipeline_step_report

LM = LMConfig(
    vocab_size=64,
    d_model=32,
    num_layers=4,
    num_heads=4,
    max_seq_len=16,
    moe=MoEConfig(
        d_model=32,
        d_ff=32,
        num_experts=4,
        top_k=2,
        capacity_factor=None,
        aux_loss_coef=0.01,
        z_loss_coef=1e-3,
    ),
)
MICRO = 4  # micro-batches per step (>= stages for 1F1B)


def _tokens(index: int, batch: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(0, LM.vocab_size, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def pipeline_worker(rank, world, layouts):
    reports = []
    for ep, schedule, virtual in layouts:
        config = ParallelConfig(ep_size=ep, pp_size=2, pp_schedule=schedule, pp_virtual=virtual)
        parallel = ParallelContext(config)
        torch.manual_seed(0)
        model = MoETransformerLM(LM, seed=3)
        strategy = default_lm_strategy(LM, 1, parallel.pp_size)
        report = pipeline_step_report(model, parallel, strategy, MICRO, _tokens, lm_loss, _lm_loss_of)
        routed = {
            name: module.last_stats.routed_per_expert.tolist()
            for name, module in model.named_modules()
            if isinstance(module, MoELayer)
        }
        reports.append({"layout": (ep, schedule, virtual), **report, "routed": routed})
    return reports


def _lm_loss_of(net, inputs, targets):
    return lm_loss(net(inputs), targets)


def _check(results, world_params):
    for rank_reports in results:
        for r in rank_reports:
            worst = max(r["grads"].items(), key=lambda item: item[1])
            assert worst[1] < 1e-4, (r["layout"], worst)
            assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-5), r["layout"]
            holds_last = "head.weight" in r["params"]
            if holds_last:
                assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), r["layout"]
            else:
                assert r["losses"] == []
    for i, layout in enumerate(results[0]):
        names = set()
        for rank_reports in results:
            names |= set(rank_reports[i]["params"])
        assert names == world_params, layout["layout"]  # every parameter on some stage, names unchanged
        for stream, (stages_sum, ref) in _stage_aux_sums(results, i).items():
            assert stages_sum == pytest.approx(ref, rel=1e-5), (layout["layout"], stream)
            assert ref > 0


def _stage_aux_sums(results, index):
    """{data stream: [sum over stages of the stages' aux losses, the reference's]}."""
    by_stream: dict = {}
    for rank_reports in results:
        r = rank_reports[index]
        by_stream.setdefault(r["stream"], [0.0, r["ref_aux"]])[0] += r["aux"]
    return by_stream


WORLD_PARAMS = {name for name, _ in MoETransformerLM(LM).named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_ep2_and_pp2_dp2_gpipe_and_1f1b_equal_one_process():
    """World 4 as pp2 x ep2 and pp2 x dp2 under GPipe and 1F1B: losses, gradients (aux losses
    included), the global norm over both stages equal one process accumulating the micro-batches."""
    layouts = [(2, "gpipe", 1), (2, "1f1b", 1), (1, "gpipe", 1), (1, "1f1b", 1), (2, "interleaved_1f1b", 2)]
    _check(run_distributed(pipeline_worker, 4, layouts), WORLD_PARAMS)


def test_balance_layers_and_stage_ranges():
    assert balance_layers([1, 1, 1, 1], 2) == [2]
    assert balance_layers([4, 1, 1, 1, 1], 2) == [1]
    assert balance_layers([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    assert stage_layers(5, 2, [1]) == [range(0, 1), range(1, 5)]
    with pytest.raises(ValueError, match="pp_layers"):
        stage_layers(4, 2, [4])
    with pytest.raises(
        ValueError, match=r"parallel.pp_size \* parallel.pp_virtual = 3 stages must be <= model"
    ):
        balance_layers([1, 1], 3)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(2, 4, virtual=2) == pytest.approx(1 / 9)


def _engine_config(out_dir, pp_size=1, schedule="1f1b", steps=4):
    from tests.unit.engine.test_engine import tiny

    overrides = {
        "model.num_layers": 2,
        "model.moe.aux_loss_coef": 0.01,
        "model.moe.router_jitter": 0.0,  # random draws would depend on the order the stages run in
        "model.moe.score_bias_rate": 0.01,  # aux-free balancing: its biases' range over all stages
        "grad_accum": 2,
        "steps": steps,
        "parallel.pp_size": pp_size,
        "parallel.pp_schedule": schedule,
        "optim.grad_clip": 0.05,  # the clipping norm is taken over both stages
    }
    return tiny(out_dir, **overrides)


def _metrics(history):
    keys = ("loss", "aux_loss", "grad_norm", "expert_load_cv", "dropped_fraction", "score_bias_range")
    return [{k: m[k] for k in keys} for m in history]


def _train(config: dict, until=None) -> list[dict]:
    """``moetrain train``'s Trainer on ``config`` (until step ``until``): its logged metrics."""
    from moetrain.config import TrainConfig, config_from_dict
    from moetrain.engine import Trainer

    trainer = Trainer(config_from_dict(TrainConfig, config))
    try:
        return _metrics(trainer.train(until=until))
    finally:
        trainer.close()


def engine_worker(rank, world, out_dir, schedule, until=None, precision="fp32"):
    return _train({**_engine_config(out_dir, world, schedule), "precision": precision}, until)


def _approx(history, expected, rel=2e-4):
    assert len(history) == len(expected)
    for got, want in zip(history, expected, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-7), (key, got, want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moetrain_train_pp2_equals_one_process_and_its_checkpoint_resumes_under_pp1(tmp_path):
    """``Trainer`` with parallel.pp_size 2 (GPipe and 1F1B, two stages of one block, grad_accum 2
    micro-batches, gradient clipping active): loss, aux loss (summed over stages), grad norm and
    expert metrics (the aux-free score biases' range of every layer included) equal one process's;
    a pp2 run stopped at step 2 resumes in one process (pp1) and ends where the one-process run
    ends (parameters, optimizer state and data stream resharded pp2 -> pp1 by name)."""
    single = _train(_engine_config(tmp_path / "single"))
    for schedule in ("gpipe", "1f1b"):
        ranks = run_distributed(engine_worker, 2, str(tmp_path / schedule), schedule)
        _approx(ranks[0], single)
        assert ranks[1] == ranks[0]
    first = run_distributed(engine_worker, 2, str(tmp_path / "resumed"), "1f1b", 2)
    _approx(first[0], single[:2])
    second = _train(_engine_config(tmp_path / "resumed"))
    _approx(second, single[2:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moetrain_train_pp2_under_fp16_equals_one_process(tmp_path):
    """precision fp16 (autocast, dynamic loss scale) with two 1F1B stages: the schedule scales the
    losses by the scaler's scale; the run's metrics equal one process's fp16 run."""
    single = _train({**_engine_config(tmp_path / "single"), "precision": "fp16"})
    ranks = run_distributed(engine_worker, 2, str(tmp_path / "pp2"), "1f1b", None, "fp16")
    _approx(ranks[0], single, rel=2e-3)
    assert ranks[1] == ranks[0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pp_size": 0}, "pp_size must be an integer >= 1"),
        ({"pp_schedule": "zb"}, "pp_schedule must be one of 'gpipe', '1f1b', 'interleaved_1f1b'"),
        ({"pp_size": 2, "pp_schedule": "interleaved_1f1b"}, "pp_virtual must be > 1"),
        ({"pp_size": 2, "pp_layers": [2, 1]}, "pp_layers must be 1 increasing"),
        ({"pp_size": 2, "tp_size": 2}, "pp_size > 1 composes with ep and dp"),
        ({"pp_size": 2, "replica": "fsdp"}, "pp_size > 1 composes with ep and dp"),
    ],
)
def test_parallel_config_pipeline_keys_are_validated(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ParallelConfig(**options)


def test_train_config_pipeline_errors(tmp_path):
    from moetrain.config import TrainConfig, config_from_dict
    from moetrain.engine import check_fits
    from tests.unit.engine.test_engine import tiny

    with pytest.raises(ValueError, match=r"grad_accum = 1 \(the pipeline's micro-batches\) must be >="):
        config_from_dict(TrainConfig, tiny(tmp_path, **{"parallel.pp_size": 2}))
    with pytest.raises(ValueError, match="balance is not supported with parallel.pp_size > 1"):
        config_from_dict(
            TrainConfig, tiny(tmp_path, grad_accum=2, **{"parallel.pp_size": 2, "balance.speeds": [1.0, 2.0]})
        )
    config = config_from_dict(TrainConfig, tiny(tmp_path, grad_accum=2, **{"parallel.pp_size": 2}))
    with pytest.raises(ValueError, match="parallel.pp_size = 2 must divide the world size = 3"):
        check_fits(config, 3)
    interleaved = {
        "parallel.pp_size": 2,
        "parallel.pp_schedule": "interleaved_1f1b",
        "parallel.pp_virtual": 2,
    }
    # torch's interleaved schedule runs whole rounds of grad_accum // pp_size micro-batches: 5 is not 2 rounds
    message = r"grad_accum = 5 must be a multiple of grad_accum // parallel.pp_size = 2 under pp_schedule"
    with pytest.raises(ValueError, match=message):
        config_from_dict(TrainConfig, tiny(tmp_path, grad_accum=5, **interleaved))
    for accum in (2, 3, 4, 6):  # 1 round of 2 or 3, 2 rounds of 2 or 3
        config_from_dict(TrainConfig, tiny(tmp_path, grad_accum=accum, **interleaved))


def test_interleaved_microbatch_rule_is_torchs():
    """The rule of :func:`moetrain.config.check_pipeline_microbatches` is what torch's
    ScheduleInterleaved1F1B accepts (its constructor raises for the rest; no process group needed
    to construct it on stages that are never run)."""
    from moetrain.config import check_pipeline_microbatches
    from moetrain.planner import PlanSettings

    for stages in (2, 4):
        for microbatches in range(stages, 4 * stages + 2):
            try:
                check_pipeline_microbatches("interleaved_1f1b", stages, microbatches, "pp_size")
                ours = True
            except ValueError:
                ours = False
            rounds = max(1, microbatches // stages)
            assert ours == (microbatches % rounds == 0), (stages, microbatches)
    with pytest.raises(ValueError, match="grad_accum = 9 must be a multiple of grad_accum // pp_size = 2"):
        PlanSettings(pp_size=4, pp_schedule="interleaved_1f1b", pp_virtual=2, grad_accum=9)


def test_lm_stage_keeps_parameter_names_and_the_model_without_pipeline_hook_is_refused():
    model = MoETransformerLM(LM)
    names = dict(model.named_parameters())
    model.pipeline_stage([2, 3], first=False, last=True)
    kept = dict(model.named_parameters())
    assert set(kept) == {n for n in names if n.startswith(("blocks.2.", "blocks.3.", "norm.", "head."))}
    assert all(kept[n] is names[n] for n in kept)
    hidden = torch.randn(2, 8, LM.d_model)
    assert model(hidden).shape == (2, 8, LM.vocab_size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_world8_pp2_ep2_dp2_1f1b_equals_one_process():
    """World 8 as pp2 x ep2 x dp2 (1F1B): every stage has two data streams of two expert-parallel
    ranks; losses, gradients, norm and aux sums equal one process (~18 s on 2 shared cores)."""
    _check(run_distributed(pipeline_worker, 8, [(2, "1f1b", 1)]), WORLD_PARAMS)


def exchange_worker(rank, world, variants):
    """pp2 x ep2 1F1B with each variant of the expert-parallel exchange: max relative gradient error
    of this stage against one process, and the dispatcher its MoE layers use."""
    reports = []
    for extra in variants:
        parallel = ParallelContext(ParallelConfig(ep_size=2, pp_size=2, pp_schedule="1f1b", **extra))
        torch.manual_seed(0)
        model = MoETransformerLM(LM, seed=3)
        strategy = default_lm_strategy(LM, 1, parallel.pp_size)
        report = pipeline_step_report(model, parallel, strategy, MICRO, _tokens, lm_loss, _lm_loss_of)
        dispatchers = {type(m.dispatcher).__name__ for m in model.modules() if isinstance(m, MoELayer)}
        reports.append((max(report["grads"].values()), sorted(dispatchers)))
    return reports


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stages_compose_with_the_chunked_and_the_node_deduplicating_exchange():
    """Inside pipeline stages, the expert-parallel layers exchange with a2a_chunks 2, and with
    node_dedup over two emulated nodes (one rank each): gradients equal one process."""
    variants = [{"a2a_chunks": 2}, {"all_to_all": "node_dedup", "local_world_size": 1}]
    for rank_reports in run_distributed(exchange_worker, 4, variants):
        (chunked, chunked_kind), (dedup, dedup_kind) = rank_reports
        assert chunked < 1e-5 and dedup < 1e-5, rank_reports
        assert chunked_kind == ["AllToAllTokenDispatcher"] and dedup_kind == ["NodeDedupTokenDispatcher"]
