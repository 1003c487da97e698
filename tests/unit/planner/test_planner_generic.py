"""The planner finds models only through the registry: presets from ``preset_names()``, a model's
``describe`` hook, and any other registered model measured on ``meta`` (moetrain.planner.generic)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from moe_lm import describe_lm
from moetrain import MoEConfig, MoELayer
from moetrain.cli import build_train_config, main
from moetrain.planner.activations import Workload, activation_model
from moetrain.planner.generic import describe_generic
from moetrain.planner.model import resolve_model
from moetrain.recompute import measure_saved_bytes
from moetrain.registry import _REGISTRY, DataShard, register_model, spec_for_config
from tests.helpers.paths import ROOT

OWN_MODEL = ROOT / "scripts" / "examples" / "own_model" / "config.yaml"


def plan_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_plan_command_plans_a_users_own_model_from_its_training_config():
    plan = plan_json("--model", str(OWN_MODEL), "--cluster", "a100-80gb", "--nodes", "1", "--ep-size", "2")
    train = build_train_config(str(OWN_MODEL), [])
    model = spec_for_config(train.model).builder(train, DataShard())[0]
    assert plan["params"]["total"] == sum(p.numel() for p in model.parameters())
    assert plan["params"]["experts_per_rank_per_layer"] == train.model.moe.num_experts // 2
    assert plan["recompute"]["activation_bytes"] > 0 and plan["gpu_memory"]["step_peak"] > 0
    all_to_all = next(entry for entry in plan["traffic"] if entry["name"] == "all_to_all")
    assert all_to_all["calls"] == 4  # one MoE layer: dispatch + combine, forward + backward
    cfg = train.model
    rows_to_the_other_rank = train.data.micro_batch_size * cfg.seq_len * cfg.moe.top_k // 2  # balanced
    assert all_to_all["intra_bytes"] == 4 * rows_to_the_other_rank * cfg.d_model * 4
    assert plan["fits"]


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_measured_description_predicts_the_saved_activations_of_the_users_model(capacity_factor):
    train = build_train_config(str(OWN_MODEL), [])
    train = replace(
        train, model=replace(train.model, moe=replace(train.model.moe, capacity_factor=capacity_factor))
    )
    spec = spec_for_config(train.model)
    description = describe_generic(train, spec, "own")
    batch = train.data.micro_batch_size
    work = Workload(batch=batch, seq_len=description.arch.max_seq_len, itemsize=4, kernels="cpu",
                    capacity_factor=capacity_factor, row_bound="balanced")  # fmt: skip
    predicted = activation_model(description.arch, work).baseline_bytes
    torch.manual_seed(0)
    model, batches, loss_fn = spec.builder(train, DataShard())
    inputs, targets = batches.probe(batch, 0)
    measured = measure_saved_bytes(model, inputs)  # without the loss's few saved bytes
    assert measured <= predicted <= 1.10 * measured  # capacity: routing here is not perfectly balanced


def test_measured_description_of_the_lm_agrees_with_its_formulas():
    train = build_train_config(str(ROOT / "configs" / "tiny_lm.yaml"), [])
    generic = describe_generic(train, spec_for_config(train.model), "lm")
    formulas = describe_lm(train.model)
    assert generic.params == formulas.params
    assert generic.arch.max_seq_len == train.data.seq_len
    # what meta runs is what the CPU kernels save (the CUDA attention kernels save less)
    work = Workload(batch=train.data.micro_batch_size, seq_len=train.data.seq_len, itemsize=4, kernels="cpu")
    measured = activation_model(generic.arch, work)
    modelled = activation_model(formulas.arch, work)
    # meta has no fused attention kernel: scaled_dot_product_attention takes its math path there and
    # saves the probabilities [B, H, S, S] of every layer, which the CPU's flash kernel does not
    lm = train.model
    probabilities = lm.num_layers * work.batch * lm.num_heads * work.seq_len**2 * 4
    assert measured.baseline_bytes == pytest.approx(modelled.baseline_bytes + probabilities, rel=0.03)
    assert measured.forward_flops == pytest.approx(modelled.forward_flops, rel=0.05)


@dataclass(frozen=True)
class TwoTowerConfig:
    d_model: int = 16

    @staticmethod
    def preset_names():
        return ("small",)

    @classmethod
    def preset(cls, name):
        return cls(d_model={"small": 8}[name])


class TwoTower(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(5, config.d_model)
        self.ffn = MoELayer(MoEConfig(d_model=config.d_model, d_ff=32, num_experts=4, top_k=1))

    def forward(self, ids):
        return self.ffn(self.embed(ids)).sum(-1)


class TwoTowerBatches:
    def probe(self, sequences, seed):
        ids = torch.randint(0, 5, (sequences, 3), generator=torch.Generator().manual_seed(seed))
        return ids, ids.float()


@pytest.fixture
def two_tower():
    def build(train_config, shard):
        return (
            TwoTower(train_config.model),
            TwoTowerBatches(),
            lambda out, target: ((out - target) ** 2).mean(),
        )

    register_model("two_tower", TwoTowerConfig, build)
    yield
    del _REGISTRY["two_tower"]


def test_presets_come_from_the_registry(two_tower):
    for spelling in ("two-small", "two_tower-small", "TWO:small"):
        model, defaults = resolve_model(spelling)
        assert model.name == "two-small" and defaults == {}
        assert model.arch.generic and model.arch.d_model == 8
        assert model.arch.max_seq_len == 3 and model.arch.measured.moe_modules == ("ffn",)
    m6 = resolve_model("m6-1T")[0].arch  # the M6 package's describe hook: its facts, not measured
    assert not m6.generic and m6.targets_only and m6.attention_mask and m6.outside is not None
    with pytest.raises(ValueError, match=r"model must be a model preset \(.*m6-1T.*two-small.*\) or an"):
        resolve_model("two-large")


def test_a_model_without_moe_layers_is_one_line(two_tower):
    def build(train_config, shard):
        return nn.Embedding(5, 4), TwoTowerBatches(), lambda out, target: out.mean()

    register_model("two_tower", TwoTowerConfig, build)
    with pytest.raises(ValueError, match="^the model Embedding has no MoELayer: there is nothing to plan$"):
        resolve_model("two-small")
