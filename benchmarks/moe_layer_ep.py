"""Expert-parallel MoELayer forward+backward: the chunked all-to-all overlapped with the experts
(``a2a_chunks = n``) vs the unchunked layer (``a2a_chunks = 1``), on an emulated two-node cluster.

``--emulated-mbit R ...``: the ranks run in two network namespaces joined by a link limited to R
Mbit/s per direction (``benchmarks/emulated_cluster.py``, root only), ``--ranks-per-node L`` each
(default 1: world 2, one core per rank). Without it: the same on loopback (world 2, spawned).

Each case (algorithm x chunk count) is warmed up first; then every measured round runs each case
once, in turn, and a rank's step time is the slowest rank's (all-reduce MAX). Reported: the median
step, ``unchunked_over_chunked`` (median of the per-round ratios; above 1: the overlap pays) and the
layer's peak of communication buffers (``MoELayer.comm_peak_bytes``).

Layer: T tokens per rank, d_model, d_ff, E experts over the ranks, top-2, dropless, fp32, one
thread per rank. Usage: ``python benchmarks/moe_layer_ep.py --emulated-mbit 100 200 [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain import MoEConfig, MoELayer, shard_experts
from moetrain.launch import free_port
from moetrain.parallel import ParallelContext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import int_in, nonnegative_int, output_path, positive_float, positive_int, write_json  # noqa: E402
from emulated_cluster import can_emulate, run_on_emulated_cluster  # noqa: E402


def measure(rank: int, world: int, local: int, args) -> list[dict]:
    torch.set_num_threads(1)
    algorithms = ["flat"] + (["hierarchical"] if local > 1 else [])
    cfg = MoEConfig(
        d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=2, capacity_factor=None
    )
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.d_model, generator=g)
    upstream = torch.randn(args.tokens, args.d_model, generator=g)
    cases = []
    for algorithm in algorithms:
        for chunks in args.chunks:
            ctx = ParallelContext(
                ep_size=world, all_to_all=algorithm, local_world_size=local, a2a_chunks=chunks
            )
            torch.manual_seed(0)
            cases.append((algorithm, chunks, shard_experts(MoELayer(cfg), ctx)))

    def step(layer) -> float:
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        dist.barrier()
        start = time.perf_counter()
        layer(xi).backward(upstream)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for _, _, layer in cases:  # every case warmed up before any is measured
        for _ in range(args.warmup):
            step(layer)
    samples = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, _, layer) in enumerate(cases):
            samples[i].append(step(layer))
    rows = []
    for (algorithm, chunks, layer), times in zip(cases, samples, strict=True):
        base = next(s for (a, c, _), s in zip(cases, samples, strict=True) if a == algorithm and c == 1)
        peak = torch.tensor([layer.comm_peak_bytes()], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "algorithm": algorithm,
                "a2a_chunks": chunks,
                "step_ms": 1e3 * statistics.median(times),
                "unchunked_over_chunked": statistics.median(b / t for b, t in zip(base, times, strict=True)),
                "comm_peak_bytes": int(peak),
                "rows_received": int(layer.last_stats.kept_per_expert.sum()),
            }
        )
    return rows


def _spawned(rank: int, args, out: str, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    rows = measure(rank, world, 1, args)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _launched(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1200))
    rows = measure(rank, world, int(os.environ["LOCAL_WORLD_SIZE"]), args)
    if rank == 0:
        Path(args.worker).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=positive_int, default=1024)
    parser.add_argument("--d-model", type=positive_int, default=256)
    parser.add_argument("--d-ff", type=positive_int, default=1024)
    parser.add_argument("--experts", type=int_in(2, why=" (top-2 routing)"), default=8)
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=positive_int, default=9)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument("--emulated-mbit", type=positive_float, nargs="*")
    parser.add_argument("--ranks-per-node", type=positive_int, default=1)
    parser.add_argument("--json", metavar="PATH", type=output_path)
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if 1 not in args.chunks:
        parser.error("--chunks must include 1 (the unchunked reference)")
    if args.worker:
        _launched(args)
        return
    runs = {}
    forwarded = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in vars(args).items()
        if name in ("tokens", "d_model", "d_ff", "experts", "repeats", "warmup")
    ]
    forwarded += ["--chunks", *map(str, args.chunks)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        if args.emulated_mbit:
            problem = can_emulate()
            if problem is not None:
                parser.error(f"--emulated-mbit: cannot emulate the cluster: {problem}")
            for rate in args.emulated_mbit:
                argv = [__file__, "--worker", out, *forwarded]
                code = run_on_emulated_cluster(argv, args.ranks_per_node, rate, timeout_s=3000)
                if code != 0:
                    raise SystemExit(f"a rank failed with exit status {code}")
                runs[f"{rate:g}mbit"] = json.loads(Path(out).read_text())
        else:
            port = free_port()
            mp.spawn(_spawned, args=(args, out, port, 2), nprocs=2, join=True)
            runs["loopback"] = json.loads(Path(out).read_text())
    local = args.ranks_per_node if args.emulated_mbit else 1
    for name, rows in runs.items():
        link = "loopback" if name == "loopback" else f"inter-node link {name[:-4]} Mbit/s (tbf)"
        print(
            f"MoELayer fwd+bwd, expert parallel over 2 nodes x {local}, {link}; T={args.tokens} per "
            f"rank, d_model={args.d_model} d_ff={args.d_ff} E={args.experts} top-2 dropless fp32, 1 thread "
            f"per rank, median of {args.repeats}"
        )
        columns = ["algorithm", "a2a_chunks", "step_ms", "unchunked_over_chunked", "comm_peak_bytes"]
        print(" | ".join(f"{c:>22}" for c in columns))
        for row in rows:
            values = [row[c] if not isinstance(row[c], float) else f"{row[c]:.3f}" for c in columns]
            print(" | ".join(f"{v!s:>22}" for v in values))
        print()
    if args.json:
        write_json(args.json, {"benchmark": "moe_layer_ep", "config": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
