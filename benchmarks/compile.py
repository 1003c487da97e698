"""Forward+backward time of ``torch.compile`` (inductor) against eager, on the CPU, as ratios.

Two modules, each timed eager and compiled in the same rounds (the two candidates back to back in
every round, the figure is the median of the per-round ratios ``compiled / eager``):

- ``moe_layer``: one MoELayer (T=2048, d_model=512, d_ff=2048, E=8, top-2, capacity 1.0, fp32),
  the shape of ``benchmarks/moe_layer.py``;
- ``block``: the language model's transformer block around it (pre-norm attention with 8 heads,
  then the MoE FFN), the same tokens as 4 sequences of 512.

The compile time (first call: tracing, inductor code generation and the C++ build) is reported
but not part of the ratio; a few calls are run after it as warm-up. ``--device cuda`` runs the same
modules in bf16 on a GPU (scripts/gpu_check.sh). Usage:
``python benchmarks/compile.py [--device cpu|cuda] [--json PATH] [--repeats N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_lm import LMConfig, TransformerBlock
from moetrain import MoEConfig, MoELayer
from moetrain._ext import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import nonnegative_int, output_path, positive_int, write_json  # noqa: E402


def _step(module, x, grad_out):
    def run():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(grad_out)

    return run


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def measure(name: str, module: torch.nn.Module, x: torch.Tensor, args) -> dict:
    torch.manual_seed(0)
    x = x.detach().requires_grad_(True)
    grad_out = torch.randn_like(x)
    eager = _step(module, x, grad_out)
    torch._dynamo.reset()
    compiled_module = torch.compile(module, fullgraph=True)
    compiled = _step(compiled_module, x, grad_out)
    compile_s = _timed(compiled)  # first call: trace, generate, build
    for _ in range(args.warmup):
        eager()
        compiled()
    eager_s, compiled_s = [], []
    for _ in range(args.repeats):
        eager_s.append(_timed(eager))
        compiled_s.append(_timed(compiled))
    ratios = [c / e for c, e in zip(compiled_s, eager_s, strict=True)]
    return {
        "module": name,
        "eager_ms": round(1e3 * statistics.median(eager_s), 2),
        "compiled_ms": round(1e3 * statistics.median(compiled_s), 2),
        "compiled_over_eager": round(statistics.median(ratios), 3),
        "compile_s": round(compile_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: in bf16")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures as JSON to PATH")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU, but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    moe = MoEConfig(d_model=512, d_ff=2048, num_experts=8, top_k=2, capacity_factor=1.0, min_capacity=1)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    layer = MoELayer(moe).to(args.device, dtype)
    block = TransformerBlock(LMConfig(d_model=512, num_heads=8, max_seq_len=512, moe=moe))
    block = block.to(args.device, dtype)
    results = [
        measure("moe_layer", layer, torch.randn(2048, 512, device=args.device, dtype=dtype), args),
        measure("block", block, torch.randn(4, 512, 512, device=args.device, dtype=dtype), args),
    ]
    machine = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "simd": ops.simd_level(),
        "torch": torch.__version__,
    }
    print(
        f"torch.compile (inductor, fullgraph) vs eager, fwd+bwd, T=2048 d_model=512 d_ff=2048 E=8 top-2 "
        f"capacity 1.0 {dtype}, {args.device}, {args.threads} threads, median of {args.repeats}"
    )
    columns = list(results[0])
    print(" | ".join(f"{c:>19}" for c in columns))
    for row in results:
        print(" | ".join(f"{row[c]!s:>19}" for c in columns))
    if args.json:
        write_json(args.json, {"machine": machine, "results": results}, indent=1)


if __name__ == "__main__":
    main()
