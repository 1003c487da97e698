"""The step-peak cases of docs/planner.md: the planner's predicted peak of one training micro-step
against the peak measured on the CPU, for language models at three sizes with full, half and no
recompute, in fp32, bf16 weights and bf16 / fp16 autocast (fp32 weights), the M6 tiny preset with
recompute, and a language model on 2 expert-parallel ranks (gloo) with every layer recomputed.

Measured: :class:`moetrain.planner.measure.PeakStorageBytes` around a whole training step as the
engine runs it: forward, loss, backward, gradient clipping and a torch AdamW (``foreach``) step
(everything the step allocates: activations, rebuilt segments, MoE replay records, all-to-all
buffers, gradients, working memory, the optimizer's temporaries; not the weights and optimizer
states, which exist before: a first step creates the states).
Predicted: the plan's ``step_peak`` plus its ``all_to_all_buffers`` (0 at world 1), CPU saving
rules, grad_accum 1, the recompute the plan chose applied to the model. Under expert parallelism
the routing is fixed (token t picks experts ``(t*k + j) mod E``), so the rows are the plan's, and
each row exchange's buffers (its input rows and what it allocates until it returns) are measured
too.

``python -m tests.helpers.planner_peak_cases`` prints the table in docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from moe_lm import LMConfig, MoETransformerLM, describe_lm
from moetrain.config import MoEConfig
from moetrain.grad_sync import clip_grad_norm_
from moetrain.layers import MoELayer, shard_experts
from moetrain.planner import ClusterSpec, PlanSettings, make_plan
from moetrain.planner.hardware import GPU_PRESETS
from moetrain.planner.measure import PeakStorageBytes
from moetrain.recompute import apply_recompute_plan

VOCAB = 256
LAYOUTS = ("fp32", "bf16", "bf16-autocast", "fp16-autocast")


@dataclass(frozen=True)
class PeakCase:
    d_model: int
    layers: int
    batch: int
    seq: int
    recompute: str  # "full", "half" or "none"
    layout: str  # "fp32", "bf16" (weights stored in bf16) or "bf16-autocast" / "fp16-autocast" (fp32 weights)
    model: str = "lm"  # "lm" (MoETransformerLM, d_model etc. as given) or "m6-tiny" (the preset)
    ep_size: int = 1  # > 1: that many gloo ranks, experts split among them

    @property
    def name(self) -> str:
        size = "m6-tiny" if self.model == "m6-tiny" else f"d{self.d_model}-L{self.layers}"
        ep = f"-ep{self.ep_size}" if self.ep_size > 1 else ""
        return f"{size}-b{self.batch}-{self.recompute}-{self.layout}{ep}"

    @property
    def precision(self) -> str:
        return self.layout.split("-")[0]

    @property
    def autocast(self) -> bool:
        return self.layout.endswith("-autocast")

    def settings(self, recompute: str | None = None) -> PlanSettings:
        recompute = recompute or self.recompute
        return PlanSettings(
            ep_size=self.ep_size,
            micro_batch=self.batch,
            seq_len=self.seq,
            target_len=self.seq - M6_PREFIX if self.model == "m6-tiny" else None,
            precision=self.precision,
            autocast=self.autocast,
            recompute="fraction" if recompute == "half" else recompute,
            recompute_fraction=0.5 if recompute == "half" else None,
        )


M6_PREFIX = 8  # text tokens of the m6 cases' prefix; the rest of ``seq`` are targets

CASES = (
    PeakCase(512, 6, 4, 128, "full", "fp32"),  # the full-recompute 6-layer d512 model
    PeakCase(512, 6, 4, 128, "half", "bf16-autocast"),
    PeakCase(256, 4, 8, 128, "full", "fp32"),
    PeakCase(256, 4, 16, 128, "half", "fp32"),  # peaks in a kept layer: above full recompute's peak
    PeakCase(256, 4, 8, 128, "none", "fp32"),
    PeakCase(256, 4, 8, 128, "full", "bf16"),
    PeakCase(256, 4, 8, 128, "full", "bf16-autocast"),
    PeakCase(256, 4, 8, 128, "full", "fp16-autocast"),
    PeakCase(256, 4, 8, 128, "half", "fp16-autocast"),
    PeakCase(128, 4, 16, 128, "full", "fp32"),
    PeakCase(128, 4, 16, 128, "half", "fp32"),  # likewise
    PeakCase(128, 4, 16, 128, "half", "bf16-autocast"),
    PeakCase(128, 4, 16, 128, "full", "fp16-autocast"),
    PeakCase(128, 4, 16, 128, "half", "fp16-autocast"),
    PeakCase(0, 0, 3, 32, "half", "fp32", model="m6-tiny"),
    PeakCase(0, 0, 3, 32, "full", "bf16", model="m6-tiny"),
    PeakCase(128, 4, 4, 128, "full", "fp32", ep_size=2),  # replay records, all-to-all buffers
)


@dataclass(frozen=True)
class PeakResult:
    """Bytes: ``predicted`` (the backward's peak + all-to-all buffers) and ``measured`` peaks of
    forward, loss and backward, where the plan puts the step's peak (``"optimizer step"`` where the
    optimizer's phase is above the backward's); under expert parallelism also one row exchange's
    buffers, predicted and measured (the most any exchange of the step held), else 0; the optimizer
    step's temporary, predicted (one state: the parameters at the weights' bytes) and measured
    (what ``optimizer.step()`` allocated on top of what was live)."""

    predicted: int
    measured: int
    where: str
    exchange_predicted: int = 0
    exchange_measured: int = 0
    optimizer_predicted: int = 0
    optimizer_measured: int = 0


def fixed_routing(model: nn.Module) -> None:
    """Known routing: token t chooses experts ``(t*k + j) % E`` (scores and gates still computed
    by the router), so every expert gets exactly ``T*k/E`` slots on every rank."""
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            router, experts, k = layer.router, layer.config.num_experts, layer.config.top_k
            original = router.forward

            def forward(x_TD, expert_ids_TK=None, _original=original, _experts=experts, _k=k):
                if expert_ids_TK is None:
                    slots = torch.arange(x_TD.shape[0] * _k, device=x_TD.device)
                    expert_ids_TK = (slots % _experts).view(-1, _k)
                return _original(x_TD, expert_ids_TK)

            router.forward = forward


class ExchangeBuffers:
    """While active, every row exchange of the all-to-all plans (flat and hierarchical, both
    directions) is measured: its input rows plus the peak of what it allocates until it returns
    (receive buffers, the 2-D algorithm's chunk transposes and stage buffers); ``peak``: the
    largest, in bytes."""

    def __init__(self):
        from moetrain.comm.all_to_all import FlatAllToAllPlan, HierarchicalAllToAllPlan

        self.peak = 0
        self._originals = {
            (cls, name): getattr(cls, name)
            for cls in (FlatAllToAllPlan, HierarchicalAllToAllPlan)
            for name in ("exchange", "reverse")
        }

    def __enter__(self) -> ExchangeBuffers:
        for (cls, name), original in self._originals.items():

            def measured(plan, x, _original=original):
                with PeakStorageBytes() as inside:
                    out = _original(plan, x)
                self.peak = max(self.peak, x.untyped_storage().nbytes() + inside.peak)
                return out

            setattr(cls, name, measured)
        return self

    def __exit__(self, *exc) -> None:
        for (cls, name), original in self._originals.items():
            setattr(cls, name, original)


def lm_config(case: PeakCase) -> LMConfig:
    moe = MoEConfig(d_model=case.d_model, d_ff=2 * case.d_model, num_experts=8, top_k=2, capacity_factor=None)
    d, layers, seq = case.d_model, case.layers, case.seq
    return LMConfig(vocab_size=VOCAB, d_model=d, num_layers=layers, num_heads=8, max_seq_len=seq, moe=moe)


def m6_config():
    """M6's tiny preset; dropout 0 (CPU attention with dropout takes the math path) and dropless
    routing (N = T*k rows exactly)."""
    from m6_moe.config import M6Config

    tiny = M6Config.preset("tiny")
    return M6Config.preset("tiny", dropout=0.0, moe_every=2, moe=replace(tiny.moe, capacity_factor=None))


def plan_for(case: PeakCase, recompute: str | None = None):
    """The plan of ``case`` (``recompute``: another recompute mode for the same case)."""
    if case.model == "m6-tiny":
        from m6_moe.planning import describe_m6

        description = describe_m6(m6_config())
    else:
        description = describe_lm(lm_config(case))
    cluster = ClusterSpec(gpu=GPU_PRESETS["a100-80gb"], nodes=1, gpus_per_node=case.ep_size)
    return make_plan(description, cluster, case.settings(recompute), kernels="cpu")


def build(case: PeakCase, parallel=None) -> tuple[nn.Module, tuple, torch.Tensor]:
    """(model, inputs, targets) of ``case`` on this rank (``parallel``: its ParallelContext under
    expert parallelism)."""
    generator = torch.Generator().manual_seed(1 + (parallel.rank if parallel is not None else 0))
    torch.manual_seed(0)  # dense weights equal on every rank
    if case.model == "m6-tiny":
        from m6_moe.model import M6Model

        config = m6_config()
        model, target = M6Model(config), case.seq - M6_PREFIX
        dtype = torch.bfloat16 if case.layout == "bf16" else torch.float32
        inputs = (
            torch.randint(0, config.vocab_size, (case.batch, M6_PREFIX), generator=generator),
            torch.randint(0, config.vocab_size, (case.batch, target), generator=generator),
            torch.randn(case.batch, 3, config.image_size, config.image_size, generator=generator).to(dtype),
        )
        targets = torch.randint(0, config.vocab_size, (case.batch, target), generator=generator)
    else:
        model = MoETransformerLM(lm_config(case))
        if parallel is not None:
            for block in model.blocks:
                shard_experts(block.ffn, parallel)
        inputs = (torch.randint(0, VOCAB, (case.batch, case.seq), generator=generator),)
        targets = torch.randint(0, VOCAB, (case.batch, case.seq), generator=generator)
    if case.layout == "bf16":
        model = model.to(torch.bfloat16)
    return model.train(), inputs, targets


def measure_case(case: PeakCase, parallel=None) -> PeakResult:
    """One rank's micro-step of ``case`` (``parallel``: its ParallelContext under expert parallelism)."""
    model, inputs, targets = build(case, parallel)
    plan = plan_for(case)
    if parallel is not None:
        fixed_routing(model)
    apply_recompute_plan(model, list(plan.recompute.recomputed))
    dtype = torch.float16 if case.layout == "fp16-autocast" else torch.bfloat16
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=case.autocast):
            loss = F.cross_entropy(model(*inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()

    with ExchangeBuffers() as exchanges, PeakStorageBytes() as memory:  # the first step's backward
        forward_backward()
    optimizer.step()  # creates the optimizer's states, which exist before a step, as the weights do
    optimizer.zero_grad(set_to_none=True)
    forward_backward()  # a second step as the engine runs it: backward, clipping, the optimizer
    clip_grad_norm_(model, 1.0, parallel)
    with PeakStorageBytes() as optimizer_memory:  # what optimizer.step() allocates on top
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    buffers = plan.gpu_memory["all_to_all_buffers"]
    return PeakResult(
        plan.step_memory.backward + buffers, memory.peak, plan.step_memory.where, buffers, exchanges.peak,
        optimizer_predicted=plan.params["per_rank"] * (2 if case.layout == "bf16" else 4),
        optimizer_measured=optimizer_memory.peak,
    )  # fmt: skip


def _ep_worker(rank: int, world: int, case: PeakCase) -> PeakResult:
    from moetrain.parallel import ParallelContext

    return measure_case(case, ParallelContext(ep_size=world, local_world_size=world))


def run_case(case: PeakCase) -> PeakResult:
    """The case's prediction and measurement; under expert parallelism the larger rank's (the one a
    GPU must hold). With fixed routing every rank exchanges the same rows (equal exchange buffers),
    but which rank peaks about one exchange's buffers higher varies from run to run (observed: 12.4
    vs 13.4 MB with a 1 MiB exchange, either rank), so the ranks may differ by that much."""
    if case.ep_size == 1:
        return measure_case(case)
    from tests.helpers.dist_utils import run_distributed

    results = run_distributed(_ep_worker, case.ep_size, case)
    assert len({r.exchange_measured for r in results}) == 1, results
    peaks = [r.measured for r in results]
    assert max(peaks) - min(peaks) <= results[0].exchange_measured, results
    return max(results, key=lambda r: r.measured)


def markdown_table() -> str:
    rows = [
        "| case (model, micro-batch x tokens, recompute, layout, EP ranks) | backward predicted MiB "
        "| measured MiB | predicted / measured | optimizer temporary predicted / measured MiB "
        "| step peak at |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for case in CASES:
        result = run_case(case)
        mib = f"{result.predicted / 2**20:.1f} | {result.measured / 2**20:.1f}"
        optimizer = f"{result.optimizer_predicted / 2**20:.1f} / {result.optimizer_measured / 2**20:.1f}"
        ratio = result.predicted / result.measured
        rows.append(f"| {case.name} | {mib} | {ratio:.3f} | {optimizer} | {result.where} |")
    return "\n".join(rows)


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(markdown_table())
