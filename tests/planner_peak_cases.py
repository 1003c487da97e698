"""The step-peak cases of docs/planner.md: the planner's predicted peak of one training micro-step
against the peak measured on the CPU, for language models at three sizes with full, half and no
recompute, in fp32, bf16 weights and bf16 autocast (fp32 weights).

Measured: :class:`moetrain.planner.measure.PeakStorageBytes` around forward, loss and backward
(everything the step allocates: activations, rebuilt segments, gradients, working memory; not the
weights and optimizer states that exist before). Predicted: the plan's ``step_peak`` at world 1,
CPU saving rules, grad_accum 1, the recompute the plan chose applied to the model.

``python -m tests.planner_peak_cases`` prints the table in docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetrain.config import MoEConfig
from moetrain.lm import LMConfig, MoETransformerLM, describe_lm
from moetrain.planner import ClusterSpec, PlanSettings, make_plan
from moetrain.planner.hardware import GPU_PRESETS
from moetrain.planner.measure import PeakStorageBytes
from moetrain.recompute import apply_recompute_plan

VOCAB = 256


@dataclass(frozen=True)
class PeakCase:
    d_model: int
    layers: int
    batch: int
    seq: int
    recompute: str  # "full", "half" or "none"
    layout: str  # "fp32", "bf16" (weights stored in bf16) or "bf16-autocast" (fp32 weights)

    @property
    def name(self) -> str:
        return f"d{self.d_model}-L{self.layers}-b{self.batch}-{self.recompute}-{self.layout}"


CASES = (
    PeakCase(512, 6, 4, 128, "full", "fp32"),  # the full-recompute 6-layer d512 model
    PeakCase(512, 6, 4, 128, "half", "bf16-autocast"),
    PeakCase(256, 4, 8, 128, "full", "fp32"),
    PeakCase(256, 4, 8, 128, "half", "fp32"),
    PeakCase(256, 4, 8, 128, "none", "fp32"),
    PeakCase(256, 4, 8, 128, "full", "bf16"),
    PeakCase(256, 4, 8, 128, "full", "bf16-autocast"),
    PeakCase(128, 4, 16, 128, "full", "fp32"),
    PeakCase(128, 4, 16, 128, "half", "bf16-autocast"),
)


def run_case(case: PeakCase) -> tuple[int, int, str]:
    """(predicted, measured) step peak in bytes, and where the plan puts the peak."""
    moe = MoEConfig(d_model=case.d_model, d_ff=2 * case.d_model, num_experts=8, top_k=2, capacity_factor=None)
    config = LMConfig(
        vocab_size=VOCAB,
        d_model=case.d_model,
        num_layers=case.layers,
        num_heads=8,
        max_seq_len=case.seq,
        moe=moe,
    )
    autocast = case.layout == "bf16-autocast"
    settings = PlanSettings(
        micro_batch=case.batch,
        seq_len=case.seq,
        precision="fp32" if case.layout == "fp32" else "bf16",
        autocast=autocast,
        recompute="fraction" if case.recompute == "half" else case.recompute,
        recompute_fraction=0.5 if case.recompute == "half" else None,
    )
    cluster = ClusterSpec(gpu=GPU_PRESETS["a100-80gb"], nodes=1, gpus_per_node=1)
    plan = make_plan(describe_lm(config), cluster, settings, kernels="cpu")
    torch.manual_seed(0)
    model = MoETransformerLM(config).train()
    if case.layout == "bf16":
        model = model.to(torch.bfloat16)
    apply_recompute_plan(model, list(plan.recompute.recomputed))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (case.batch, case.seq), generator=generator)
    targets = torch.randint(0, VOCAB, (case.batch, case.seq), generator=generator)
    with PeakStorageBytes() as memory:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
    return plan.gpu_memory["step_peak"], memory.peak, plan.step_memory.where


def markdown_table() -> str:
    rows = [
        "| case (d_model, layers, micro-batch x 128 tokens, recompute, layout) | predicted MiB "
        "| measured MiB | predicted / measured | peak at |",
        "|---|---:|---:|---:|---|",
    ]
    for case in CASES:
        predicted, measured, where = run_case(case)
        mib = f"{predicted / 2**20:.1f} | {measured / 2**20:.1f}"
        rows.append(f"| {case.name} | {mib} | {predicted / measured:.3f} | {where} |")
    return "\n".join(rows)


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(markdown_table())
