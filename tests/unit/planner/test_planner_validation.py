"""The planner's predictions against measurement of real runs (CPU, gloo, world 1, 2 and 4).

Per rank: parameter and gradient bytes (summed tensor bytes), optimizer-state bytes (tensors in
the optimizer's state), activation bytes (``measure_saved_bytes`` on a model wrapped with its loss,
plus the MoE dispatch index tensors and routing replay records captured from the dispatcher) and
all-to-all bytes (``dist.all_to_all_single`` wrapped, bytes to every other rank classified intra-
or inter-node). Routing is deterministic where counts must be: dropless without expert
parallelism (N = T*k), or capacity-bound (every expert on every rank over-subscribed, so each rank
sends exactly C rows to each expert; the workers assert it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from m6_moe.planning import describe_m6
from moe_lm import LMConfig, MoETransformerLM, describe_lm
from moetrain.config import MoEConfig
from moetrain.layers import MoELayer
from moetrain.planner import ClusterSpec, PlanSettings, make_plan
from moetrain.planner.hardware import GPU_PRESETS
from moetrain.recompute import apply_recompute_plan, measure_saved_bytes, remove_recompute
from tests.helpers.collectives import counting_all_to_all
from tests.helpers.dist_utils import run_distributed
from tests.helpers.planner_peak_cases import CASES, ExchangeBuffers, fixed_routing, plan_for, run_case

TOLERANCE = 0.10  # the brief: predictions within 10% of measurement


def lm_config(capacity_factor, d_model=32, experts=8, activation="gelu") -> LMConfig:
    moe = MoEConfig(
        d_model=d_model,
        d_ff=2 * d_model,
        num_experts=experts,
        top_k=2,
        capacity_factor=capacity_factor,
        activation=activation,
    )
    return LMConfig(vocab_size=64, d_model=d_model, num_layers=2, num_heads=2, max_seq_len=32, moe=moe)


class WithLoss(nn.Module):
    """The model and its loss in one forward, so that the loss's saved tensors are measured too."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        *model_inputs, targets = inputs
        logits = self.model(*model_inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class DispatchRecorder:
    """Captures every MoELayer's DispatchRecord (the dispatch index tensors and replay records
    live outside autograd's saved tensors)."""

    def __init__(self, model: nn.Module):
        self.records: list[tuple[MoELayer, object]] = []
        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        for layer in self.layers:
            original = layer.dispatcher.dispatch

            def dispatch(*args, _layer=layer, _original=original, **kwargs):
                out = _original(*args, **kwargs)
                if all(record is not out[2] for _, record in self.records):
                    self.records.append((_layer, out[2]))
                return out

            layer.dispatcher.dispatch = dispatch

    def remove(self) -> None:
        for layer in self.layers:
            del layer.dispatcher.dispatch

    def index_bytes(self) -> int:
        total = 0
        for _, record in self.records:
            plan = record.plan
            tensors = [
                plan.row_of_slot_TK,
                plan.slot_of_row_N,
                plan.kept_per_expert_E,
                plan.routed_per_expert_E,
            ]
            if record.recv_counts_PE is not None:
                tensors.append(record.recv_counts_PE)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def replay_bytes(self) -> int:
        return sum(record.nbytes() for layer, record in self.records if layer.recompute_replay)


def measure_activations(model: nn.Module, inputs: tuple) -> tuple[int, list]:
    """Saved bytes of one forward with its loss + dispatch index + replay records; also the records."""
    recorder = DispatchRecorder(model)
    try:
        saved = measure_saved_bytes(WithLoss(model), inputs)
    finally:
        recorder.remove()
    return saved + recorder.index_bytes() + recorder.replay_bytes(), [r for _, r in recorder.records]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer) -> int:
    return sum(
        tensor_bytes([v for v in state.values() if isinstance(v, torch.Tensor)])
        for state in optimizer.state.values()
    )


def close(predicted: float, measured: float, tolerance: float = TOLERANCE) -> bool:
    return abs(predicted - measured) <= tolerance * measured


def cluster_for(world: int, local: int, gpu: str = "a100-80gb") -> ClusterSpec:
    return ClusterSpec(gpu=GPU_PRESETS[gpu], nodes=world // local, gpus_per_node=local)


# ---------------------------------------------------------------------------------------------
# world 1
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recompute", "fraction"),
    [("none", None), ("full", None), ("fraction", 0.5)],
    ids=["none", "full", "half"],
)
def test_world1_lm_fp32_dropless_matches_measurement(recompute, fraction):
    config = lm_config(capacity_factor=None, activation="swiglu" if recompute == "full" else "gelu")
    model = MoETransformerLM(config).train()
    batch, seq = 4, 32
    settings = PlanSettings(
        micro_batch=batch, seq_len=seq, precision="fp32", recompute=recompute, recompute_fraction=fraction
    )
    plan = make_plan(describe_lm(config), cluster_for(1, 1), settings, kernels="cpu")
    apply_recompute_plan(model, list(plan.recompute.recomputed))
    tokens = torch.randint(0, 64, (batch, seq))
    targets = torch.randint(0, 64, (batch, seq))
    activations, _ = measure_activations(model, (tokens, targets))
    assert close(plan.recompute.activation_bytes, activations), (plan.recompute.activation_bytes, activations)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    WithLoss(model)(tokens, targets).backward()
    optimizer.step()
    assert plan.gpu_memory["weights"] == tensor_bytes(model.parameters())
    assert plan.gradient_bytes == tensor_bytes(p.grad for p in model.parameters())
    assert close(plan.gpu_memory["optimizer_states"], optimizer_state_bytes(optimizer), 0.01)
    remove_recompute(model)


def test_world1_lm_bf16_capacity_bound_with_offload_matches_measurement():
    from moetrain.offload import OffloadOptimizer

    config = lm_config(capacity_factor=0.1)
    torch.manual_seed(1)
    model = MoETransformerLM(config).to(torch.bfloat16).train()
    fixed_routing(model)
    batch, seq = 4, 32
    settings = PlanSettings(micro_batch=batch, seq_len=seq, precision="bf16", offload=True, recompute="none")
    plan = make_plan(describe_lm(config), cluster_for(1, 1), settings, kernels="cpu")
    tokens, targets = torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
    activations, records = measure_activations(model, (tokens, targets))
    capacity = plan.activations.layers[0].rows.capacity
    assert all(int(r.plan.kept_per_expert_E.min()) == capacity for r in records), (
        "routing did not fill every expert"
    )
    assert close(plan.recompute.activation_bytes, activations), (plan.recompute.activation_bytes, activations)

    optimizer = OffloadOptimizer(model.parameters(), lr=1e-3)
    WithLoss(model)(tokens, targets).backward()
    optimizer.step()
    assert plan.gpu_memory["weights"] == tensor_bytes(model.parameters())
    assert plan.gpu_memory["optimizer_states"] == 0
    per_gpu_host = plan.host_memory["offloaded_states"] // plan.cluster.gpus_per_node
    assert close(per_gpu_host, optimizer_state_bytes(optimizer), 0.01)


def test_world1_lm_autocast_estimate_matches_measurement():
    """fp32 weights under bf16 autocast: the low-precision activation formulas plus a 2-byte copy of
    every weight (what autocast keeps for the backward). CPU autocast's policy; CUDA's differs."""
    config = lm_config(capacity_factor=None, d_model=64)
    model = MoETransformerLM(config).train()
    batch, seq = 4, 32
    settings = PlanSettings(micro_batch=batch, seq_len=seq, precision="bf16", autocast=True, recompute="none")
    plan = make_plan(describe_lm(config), cluster_for(1, 1), settings, kernels="cpu")
    tokens, targets = torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured, _ = measure_activations(model, (tokens, targets))
    predicted = plan.recompute.activation_bytes + 2 * plan.params["per_rank"]
    assert close(predicted, measured), (predicted, measured)
    assert plan.gpu_memory["weights"] == tensor_bytes(model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_world1_m6_tiny_matches_measurement(precision):
    from m6_moe.config import M6Config
    from m6_moe.model import M6Model

    tiny = M6Config.preset("tiny")
    # dropout 0: CPU attention with dropout takes the math path; dropless: N = T*k rows exactly
    config = M6Config.preset("tiny", dropout=0.0, moe_every=2, moe=replace(tiny.moe, capacity_factor=None))
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(2)
    model = M6Model(config).to(dtype).train()
    batch, prefix, target = 3, 8, 24
    settings = PlanSettings(
        micro_batch=batch,
        seq_len=prefix + target,
        target_len=target,
        precision=precision,
        recompute="fraction",
        recompute_fraction=0.5,
    )
    plan = make_plan(describe_m6(config), cluster_for(1, 1), settings, kernels="cpu")
    apply_recompute_plan(model, list(plan.recompute.recomputed))
    inputs = (
        torch.randint(0, config.vocab_size, (batch, prefix)),
        torch.randint(0, config.vocab_size, (batch, target)),
        torch.randn(batch, 3, config.image_size, config.image_size, dtype=dtype),
        torch.randint(0, config.vocab_size, (batch, target)),
    )
    measured, records = measure_activations(model, inputs)
    assert records and all(r.plan.num_rows <= r.plan.row_of_slot_TK.numel() for r in records)
    assert close(plan.recompute.activation_bytes, measured), (plan.recompute.activation_bytes, measured)
    assert plan.gpu_memory["weights"] == tensor_bytes(model.parameters())


# ---------------------------------------------------------------------------------------------
# world 2 and 4: expert parallelism
# ---------------------------------------------------------------------------------------------


def _count_all_to_all(local_world: int, log: dict):
    """Counts every ``all_to_all_single`` into ``log``; returns the original function."""
    import torch.distributed as dist

    original = dist.all_to_all_single
    dist.all_to_all_single = counting_all_to_all(log, local_world)
    return original


def all_pairs_routing(model: nn.Module) -> None:
    """Known routing for top-2: token t takes the (t mod C(E, 2))-th pair of experts in
    lexicographic order, so every C(E, 2) tokens route every pair once: each expert gets the same
    slots, and the nodes a token reaches average exactly what the planner assumes for uniform
    routing (:func:`moetrain.planner.node_limit.nodes_reached_per_token`)."""
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            router, experts = layer.router, layer.config.num_experts
            pairs = torch.combinations(torch.arange(experts), 2)
            original = router.forward

            def forward(x_TD, expert_ids_TK=None, _original=original, _pairs=pairs):
                if expert_ids_TK is None:
                    tokens = torch.arange(x_TD.shape[0], device=x_TD.device)
                    expert_ids_TK = _pairs.to(x_TD.device)[tokens % _pairs.shape[0]]
                return _original(x_TD, expert_ids_TK)

            router.forward = forward


def ep_worker(rank, world, local_world, precision, recompute, capacity_factor, algorithm="auto", seq=32):
    import torch.distributed as dist

    from moetrain.grad_sync import ExpertGradReducer, wrap_data_parallel
    from moetrain.layers import shard_experts
    from moetrain.offload import OffloadOptimizer
    from moetrain.parallel import ParallelContext

    ctx = ParallelContext(ep_size=world, all_to_all=algorithm, local_world_size=local_world)
    config = lm_config(capacity_factor=capacity_factor)
    torch.manual_seed(3)  # dense weights equal on every rank
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = MoETransformerLM(config)
    for block in model.blocks:
        shard_experts(block.ffn, ctx)
    model = model.to(dtype).train()
    (all_pairs_routing if algorithm == "node_dedup" else fixed_routing)(model)
    batch = 4
    settings = PlanSettings(
        ep_size=world, micro_batch=batch, seq_len=seq, precision=precision, offload=precision != "fp32",
        recompute=recompute, all_to_all=algorithm,
    )  # fmt: skip
    plan = make_plan(describe_lm(config), cluster_for(world, local_world), settings, kernels="cpu")
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 64, (batch, seq), generator=generator)
    targets = torch.randint(0, 64, (batch, seq), generator=generator)

    apply_recompute_plan(model, list(plan.recompute.recomputed))
    exchanges = ExchangeBuffers().__enter__()  # every row exchange's buffers, forward and backward
    activations, records = measure_activations(model, (tokens, targets))
    rows = plan.activations.layers[0].rows
    saturated = all(r.plan.num_rows == rows.sent for r in records)  # as many rows as the plan assumed

    ddp = wrap_data_parallel(model, ctx)
    reducer = ExpertGradReducer(model, ctx)
    if precision == "fp32":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = OffloadOptimizer(model.parameters(), lr=1e-3)
    log = {"intra": 0, "inter": 0, "calls": 0}
    original = _count_all_to_all(local_world, log)
    try:
        WithLoss(ddp)(tokens, targets).backward()
    finally:
        dist.all_to_all_single = original
        exchanges.__exit__()
    reducer.reduce()
    optimizer.step()
    a2a = [t for t in plan.traffic if t.name.startswith("all_to_all")]
    return {
        "algorithm": (ctx.all_to_all, plan.all_to_all),
        "saturated": saturated,
        "activations": (plan.recompute.activation_bytes, activations),
        "weights": (plan.gpu_memory["weights"], tensor_bytes(model.parameters())),
        "gradients": (plan.gradient_bytes, tensor_bytes(p.grad for p in model.parameters())),
        "optimizer": (
            plan.gpu_memory["optimizer_states"] or plan.host_memory["offloaded_states"] // local_world,
            optimizer_state_bytes(optimizer),
        ),
        "intra": (sum(t.intra_bytes for t in a2a), log["intra"]),
        "inter": (sum(t.inter_bytes for t in a2a), log["inter"]),
        "calls": (sum(t.calls for t in a2a), log["calls"]),
        "exchange_buffers": (plan.gpu_memory["all_to_all_buffers"], exchanges.peak),
    }


def _check_ep(results) -> None:
    for rank, r in enumerate(results):
        assert r["saturated"], f"rank {rank}: the rows dispatched differ from the plan's"
        assert r["algorithm"][0] == r["algorithm"][1], r["algorithm"]
        assert r["weights"][0] == r["weights"][1], (rank, r["weights"])
        assert r["gradients"][0] == r["gradients"][1], (rank, r["gradients"])
        assert close(*r["optimizer"], 0.01), (rank, r["optimizer"])
        assert close(*r["activations"]), (rank, r["activations"])
        assert r["intra"][0] == r["intra"][1], (rank, "intra-node all-to-all bytes", r["intra"])
        assert r["inter"][0] == r["inter"][1], (rank, "inter-node all-to-all bytes", r["inter"])
        assert r["calls"][0] == r["calls"][1], (rank, "all_to_all_single calls", r["calls"])
        planned, measured = r["exchange_buffers"]
        if r["algorithm"][0] == "node_dedup":
            # its four exchanges' buffers are alive together in the plan (an estimate of the layer's
            # transient bytes); measured is the largest single exchange: the plan bounds it
            assert measured <= planned, (rank, "node_dedup exchange buffers", r["exchange_buffers"])
        else:
            # the rows exactly; the 2-D algorithm also makes a transposed copy of its chunk sizes (32 B)
            assert close(planned, measured, 0.01), (rank, "one exchange's buffers", r["exchange_buffers"])


@pytest.mark.timeout(120)
def test_world2_flat_across_two_nodes_fp32():
    results = run_distributed(ep_worker, 2, 1, "fp32", "none", None)  # dropless, known routing
    _check_ep(results)
    assert results[0]["inter"][1] > 0 and results[0]["intra"][1] == 0  # one rank per node: all inter-node


@pytest.mark.timeout(120)
def test_world4_hierarchical_two_nodes_bf16_offload_with_recompute():
    results = run_distributed(ep_worker, 4, 2, "bf16", "full", 0.1)  # capacity-bound
    _check_ep(results)
    assert results[0]["algorithm"][0] == "hierarchical"
    assert results[0]["intra"][1] > 0 and results[0]["inter"][1] > 0


@pytest.mark.parametrize("recompute", ["full", pytest.param("none", marks=pytest.mark.slow)])
@pytest.mark.timeout(120)
def test_world4_node_dedup_two_nodes_bf16_bytes_and_calls_equal_the_model(recompute):
    """node_dedup's exchanges (rows + ids, gates, partial rows; counts inside and across nodes) move
    exactly the bytes :func:`moetrain.planner.comm.node_dedup_traffic` predicts, with routing that
    reaches the nodes uniform routing would on average (every pair of the 8 experts once per 28
    tokens: 44/28 nodes per token, 22/28 other than the token's); recomputed layers replay their
    four exchanges (no call more) and their records are the activation model's."""
    results = run_distributed(ep_worker, 4, 2, "bf16", recompute, None, "node_dedup", 28)
    _check_ep(results)
    assert results[0]["algorithm"][0] == "node_dedup"
    assert results[0]["intra"][1] > 0 and results[0]["inter"][1] > 0


# ---------------------------------------------------------------------------------------------
# the step peak (docs/planner.md's table: python -m tests.helpers.planner_peak_cases)
# ---------------------------------------------------------------------------------------------


FAST_CASES = {  # the others take over 5 s on 2 busy cores (CPU fp16 matmuls are slow; EP spawns ranks)
    "d256-L4-b8-full-fp32",
    "d256-L4-b8-none-fp32",
    "d256-L4-b8-full-bf16",
    "m6-tiny-b3-half-fp32",
    "m6-tiny-b3-full-bf16",
}


@pytest.mark.parametrize(
    "case",
    [case if case.name in FAST_CASES else pytest.param(case, marks=pytest.mark.slow) for case in CASES],
    ids=lambda case: case.name,
)
@pytest.mark.timeout(240)
def test_step_peak_matches_the_measured_peak(case):
    """Forward, loss and backward: the peak of the storages they allocate (activations, rebuilt
    segments, replay records, all-to-all buffers, gradients, working memory) against the plan's
    backward peak plus ``all_to_all_buffers``; under expert parallelism each exchange's buffers
    exactly. The optimizer step (torch AdamW, foreach) allocates one state's bytes on top."""
    result = run_case(case)
    assert close(result.predicted, result.measured), (result.predicted / 2**20, result.measured / 2**20)
    assert close(result.optimizer_predicted, result.optimizer_measured, 0.01), result
    assert close(result.exchange_predicted, result.exchange_measured, 0.01), result
    if case.ep_size > 1:
        assert result.exchange_measured > 0


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.recompute == "half" and c.layout == "fp32" and c.model == "lm"],
    ids=lambda case: case.name,
)
def test_the_partial_recompute_cases_discriminate(case):
    """The fp32 half-recompute cases peak in a kept layer, above full recompute's peak by more than
    the tolerance (a case whose peak equalled full recompute's would not test what is kept)."""
    half, full = plan_for(case), plan_for(case, "full")
    assert half.gpu_memory["step_peak"] > (1 + TOLERANCE) * full.gpu_memory["step_peak"], (
        half.step_memory,
        full.step_memory,
    )
    assert half.step_memory.where != "backward of layer 0"


@pytest.mark.parametrize(
    ("flags", "asked"),
    [
        (["--pp-virtual", "3"], "pp_virtual = 3"),
        (["--pp-schedule", "interleaved_1f1b"], "pp_schedule = 'interleaved_1f1b'"),
        (
            ["--pp-schedule", "interleaved_1f1b", "--pp-virtual", "2"],
            "pp_schedule = 'interleaved_1f1b' and pp_virtual = 2",
        ),
    ],
    ids=["virtual", "interleaved", "both"],
)
def test_pipeline_options_without_pipeline_stages_are_refused_naming_pp_size(capsys, flags, asked):
    """Without --pp-size > 1 the plan has no pipeline: these options had been accepted and ignored."""
    from moetrain.cli import main

    words = ["plan", "--model", "m6-tiny", "--cluster", "a100-80gb", "--nodes", "1", *flags]
    assert main(words) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"moetrain: error: {asked}: only used with pipeline stages, pp_size (--pp-size) > 1 (got 1); without "
        "them leave pp_virtual = 1 and pp_schedule '1f1b' or 'gpipe'\n"
    )
    PlanSettings(pp_schedule="gpipe")  # a schedule that needs nothing more is left alone
    PlanSettings(pp_size=2, pp_schedule="interleaved_1f1b", pp_virtual=2, grad_accum=4)
