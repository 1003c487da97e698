"""Forward+backward time of one MoELayer vs the dense-GEMM floor and a plain-PyTorch MoE.

Figures are ratios measured in the same run:
- ``floor``: the same FFN (same activation) applied to exactly the N routed rows the layer
  computes, as one dense GEMM pair: the FLOPs a perfect MoE layer cannot avoid;
- ``plain``: a straightforward PyTorch MoE (boolean masks, index_select / index_add_), written here.

Cases (T=2048, d_model=512, d_ff=2048, E=8, top-2, fp32, 2 threads by default):
``capacity_1.0``, ``dropless_balanced`` and ``dropless_skewed`` (about half of the routed slots go
to 2 of the 8 experts). Usage: ``python benchmarks/moe_layer.py [--json PATH] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain._ext import ops


def plain_pytorch_moe(x_TD, router_w_ED, w1_EDF, w2_EFD, top_k, capacity):
    """A readable MoE without custom kernels: softmax top-k, per-expert masks, index_add_."""
    probs_TE = torch.softmax(x_TD @ router_w_ED.t(), dim=-1)
    gates_TK, ids_TK = probs_TE.topk(top_k, dim=-1)
    gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    out_TD = torch.zeros_like(x_TD)
    for e in range(w1_EDF.shape[0]):
        token_idx, choice_idx = torch.nonzero(ids_TK == e, as_tuple=True)
        if capacity is not None:
            token_idx, choice_idx = token_idx[:capacity], choice_idx[:capacity]
        if token_idx.numel() == 0:
            continue
        h = F.gelu(x_TD.index_select(0, token_idx) @ w1_EDF[e]) @ w2_EFD[e]
        out_TD = out_TD.index_add(0, token_idx, h * gates_TK[token_idx, choice_idx].unsqueeze(-1))
    return out_TD


def skew_router(layer: MoELayer, x_TD: torch.Tensor, hot_experts: int, target_share: float) -> float:
    """Tilts the router so that ``hot_experts`` experts receive ``target_share`` of the routed slots:
    inputs share a common direction u and the hot experts' router rows get ``alpha * u`` added."""
    u = x_TD.mean(0)
    u = u / u.norm()
    base = layer.router.weight.detach().clone()
    low, high = 0.0, 50.0
    share = 0.0
    for _ in range(40):
        alpha = (low + high) / 2
        with torch.no_grad():
            layer.router.weight.copy_(base)
            layer.router.weight[:hot_experts] += alpha * u
            ids = layer.router(x_TD).expert_ids_TK
        share = float((ids < hot_experts).float().mean())
        if share < target_share:
            low = alpha
        else:
            high = alpha
    return share


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run_case(name: str, capacity_factor, skewed: bool, args) -> dict:
    torch.manual_seed(0)
    layer = MoELayer(
        d_model=args.d_model,
        d_ff=args.d_ff,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=capacity_factor,
        min_capacity=1,
        aux_loss_coef=1e-2,
    )
    x = torch.randn(args.tokens, args.d_model)
    if skewed:
        x = x + 0.5 * torch.randn(args.d_model)  # a shared direction the router can key on
        share = skew_router(layer, x, hot_experts=2, target_share=0.5)
    else:
        share = float((layer.router(x).expert_ids_TK < 2).float().mean())
    x.requires_grad_(True)
    layer(x)
    rows = int(layer.last_stats.kept_per_expert.sum())
    capacity = layer.last_stats.capacity
    grad_out = torch.randn(args.tokens, args.d_model)

    floor_x = torch.randn(rows, args.d_model, requires_grad=True)
    floor_w1 = torch.randn(args.d_model, args.d_ff, requires_grad=True)
    floor_w2 = torch.randn(args.d_ff, args.d_model, requires_grad=True)
    floor_grad = torch.randn(rows, args.d_model)
    plain_weights = [
        p.detach().clone().requires_grad_(True)
        for p in (layer.router.weight, layer.experts.w1_EDF, layer.experts.w2_EFD)
    ]

    def ours():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad_out)

    def floor():
        F.gelu(floor_x @ floor_w1).matmul(floor_w2).backward(floor_grad)
        floor_x.grad = floor_w1.grad = floor_w2.grad = None

    def plain():
        x.grad = None
        for p in plain_weights:
            p.grad = None
        plain_pytorch_moe(x, *plain_weights, args.top_k, capacity).backward(grad_out)

    candidates = {"ours": ours, "floor": floor, "plain": plain}
    for fn in candidates.values():
        timed(fn, args.warmup)
    samples = {key: [] for key in candidates}
    for _ in range(args.repeats):  # interleaved, so drift in machine speed hits all three alike
        for key, fn in candidates.items():
            samples[key] += timed(fn, 1)
    median_ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}
    flops = 3 * 2 * 2 * rows * args.d_model * args.d_ff  # fwd + 2x bwd, two GEMMs, 2 flop per MAC
    return {
        "case": name,
        "routed_rows": rows,
        "capacity": capacity,
        "hot2_share": round(share, 3),
        "ours_ms": round(median_ms["ours"], 2),
        "floor_ms": round(median_ms["floor"], 2),
        "plain_ms": round(median_ms["plain"], 2),
        "ours_over_floor": round(median_ms["ours"] / median_ms["floor"], 3),
        "plain_over_ours": round(median_ms["plain"] / median_ms["ours"], 3),
        "ours_gflops": round(flops / median_ms["ours"] / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cases = [
        ("capacity_1.0", 1.0, False),
        ("dropless_balanced", None, False),
        ("dropless_skewed", None, True),
    ]
    results = [run_case(name, cf, skewed, args) for name, cf, skewed in cases]
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "simd": ops.simd_level(),
        "torch": torch.__version__,
    }
    header = (
        f"MoELayer fwd+bwd, T={args.tokens} d_model={args.d_model} d_ff={args.d_ff} E={args.experts} "
        f"top-{args.top_k} fp32, {args.threads} threads, median of {args.repeats}"
    )
    print(header)
    columns = [
        "case",
        "routed_rows",
        "hot2_share",
        "ours_ms",
        "floor_ms",
        "plain_ms",
        "ours_over_floor",
        "plain_over_ours",
    ]
    print(" | ".join(f"{c:>17}" for c in columns))
    for row in results:
        print(" | ".join(f"{row[c]!s:>17}" for c in columns))
    print("target: ours_over_floor <= 1.05 in every case")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "moe_layer", "config": vars(args), "machine": machine, "results": results},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
