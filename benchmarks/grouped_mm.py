"""The experts' GEMMs on the CPU: moetrain's loop of per-expert ``torch.mm`` against torch's grouped
GEMM (``torch.nn.functional.grouped_mm``), forward only (torch has no CPU backward for it).

Shapes of ``benchmarks/moe_layer.py``: N=4096 routed rows over E=8 experts (balanced, and skewed
with half the rows on 2 experts), ``x [N, 512] @ w1[e] [512, 2048]`` then ``[N, 2048] @ w2[e]
[2048, 512]``, fp32. Both candidates run back to back in every round; the figure is the median
of the per-round ratios ``loop / grouped``: above 1 the loop is slower and the CPU path should
switch. Usage: ``python benchmarks/grouped_mm.py [--json PATH] [--repeats N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moetrain import _torch_compat
from moetrain.kernels.grouped_mm import loop_grouped_mm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import nonnegative_int, output_path, positive_int, write_json  # noqa: E402


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, counts: list[int], args) -> dict:
    g = torch.Generator().manual_seed(0)
    rows = sum(counts)
    x = torch.randn(rows, 512, generator=g)
    w1, w2 = (
        torch.randn(len(counts), 512, 2048, generator=g),
        torch.randn(len(counts), 2048, 512, generator=g),
    )
    counts_E = torch.tensor(counts)
    offsets = counts_E.cumsum(0).to(torch.int32)

    def loop():
        loop_grouped_mm(loop_grouped_mm(x, w1, counts_E, False), w2, counts_E, False)

    def grouped():
        _torch_compat.grouped_mm(_torch_compat.grouped_mm(x, w1, offsets), w2, offsets)

    a = loop_grouped_mm(loop_grouped_mm(x, w1, counts_E, False), w2, counts_E, False)
    b = _torch_compat.grouped_mm(_torch_compat.grouped_mm(x, w1, offsets), w2, offsets)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    for _ in range(args.warmup):
        loop()
        grouped()
    loop_s, grouped_s = [], []
    for _ in range(args.repeats):
        loop_s.append(_timed(loop))
        grouped_s.append(_timed(grouped))
    return {
        "case": name,
        "loop_ms": round(1e3 * statistics.median(loop_s), 2),
        "grouped_ms": round(1e3 * statistics.median(grouped_s), 2),
        "loop_over_grouped": round(
            statistics.median(a / b for a, b in zip(loop_s, grouped_s, strict=True)), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures as JSON to PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [
        measure("balanced", [512] * 8, args),
        measure("skewed", [1024, 1024] + [341] * 5 + [343], args),
    ]
    print(
        f"expert GEMMs forward (x@w1 then @w2), N=4096 E=8 512->2048->512 fp32, {args.threads} threads, "
        f"median of {args.repeats}, torch {torch.__version__}"
    )
    columns = list(results[0])
    print(" | ".join(f"{c:>17}" for c in columns))
    for row in results:
        print(" | ".join(f"{row[c]!s:>17}" for c in columns))
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "threads": args.threads}
        write_json(args.json, {"machine": machine, "results": results}, indent=1)


if __name__ == "__main__":
    main()
