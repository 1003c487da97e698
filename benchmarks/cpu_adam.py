"""Fused CPU AdamW step vs the best torch composition vs the memory roofline, in one run.

The work of one optimizer step on N fp32 master parameters, bf16 gradients in, bf16 weights out:
read grad (2 B) + param, exp_avg, exp_avg_sq (12 B), write param, exp_avg, exp_avg_sq (12 B) +
the bf16 copy (2 B) = 28 B per parameter.

Measured (median of --reps timed rounds after --warmup untimed runs, on --threads threads; the
candidates run interleaved, one call each per round):
  ours       `ops.adam_step_(..., param_copy_out=param_bf16)`: one fused pass.
  torch      `grad_fp32.copy_(grad_bf16)`; `torch.optim.AdamW(fused=True).step()`;
             `param_bf16.copy_(param)` (also foreach=True; the faster one is the baseline).
  roofline   `ops.adam_memory_probe_`: the same loads and stores over buffers of the same sizes
             with the arithmetic replaced by additions; bandwidth = 28 B * N / time.
  torch copy_ context only: `dst.copy_(src)` of 14 B * N, i.e. 28 B * N moved.

Usage: python benchmarks/cpu_adam.py [--numel 50000000] [--threads 2] [--json PATH]
                                     [--max-simd-level avx512|avx2|scalar]
"""

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moetrain._ext import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import nonnegative_int, positive_int, write_json  # noqa: E402

BYTES_PER_PARAM = 2 + 12 + 12 + 2  # grad bf16 in; param, exp_avg, exp_avg_sq in and out; bf16 copy out
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01


def time_interleaved_s(fns: list[Callable[[], None]], warmup: int, reps: int) -> list[list[float]]:
    """Runs every fn ``warmup`` times untimed, then ``reps`` rounds that time each fn once.

    Interleaving the candidates round by round keeps slow drifts of the machine (other tenants,
    frequency) from favouring whichever candidate ran first. Returns seconds per fn per round.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times_s: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, fn_times_s in zip(fns, times_s, strict=True):
            start = time.perf_counter()
            fn()
            fn_times_s.append(time.perf_counter() - start)
    return times_s


def make_ours(numel: int) -> Callable[[], None]:
    """Our fused step on fresh buffers (fp32 master/moments, bf16 grad in, bf16 copy out)."""
    param_N = torch.randn(numel)
    exp_avg_N = torch.zeros(numel)
    exp_avg_sq_N = torch.zeros(numel)
    grad_bf16_N = torch.randn(numel).to(torch.bfloat16)
    param_bf16_N = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def run() -> None:
        step[0] += 1
        ops.adam_step_(
            param_N,
            grad_bf16_N,
            exp_avg_N,
            exp_avg_sq_N,
            step=step[0],
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            adamw=True,
            param_copy_out=param_bf16_N,
        )

    return run


def make_torch(numel: int, *, fused: bool) -> Callable[[], None]:
    """The torch composition: upcast grad into a preallocated fp32 grad, AdamW step, bf16 copy out."""
    param_N = torch.nn.Parameter(torch.randn(numel))
    grad_bf16_N = torch.randn(numel).to(torch.bfloat16)
    param_N.grad = torch.empty(numel)
    param_bf16_N = torch.empty(numel, dtype=torch.bfloat16)
    if fused:
        optimizer = torch.optim.AdamW(
            [param_N], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
        )
    else:
        optimizer = torch.optim.AdamW(
            [param_N], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True
        )

    def run() -> None:
        param_N.grad.copy_(grad_bf16_N)
        optimizer.step()
        with torch.no_grad():
            param_bf16_N.copy_(param_N)

    return run


def make_roofline(numel: int) -> Callable[[], None]:
    """The memory probe over buffers shaped like ours (same bytes read and written)."""
    param_N = torch.zeros(numel)
    exp_avg_N = torch.zeros(numel)
    exp_avg_sq_N = torch.zeros(numel)
    grad_bf16_N = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    param_bf16_N = torch.empty(numel, dtype=torch.bfloat16)
    return lambda: ops.adam_memory_probe_(param_N, grad_bf16_N, exp_avg_N, exp_avg_sq_N, param_bf16_N)


def make_torch_copy(numel: int) -> Callable[[], None]:
    """``dst.copy_(src)`` of 14 B per param: 28 B per param moved, for context."""
    src = torch.randn(numel * 7 // 2)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--numel", type=positive_int, default=50_000_000, help="parameters per step (default 50M)"
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="torch / OpenMP threads (default 2)")
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=3, help="untimed runs before timing (default 3)"
    )
    parser.add_argument(
        "--reps", type=positive_int, default=15, help="timed rounds; the median is reported (default 15)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--max-simd-level",
        choices=["avx512", "avx2", "scalar"],
        default=None,
        help="cap our kernels' SIMD path (default: the best this CPU has)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.max_simd_level is not None:
        ops.set_max_simd_level(args.max_simd_level)

    simd_path = ops.cpu_adam_simd_path()
    candidates = {
        f"ours: fused adam_step_ ({simd_path})": make_ours(args.numel),
        "torch: upcast + AdamW(fused=True) + copy-out": make_torch(args.numel, fused=True),
        "torch: upcast + AdamW(foreach=True) + copy-out": make_torch(args.numel, fused=False),
        f"roofline: adam_memory_probe_ ({simd_path})": make_roofline(args.numel),
        "context: torch copy_ of 14 B/param": make_torch_copy(args.numel),
    }
    times_s = time_interleaved_s(list(candidates.values()), args.warmup, args.reps)
    rows = []
    for name, fn_times_s in zip(candidates, times_s, strict=True):
        median_s = statistics.median(fn_times_s)
        rows.append(
            {
                "name": name,
                "median_ms": median_s * 1e3,
                "times_ms": [t * 1e3 for t in fn_times_s],
                "gb_per_s": BYTES_PER_PARAM * args.numel / median_s / 1e9,
            }
        )
    ours, torch_fused, torch_foreach, roofline, _ = rows
    torch_best = min(torch_fused, torch_foreach, key=lambda row: row["median_ms"])
    speedup = torch_best["median_ms"] / ours["median_ms"]
    roofline_fraction = ours["gb_per_s"] / roofline["gb_per_s"]

    print(
        f"CPU AdamW step, {args.numel / 1e6:.0f}M params, bf16 grad in + bf16 copy out, "
        f"{BYTES_PER_PARAM} B/param, {args.threads} threads, torch {torch.__version__}"
    )
    print(f"{'':48s} {'median ms':>10s} {'GB/s':>8s}")
    for row in rows:
        print(f"{row['name']:48s} {row['median_ms']:10.1f} {row['gb_per_s']:8.1f}")
    print(f"speedup vs best torch ({torch_best['name']}): {speedup:.2f}x (target >= 1.3x)")
    print(f"ours / roofline bandwidth: {100 * roofline_fraction:.0f}% (target >= 80%)")

    if args.json is not None:
        result = {
            "benchmark": "cpu_adam",
            "numel": args.numel,
            "threads": args.threads,
            "bytes_per_param": BYTES_PER_PARAM,
            "simd_path": simd_path,
            "torch_version": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "warmup": args.warmup,
            "reps": args.reps,
            "rows": rows,
            "speedup_vs_best_torch": speedup,
            "roofline_fraction": roofline_fraction,
            "targets_met": {"speedup_ge_1.3": speedup >= 1.3, "roofline_ge_0.8": roofline_fraction >= 0.8},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, result)


if __name__ == "__main__":
    main()
