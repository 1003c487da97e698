"""Where a MoELayer forward+backward spends its GPU time, beside the torchtitan-style MoE of
``benchmarks/moe_layer.py`` on the same shapes and weights: ``torch.profiler`` over a few calls of
each (after warm-up), the kernels with the most CUDA time, one table per candidate.

Usage: ``python benchmarks/profile_moe_layer.py [--tokens 16384 --d-model 4096 --d-ff 14336
--experts 8 --top-k 2] [--case dropless_balanced] [--rows 18]`` (CUDA only; bf16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # noqa: E402  (the benchmark's cases and candidates)
from _cli import positive_int  # noqa: E402

CASES = {"capacity_1.0": (1.0, False), "dropless_balanced": (None, False), "dropless_skewed": (None, True)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=positive_int, default=16384)
    parser.add_argument("--d-model", type=positive_int, default=4096)
    parser.add_argument("--d-ff", type=positive_int, default=14336)
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--top-k", type=positive_int, default=2)
    parser.add_argument("--case", choices=sorted(CASES), default="dropless_balanced")
    parser.add_argument("--calls", type=positive_int, default=3, help="profiled calls of each candidate")
    parser.add_argument("--rows", type=positive_int, default=18, help="kernels listed per candidate")
    args = parser.parse_args()
    if args.top_k > args.experts:
        parser.error(f"argument --top-k: must be <= --experts ({args.experts}), got {args.top_k}")
    if not torch.cuda.is_available():
        parser.error("needs a GPU: torch.cuda.is_available() is False")
    args.device, args.dtype = "cuda", "bf16"
    capacity_factor, skewed = CASES[args.case]
    case = moe_layer.build_case(args.case, capacity_factor, skewed, args)
    for name in ("ours", "titan", "floor"):
        run = case["candidates"][name]
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                run()
            torch.cuda.synchronize()
        events = prof.key_averages()
        total_us = sum(e.device_time_total for e in events) / args.calls  # kernels only: CUDA activity
        print(
            f"\n== {name}: {args.case}, T={args.tokens} d={args.d_model} d_ff={args.d_ff} "
            f"E={args.experts} top-{args.top_k}: {total_us / 1e3:.2f} ms of kernels per call"
        )
        rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)[: args.rows]
        for e in rows:
            per_call = e.device_time_total / args.calls
            share = 100 * per_call / total_us
            print(f"{per_call / 1e3:8.3f} ms {share:5.1f}% x{e.count // args.calls:<3} {e.key[:100]}")


if __name__ == "__main__":
    main()
