"""The recompute budget holds where it is applied: the engine's plan on every rank (profiles that
disagree between ranks), layers called with ``sequence_lengths``, M6 batches longer than one probe;
the engine's budget error; measurement without side effects; a second backward's error; the
documented example's log."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
import yaml

from moetrain import MoEConfig, MoELayer
from moetrain.config import TrainConfig, config_from_dict
from moetrain.recompute import (
    ActivationProfile,
    BlockProfile,
    RecomputeOption,
    apply_recompute_plan,
    auto_checkpoint,
    measure_saved_bytes,
    merge_profiles,
    plan_recompute,
    profile_activations,
    recomputed_modules,
)
from moetrain.recompute.recorders import _tensors_in
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT


def tiny_lm(out_dir, **top) -> dict:
    return {
        "model": {
            "name": "moe_lm",
            "d_model": 32,
            "num_layers": 2,
            "num_heads": 2,
            "max_seq_len": 16,
            "moe": {"d_ff": 32, "num_experts": 4, "top_k": 2},
        },
        "data": {"micro_batch_size": 4, "seq_len": 16},
        "steps": 1,
        "out_dir": str(out_dir),
        "threads": 1,
        "device": "cpu",
        **top,
    }


def held_replay_bytes(model, *args, **kwargs) -> int:
    """Bytes the MoE layers' replay records hold after one forward (then dropped with its graph)."""
    output = model(*args, **kwargs)
    total = sum(layer.replay_record_bytes() for layer in model.modules() if isinstance(layer, MoELayer))
    del output
    return total


# --- 1. the engine plans once, on every rank's profile -----------------------------------------

INFLATION = 8 * 2**20  # added to "recompute nothing" of one group per rank: far above the budget
BUDGET_MB = 4.0


def inflated(profile: ActivationProfile, group: int) -> ActivationProfile:
    """``profile`` with ``INFLATION`` bytes more when group ``group`` recomputes nothing."""
    groups = list(profile.groups)
    nothing, *others = groups[group]
    assert nothing.recomputed == ()
    groups[group] = (
        dataclasses.replace(nothing, activation_bytes=nothing.activation_bytes + INFLATION),
        *others,
    )
    return dataclasses.replace(
        profile, baseline_bytes=profile.baseline_bytes + INFLATION, groups=tuple(groups)
    )


def disagreeing_ranks_worker(rank, world, out_dir):
    """Rank r's profile says group r must be recomputed to fit (ranks disagree, as under expert
    parallelism); returns what this rank applied, its plan, and the applied plan's cost on this
    rank's own profile; then the error of a budget below the minimum."""
    import moetrain.recompute as recompute
    from moetrain.engine import Trainer

    measured = recompute.profile_activations
    seen = {}

    def this_ranks_profile(*args, **kwargs):
        seen["profile"] = inflated(measured(*args, **kwargs), rank)
        return seen["profile"]

    recompute.profile_activations = this_ranks_profile
    overrides = {"parallel": {"ep_size": world, "local_world_size": 1}}
    trainer = Trainer(
        config_from_dict(TrainConfig, tiny_lm(f"{out_dir}/fits", recompute_budget_mb=BUDGET_MB, **overrides))
    )
    try:
        applied = sorted(recomputed_modules(trainer.model))
        result = {
            "applied": applied,
            "plan": sorted(trainer.recompute_plan.recomputed),
            "cost": seen["profile"].cost_of(applied)[0],
        }
    finally:
        trainer.close()
    try:
        Trainer(
            config_from_dict(TrainConfig, tiny_lm(f"{out_dir}/low", recompute_budget_mb=0.001, **overrides))
        )
    except ValueError as error:
        result["error"] = str(error)
    return result


@pytest.mark.timeout(200)
def test_every_rank_applies_one_plan_that_fits_its_own_profile(tmp_path):
    results = run_distributed(disagreeing_ranks_worker, 2, str(tmp_path), timeout=180)
    budget = int(BUDGET_MB * 2**20)
    for rank, result in enumerate(results):
        assert result["cost"] <= budget, (rank, result)
        assert result["plan"] == result["applied"], (rank, result)  # trainer.recompute_plan is what runs
    assert results[0]["applied"] == results[1]["applied"]
    assert {"blocks.0", "blocks.1"} <= {
        name.split(".attn")[0].split(".ffn")[0] for name in results[0]["applied"]
    }
    assert results[0]["error"] == results[1]["error"] and "recompute_budget_mb = 0.001" in results[0]["error"]


def test_merged_profile_bounds_every_profile():
    def profile(a, b, outside, kept):
        groups = tuple(
            (RecomputeOption((), nbytes, 0.0), RecomputeOption((name,), kept, 1.0))
            for name, nbytes in (("x", a), ("y", b))
        )
        blocks = {n: BlockProfile(n, None, 1, nbytes, kept, 0, 1.0) for n, nbytes in (("x", a), ("y", b))}
        return ActivationProfile(outside + a + b, outside, blocks, groups)

    profiles = [profile(10, 1, 0, 1), profile(1, 10, 2, 0)]
    merged = merge_profiles(profiles)
    assert (merged.baseline_bytes, merged.outside_bytes) == (13, 2)
    assert [o.activation_bytes for g in merged.groups for o in g] == [10, 1, 10, 1]
    assert merged.blocks["x"] == BlockProfile("x", None, 1, 10, 1, 0, 1.0)
    plan = plan_recompute(merged, 12)  # each profile alone fits 12 bytes recomputing its one large group
    assert sorted(plan.recomputed) == ["x", "y"]
    assert all(p.cost_of(plan.recomputed)[0] <= 12 for p in profiles)
    other = dataclasses.replace(
        profiles[0], blocks={"z": profiles[0].blocks["x"], "y": profiles[0].blocks["y"]}
    )
    with pytest.raises(ValueError, match="same candidates and options"):
        merge_profiles([profiles[0], other])


# --- 2. a MoELayer called as ffn(x, sequence_lengths=...) --------------------------------------

D, SEQUENCES, SEQ, TOP_K = 16, 8, 64, 2


class LengthsBlock(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        moe = MoEConfig(d_model=D, d_ff=32, num_experts=4, top_k=TOP_K, seq_aux_loss_coef=0.01)
        self.ffn = MoELayer(moe, seed=seed)

    def forward(self, x_TD, lengths_B):
        return x_TD + self.ffn(self.norm(x_TD), sequence_lengths=lengths_B)


class LengthsNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([LengthsBlock(i) for i in range(3)])

    def forward(self, x_TD, lengths_B):
        for block in self.blocks:
            x_TD = block(x_TD, lengths_B)
        return x_TD


def test_tensors_in_keeps_argument_order():
    a, b, c, d, e = (torch.zeros(i + 1) for i in range(5))
    assert [t.numel() for t in _tensors_in((a, [b, (c,)]), {"k": {"d": d}, "e": e})] == [1, 2, 3, 4, 5]


def test_replay_of_a_layer_called_with_sequence_lengths_fits_the_budget():
    torch.manual_seed(0)
    net = LengthsNet().train()
    batch = (torch.randn(SEQUENCES * SEQ, D), torch.full((SEQUENCES,), SEQ))
    profile = profile_activations(net, batch, timing_repeats=1)
    assert profile.blocks["blocks.0.ffn"].replay_bytes == SEQUENCES * SEQ * TOP_K * 8  # T*k int64 ids
    plan = auto_checkpoint(net, batch, profile.min_activation_bytes, verbose=False, timing_repeats=1)
    assert measure_saved_bytes(net, batch) + held_replay_bytes(net, *batch) <= plan.memory_budget_bytes


# --- 3. M6: the probe has the largest shape a training batch can take ---------------------------


@pytest.fixture(scope="module")
def m6_trainer(tmp_path_factory):
    from moetrain.engine import Trainer

    config = yaml.safe_load((ROOT / "models/m6_moe/tiny.yaml").read_text())
    config.update(
        out_dir=str(tmp_path_factory.mktemp("m6")), steps=1, threads=1, device="cpu", recompute_budget_mb=2.5
    )
    config["data"]["micro_batch_size"] = 4
    config["model"].update(num_layers=2, d_model=64, d_ff=128)
    config["model"]["moe"]["d_ff"] = 128
    trainer = Trainer(config_from_dict(TrainConfig, config))
    yield trainer
    trainer.close()


def test_m6_probe_is_padded_to_seq_len_with_every_position_real(m6_trainer):
    inputs, labels = m6_trainer.batches.probe(4, seed=5)
    seq_len = m6_trainer.config.data.seq_len
    assert inputs["prefix_ids"].shape == inputs["target_ids"].shape == labels.shape == (4, seq_len)
    assert all(bool(inputs[name].all()) for name in ("prefix_mask", "target_mask", "image_mask"))


def test_m6_training_batches_fit_the_recompute_budget(m6_trainer):
    budget = m6_trainer.recompute_plan.memory_budget_bytes
    model = m6_trainer.model
    for _ in range(12):  # batch 10 of this stream is longer than the old probe and saved 2.5% more
        inputs, _ = m6_trainer.batches.next()
        with m6_trainer._autocast():
            measured = measure_saved_bytes(model, inputs) + held_replay_bytes(model, **inputs)
        assert measured <= budget


# --- 4. a second backward through a graph with replayed MoE layers -------------------------------


def test_second_backward_names_the_retained_graph():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                [MoELayer(MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2), seed=0)]
            )

        def forward(self, x):
            return self.blocks[0](x)

    torch.manual_seed(0)
    net = Net().train()
    apply_recompute_plan(net, ["blocks.0"])
    loss = net(torch.randn(32, 16)).pow(2).mean()
    torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once.*retain_graph=True"):
        loss.backward()


# --- 5. measure_saved_bytes changes nothing ---------------------------------------------------


def test_measure_saved_bytes_leaves_buffers_and_rng_alone():
    moe = MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2, score_bias_rate=0.01, router_jitter=0.1)
    layer = MoELayer(moe, seed=0).train()
    x = torch.randn(32, 16)
    rng, load = torch.get_rng_state(), layer.router.load_E.clone()
    assert measure_saved_bytes(layer, x) > 0
    assert torch.equal(layer.router.load_E, load) and torch.equal(torch.get_rng_state(), rng)


# --- 6. the engine's error names recompute_budget_mb ----------------------------------------------


def test_engine_budget_error_names_the_config_key_and_a_value_that_fits(tmp_path):
    from moetrain.engine import Trainer

    with pytest.raises(ValueError) as caught:
        Trainer(config_from_dict(TrainConfig, tiny_lm(tmp_path / "low", recompute_budget_mb=0.01)))
    message = str(caught.value)
    assert "\n" not in message and "memory_budget_bytes" not in message
    assert (
        message.startswith("recompute_budget_mb = 0.01 is below")
        and "or to 0 for the least memory" in message
    )
    least = float(re.search(r"at least ([0-9.]+)", message).group(1))
    trainer = Trainer(config_from_dict(TrainConfig, tiny_lm(tmp_path / "least", recompute_budget_mb=least)))
    try:
        assert trainer.recompute_plan.activation_bytes <= int(least * 2**20)
    finally:
        trainer.close()


# --- 7. the documented example shows the plan ------------------------------------------------------


def test_documented_example_logs_the_plan():
    page = (ROOT / "docs" / "recompute.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "auto_checkpoint: budget 16.00 MiB" in ran.stdout + ran.stderr
