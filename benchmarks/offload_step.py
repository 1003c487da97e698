"""``OffloadOptimizer.step()`` against its host-memory roofline, on the device given (CUDA or CPU).

One step reads and writes, per parameter, the fp32 master, ``exp_avg`` and ``exp_avg_sq`` (3 x 4 B
read, 3 x 4 B written) and reads the gradient and writes the weight copy in the model's dtype
(2 x 2 B for bf16): 28 B of host-memory traffic per parameter for a bf16 model (36 B for fp32).
The roofline is that traffic at the host bandwidth measured in the same run: the fastest of torch's
own streaming loops over large host buffers (copy, triad, read; :func:`host_bandwidth`). The figure
is ``step time / roofline``: 1.0 means the step runs at the fastest streaming speed torch reaches.

Usage: ``python benchmarks/offload_step.py [--device cuda] [--params 1.2e9] [--dtype bf16] [--json PATH]``
(defaults: cuda when available, else cpu; 1.2e9 parameters on cuda, 2e7 on cpu).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moetrain.offload import OffloadOptimizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHARDS = 8  # parameters: equal slices of the total, as a model's layers would be

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import nonnegative_int, number_at_least, output_path, positive_int, write_json  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_bandwidth(numel: int, repeats: int) -> dict[str, float]:
    """Bytes per second that torch's own streaming loops reach over host fp32 buffers of ``numel``
    elements, best of ``repeats``: ``copy`` (``dst.copy_(src)``: 8 B per element), ``triad``
    (``torch.add(a, b, alpha=2, out=c)``: 12 B) and ``read`` (``a.sum()``: 4 B). Write-allocate
    traffic is not counted, so the fastest of the three is an optimistic limit for a step that both
    reads and writes."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    patterns = {
        "copy": (lambda: c.copy_(a), 8),
        "triad": (lambda: torch.add(a, b, alpha=2.0, out=c), 12),
        "read": (lambda: a.sum(), 4),
    }
    result = {}
    for name, (run, bytes_per_element) in patterns.items():
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        result[name] = bytes_per_element * numel / min(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument(
        "--params",
        type=number_at_least(SHARDS, f" ({SHARDS} parameters of at least one element)"),
        help="parameters stepped (default 1.2e9 on cuda, 2e7 on cpu)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument(
        "--threads", type=positive_int, help="torch / OpenMP threads on the host (default: all)"
    )
    parser.add_argument("--warmup", type=nonnegative_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--json", metavar="PATH", type=output_path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU, but torch.cuda.is_available() is False")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    total = int(args.params or (1.2e9 if device.type == "cuda" else 2e7))
    dtype = DTYPES[args.dtype]
    params = [
        torch.nn.Parameter(torch.randn(total // SHARDS, device=device, dtype=dtype)) for _ in range(SHARDS)
    ]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = OffloadOptimizer(params, lr=1e-4, weight_decay=0.1)
    times = []
    for round_ in range(args.warmup + args.repeats):
        _sync(device)
        start = time.perf_counter()
        optimizer.step()
        _sync(device)
        if round_ >= args.warmup:
            times.append(time.perf_counter() - start)
    stepped = sum(p.numel() for p in params)
    bytes_per_param = 3 * 4 * 2 + 2 * params[0].element_size()
    patterns = host_bandwidth(min(stepped, 250_000_000), args.repeats)
    bandwidth = max(patterns.values())
    step_s = statistics.median(times)
    roofline_s = stepped * bytes_per_param / bandwidth
    result = {
        "benchmark": "offload_step",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": stepped,
        "dtype": args.dtype,
        "step_s": step_s,
        "host_GBps": {name: round(value / 1e9, 1) for name, value in patterns.items()},
        "bytes_per_param": bytes_per_param,
        "roofline_s": roofline_s,
        "step_over_roofline": step_s / roofline_s,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
