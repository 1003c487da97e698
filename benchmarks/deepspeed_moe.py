"""MoELayer vs DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``), side by side in one process.

Same shape as ``benchmarks/moe_layer.py`` (T=2048, d_model=512, d_ff=2048, E=8, top-2, fp32, GELU
experts without biases, 2 threads), forward+backward, three routings:
``capacity_1.0`` (both drop past C = ceil(T*k/E)), ``dropless_balanced`` and ``dropless_skewed``
(about half of the routed slots to 2 of the 8 experts, by tilting each router the same way;
DeepSpeed's dropless mode, ``drop_tokens=False``, raises the capacity to the busiest expert's count
and pads every expert to it). DeepSpeed runs with ``ep_size=1`` on a one-rank gloo group, its
second-expert sampling off (deterministic top-2). Every case is warmed up first, then each round runs
both layers back to back; ``deepspeed_over_ours`` is the median of the per-round ratios.

DeepSpeed is not a dependency: install it somewhere and put it on ``PYTHONPATH`` (``pip install
--target DIR --no-deps deepspeed hjson msgpack psutil py-cpuinfo einops``; ``DS_BUILD_OPS=0``, the
MoE layer needs no compiled op). Usage: ``python benchmarks/deepspeed_moe.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moetrain import MoELayer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import int_in, nonnegative_int, output_path, positive_int, write_json  # noqa: E402


def skew(router_weight: torch.Tensor, x: torch.Tensor, ids_of, hot: int, share: float) -> float:
    """Adds ``alpha * u`` (u: the inputs' mean direction) to the first ``hot`` router rows, alpha
    bisected so that ``share`` of the routed slots go to them; returns the share reached."""
    u = x.mean(0)
    u = u / u.norm()
    base = router_weight.detach().clone()
    low, high, reached = 0.0, 50.0, 0.0
    for _ in range(40):
        alpha = (low + high) / 2
        with torch.no_grad():
            router_weight.copy_(base)
            router_weight[:hot] += alpha * u
        reached = float((ids_of(x) < hot).float().mean())
        low, high = (alpha, high) if reached < share else (low, alpha)
    return reached


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=positive_int, default=2048)
    parser.add_argument("--d-model", type=positive_int, default=512)
    parser.add_argument("--d-ff", type=positive_int, default=2048)
    parser.add_argument("--experts", type=int_in(2, why=" (top-2 routing)"), default=8)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=11)
    parser.add_argument("--warmup", type=nonnegative_int, default=5)
    parser.add_argument("--json", metavar="PATH", type=output_path)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # for DeepSpeed, in this benchmark's process
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError as error:
        parser.error(f"DeepSpeed is not importable ({error}); see the module docstring")
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    t, d, f, e = args.tokens, args.d_model, args.d_ff, args.experts

    cases = []
    for name, capacity_factor, skewed in (
        ("capacity_1.0", 1.0, False),
        ("dropless_balanced", None, False),
        ("dropless_skewed", None, True),
    ):
        torch.manual_seed(0)
        ours = MoELayer(d_model=d, d_ff=f, num_experts=e, top_k=2, capacity_factor=capacity_factor,
                        min_capacity=4, aux_loss_coef=1e-2)  # fmt: skip
        expert = nn.Sequential(nn.Linear(d, f, bias=False), nn.GELU(), nn.Linear(f, d, bias=False))
        theirs = MoE(
            hidden_size=d, expert=expert, num_experts=e, ep_size=1, k=2,
            capacity_factor=capacity_factor or 1.0, eval_capacity_factor=capacity_factor or 1.0,
            min_capacity=4, drop_tokens=capacity_factor is not None, use_rts=False,
            top2_2nd_expert_sampling=False,
        )  # fmt: skip
        x = torch.randn(t, d)
        share = float((ours.router(x).expert_ids_TK < 2).float().mean())
        if skewed:
            x = x + 0.5 * torch.randn(d)
            share = skew(ours.router.weight, x, lambda v, m=ours: m.router(v).expert_ids_TK, 2, 0.5)
            gate = theirs.deepspeed_moe.gate.wg.weight
            skew(gate, x, lambda v, w=gate: (v @ w.t()).topk(2, dim=-1).indices, 2, 0.5)
        x.requires_grad_(True)
        grad = torch.randn(t, d)

        def run_ours(layer=ours, x=x, grad=grad):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(grad)

        def run_theirs(layer=theirs, x=x, grad=grad):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out, aux, _ = layer(x.unsqueeze(0))
            (out.squeeze(0) * grad).sum().add(1e-2 * aux).backward()

        cases.append((name, share, run_ours, run_theirs))

    for _, _, run_ours, run_theirs in cases:  # every case warmed up before any is measured
        for _ in range(args.warmup):
            run_ours()
            run_theirs()
    samples = {name: ([], []) for name, *_ in cases}
    for _ in range(args.repeats):
        for name, _, run_ours, run_theirs in cases:
            for fn, store in ((run_ours, samples[name][0]), (run_theirs, samples[name][1])):
                start = time.perf_counter()
                fn()
                store.append(time.perf_counter() - start)
    results = []
    for name, share, *_ in cases:
        ours_s, theirs_s = samples[name]
        results.append(
            {
                "case": name,
                "hot2_share": round(share, 3),
                "ours_ms": round(1e3 * statistics.median(ours_s), 1),
                "deepspeed_ms": round(1e3 * statistics.median(theirs_s), 1),
                "deepspeed_over_ours": round(
                    statistics.median(b / a for a, b in zip(ours_s, theirs_s, strict=True)), 3
                ),
            }
        )
    print(
        f"MoE layer fwd+bwd, T={t} d_model={d} d_ff={f} E={e} top-2 fp32, {args.threads} threads, "
        f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, median of {args.repeats}"
    )
    columns = list(results[0])
    print(" | ".join(f"{c:>19}" for c in columns))
    for row in results:
        print(" | ".join(f"{row[c]!s:>19}" for c in columns))
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "threads": args.threads}
        write_json(args.json, {"benchmark": "deepspeed_moe", "machine": machine, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
