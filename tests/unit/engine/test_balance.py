"""Hardware-aware batch balancing: the split, the loss weights (gradient of the global batch on
gloo ranks with unequal micro-batches), calibration, and the mixed-cluster planner."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
import torch.nn.functional as F

from moe_lm import LMConfig, MoETransformerLM, describe_lm
from moetrain import balance
from moetrain.balance import RankSpeed, balance_batch, calibrate, gather_speeds, loss_weight
from moetrain.config import MoEConfig
from moetrain.planner import PlanSettings
from moetrain.planner.mixed import plan_mixed_cluster
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.serial  # times real waits and rates: run alone (tests/README.md)


def test_split_is_proportional_to_speed_and_weights_average_to_one():
    plan = balance_batch(80, [1.0, 2.0, 3.0, 2.0])
    assert plan.micro_batches == (10, 20, 30, 20)
    assert plan.loss_weights == (0.5, 1.0, 1.5, 1.0)
    assert plan.step_time == pytest.approx(10.0) and plan.uniform_step_time == pytest.approx(20.0)
    assert plan.speedup == pytest.approx(2.0)


def test_memory_limits_overheads_and_minimum_of_one():
    plan = balance_batch(40, [1.0, 10.0, 10.0], memory_limits=[40, 12, 15])
    assert plan.micro_batches == (13, 12, 15)  # the fast ranks are capped, the slow one takes the rest
    plan = balance_batch(5, [1.0, 1000.0, 1000.0, 1000.0, 1000.0])
    assert min(plan.micro_batches) == 1 and sum(plan.micro_batches) == 5
    plan = balance_batch(30, [1.0, 1.0], overheads=[10.0, 0.0])
    assert plan.micro_batches == (10, 20)  # 10 + 10 = 0 + 20
    assert balance_batch(7, [1.0, 1.0, 1.0], memory_limits=[2, 9, 9]).uniform_step_time == float("inf")


def test_greedy_split_minimises_the_slowest_rank():
    rng = random.Random(0)
    for _ in range(40):
        world = rng.randint(2, 3)
        speeds = [rng.uniform(0.5, 4.0) for _ in range(world)]
        overheads = [rng.uniform(0.0, 2.0) for _ in range(world)]
        limits = [rng.randint(1, 8) for _ in range(world)]
        total = rng.randint(world, sum(limits))
        best = min(
            max(o + n / s for o, n, s in zip(overheads, sizes, speeds, strict=True))
            for sizes in itertools.product(*(range(1, m + 1) for m in limits))
            if sum(sizes) == total
        )
        plan = balance_batch(total, speeds, limits, overheads)
        assert sum(plan.micro_batches) == total
        assert all(1 <= n <= m for n, m in zip(plan.micro_batches, limits, strict=True))
        assert plan.step_time == pytest.approx(best)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, [1.0, 1.0, 1.0]), "global_batch must be an integer >= 3 \\(the ranks: each takes at least one"),
        ((10, []), "speeds must hold one speed per data-parallel rank"),
        ((10, [1.0, 0.0]), "speeds\\[1\\] must be a finite number > 0"),
        ((10, [1.0, 1.0], [4, 4]), "global_batch = 10 exceeds the sum of memory_limits = 8"),
        ((10, [1.0, 1.0], [4]), "memory_limits must have one entry per rank \\(2\\)"),
        ((10, [1.0, 1.0], [0, 10]), "memory_limits\\[0\\] must be an integer >= 1"),
    ],
)
def test_errors_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        balance_batch(*args)


def test_calibrate_fits_overhead_and_speed(monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr(balance.time, "perf_counter", lambda: clock["t"])

    def step(n: int) -> None:
        clock["t"] += 0.5 + n / 40.0

    speed = calibrate(step, sizes=(1, 2, 4, 8), repeats=2)
    assert speed.samples_per_s == pytest.approx(40.0) and speed.overhead_s == pytest.approx(0.5)
    assert speed.timings[8] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="step time does not grow with the batch"):
        calibrate(lambda n: None, sizes=(1, 2))
    assert loss_weight(3, 12, 4) == 1.0


# ---------------------------------------------------------------------------------------------
# the gradient equals the uniform-batch gradient of the same global batch
# ---------------------------------------------------------------------------------------------

MICRO_BATCHES = (3, 1, 2, 6)  # sequences per rank: unequal, 12 in all
SEQ = 16


def _config() -> LMConfig:
    moe = MoEConfig(d_model=32, d_ff=64, num_experts=4, top_k=2, capacity_factor=None, aux_loss_coef=0.0)
    return LMConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=SEQ, moe=moe)


def _global_batch():
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (sum(MICRO_BATCHES), SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def gradient_worker(rank, world, ep_size):
    from moetrain.grad_sync import ExpertGradReducer, wrap_data_parallel
    from moetrain.layers import shard_experts
    from moetrain.layers.experts import GroupedExperts
    from moetrain.parallel import ParallelContext

    ctx = ParallelContext(ep_size=ep_size, local_world_size=2)
    torch.manual_seed(11)
    model = MoETransformerLM(_config())
    for block in model.blocks:
        shard_experts(block.ffn, ctx)
    torch.manual_seed(11)
    reference = MoETransformerLM(_config())  # one process, every expert, the whole batch
    inputs, targets = _global_batch()
    F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()

    plan = balance_batch(sum(MICRO_BATCHES), [float(n) for n in MICRO_BATCHES])
    assert plan.micro_batches == MICRO_BATCHES  # speeds proportional to the sizes give them back
    start = sum(plan.micro_batches[:rank])
    mine = slice(start, start + plan.micro_batches[rank])
    ddp = wrap_data_parallel(model, ctx)
    reducer = ExpertGradReducer(model, ctx)
    loss = F.cross_entropy(ddp(inputs[mine]).flatten(0, 1), targets[mine].flatten())
    (loss * plan.loss_weights[rank]).backward()
    reducer.reduce()

    worst = 0.0
    ref_params = dict(reference.named_parameters())
    experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        if id(param) in experts:
            local = ctx.local_experts(_config().moe.num_experts)
            expected = expected[local.start : local.stop]
        worst = max(worst, float((param.grad - expected).abs().max() / expected.abs().max()))
    gathered = gather_speeds(RankSpeed(float(rank + 1), 0.1 * rank, {}))
    return worst, [s.samples_per_s for s in gathered]


@pytest.mark.timeout(120)
def test_weighted_losses_give_the_global_batch_gradient_on_unequal_micro_batches():
    """4 gloo ranks = 2 data-parallel x 2 expert-parallel, micro-batches 3, 1, 2, 6: the DDP-averaged
    dense gradients and the reduced expert gradients equal one process's on all 12 sequences."""
    for worst, speeds in run_distributed(gradient_worker, 4, 2):
        assert worst < 1e-5
        assert speeds == [1.0, 2.0, 3.0, 4.0]


# ---------------------------------------------------------------------------------------------
# planner: mixed clusters
# ---------------------------------------------------------------------------------------------


def test_mixed_v100_p100_cluster_gives_the_fast_gpus_more_and_runs_faster():
    moe = MoEConfig(d_model=1024, d_ff=4096, num_experts=8, top_k=2, capacity_factor=1.25)
    config = LMConfig(vocab_size=21128, d_model=1024, num_layers=24, num_heads=16, max_seq_len=512, moe=moe)
    model = describe_lm(config)
    settings = PlanSettings(seq_len=512, precision="fp16", offload=True)
    mixed = plan_mixed_cluster(model, [("v100-32gb", 2), ("p100-16gb", 2)], settings, global_batch=32 * 16)
    sizes = mixed.micro_batches_by_gpu()
    assert sum(mixed.assignment.micro_batches) == 32 * 16
    assert min(sizes["v100-32gb"]) > max(sizes["p100-16gb"])
    limits = {g.gpu: g.memory_limit for g in mixed.groups}
    assert max(sizes["p100-16gb"]) <= limits["p100-16gb"]
    assert mixed.speedup > 1.2
    assert "speed-up" in mixed.format_table()
    ep = plan_mixed_cluster(
        model, [("v100-32gb", 2), ("p100-16gb", 2)], settings.replace(ep_size=8), global_batch=32 * 16
    )
    # under EP every rank computes an equal share of the expert rows: less to gain than without
    assert 1.0 < ep.speedup < mixed.speedup


def test_failed_calibration_raises_the_same_error_everywhere():
    from moetrain.balance import calibrate_speeds

    def shrinking_step(n):  # larger batches finish sooner: no speed can be fitted
        time.sleep(0.02 / n)

    with pytest.raises(ValueError, match=r"speed calibration failed on ranks \[0\]"):
        calibrate_speeds(shrinking_step, sizes=(1, 4), repeats=1, warmup=0)


@pytest.mark.parametrize("key", ["balance.speeds", "balance.memory_limits"])
def test_a_balance_list_not_one_entry_per_rank_is_refused_before_out_dir_is_made(tmp_path, capsys, key):
    from tests.faults.test_run_directory import one_error, train

    out_dir = tmp_path / "run"
    overrides = {key: [1.0, 2.0]} if key == "balance.speeds" else {key: [4, 4], "balance.speeds": [1.0]}
    assert train(tmp_path, out_dir, steps=1, **overrides) == 2
    assert one_error(capsys).endswith(f"{key} has 2 entries; the run has 1 ranks")
    assert not out_dir.exists()  # no lock, no log file: a config error, found before anything is written
