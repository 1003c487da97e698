"""Flat vs hierarchical (2-D) all-to-all on world 8 emulated as 2 nodes x 4 ranks (gloo, CPU).

For per-rank payloads of fp32 rows from 4 KiB to 16 MiB it measures the round trip (exchange +
reverse, as in MoE dispatch + combine) of both algorithms in the same run, on three wires: fp32 as
is, ``comm_dtype="bf16"`` and ``comm_dtype="fp16"`` (scaled), the last two including their encode
and decode, and counts per rank the messages sent and the bytes that cross between emulated nodes.
It then fits the alpha-beta model ``t = alpha * messages + beta * bytes`` (least squares over the
fp32-wire measurements: communication only) and states what the model predicts at 60 nodes x 8
GPUs.

Usage: ``python benchmarks/all_to_all.py [--json PATH] [--repeats N]``. The 8 ranks share this
machine's cores and talk over loopback, so intra- and inter-node links cost the same here; the
message-count advantage is what the measurement shows, the bandwidth gap is what the model adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, exchange_counts
from moetrain.parallel import ParallelContext

WORLD, LOCAL = 8, 4
SIZES_KIB = [4, 64, 1024, 16384]
WIRES = ("fp32", "bf16", "fp16")  # fp32 rows sent as they are, as bf16, as scaled fp16


def traffic(ctx, plan, row_bytes: int) -> tuple[int, int, int]:
    """(messages this rank sends with a non-empty payload, bytes it sends to other ranks, bytes it
    sends to other nodes) for one exchange, counted from the plan's split sizes."""
    if ctx.all_to_all == "flat":
        others = [(p, n) for p, n in enumerate(plan.send) if ctx.ep_ranks[p] != ctx.rank]
        messages = sum(1 for _, n in others if n)
        sent = sum(n for _, n in others)
        cross = sum(n for p, n in others if ctx.ep_ranks[p] // ctx.local_world_size != ctx.node)
        return messages, sent * row_bytes, cross * row_bytes
    nodes, per_node = ctx.ep_node_grid
    my_m, my_l = divmod(ctx.ep_rank, per_node)
    intra = [n for lp, n in enumerate(plan.intra_send) if lp != my_l]
    inter = [n for mp_, n in enumerate(plan.inter_send) if mp_ != my_m]
    messages = sum(1 for n in intra + inter if n)
    return messages, (sum(intra) + sum(inter)) * row_bytes, sum(inter) * row_bytes


def worker(rank: int, args, out_path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    contexts = {
        algo: ParallelContext(ep_size=WORLD, all_to_all=algo, local_world_size=LOCAL)
        for algo in ("flat", "hierarchical")
    }
    hidden = 32
    rows_out = []
    for size_kib in SIZES_KIB:
        rows = max(WORLD, size_kib * 1024 // (4 * hidden))
        counts = torch.full((WORLD, 1), rows // WORLD)
        x = torch.randn(int(counts.sum()), hidden)
        for wire in WIRES:
            comm_dtype = None if wire == "fp32" else wire
            row_bytes = {"fp32": 4 * hidden, "bf16": 2 * hidden, "fp16": 2 * (hidden + 1)}[wire]
            for algo, ctx in contexts.items():
                _, plan = exchange_counts(counts, ctx)
                samples = []
                for i in range(args.warmup + args.repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    all_to_all_reverse(all_to_all(x, plan, comm_dtype), plan, comm_dtype)
                    elapsed = torch.tensor([time.perf_counter() - start])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if i >= args.warmup:
                        samples.append(float(elapsed))
                messages, sent, cross = traffic(ctx, plan, row_bytes)
                rows_out.append(
                    {
                        "algorithm": algo,
                        "wire": wire,
                        "payload_bytes": int(x.numel() * x.element_size()),
                        "round_trip_ms": 1e3 * statistics.median(samples),
                        "messages_per_rank": 2 * messages,
                        "sent_bytes": 2 * sent,
                        "cross_node_bytes_per_rank": 2 * cross,
                    }
                )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)
    dist.destroy_process_group()


def fit_alpha_beta(rows) -> tuple[float, float]:
    """Least squares of ``t = alpha * messages + beta * bytes_sent`` (a rank's bytes over all stages)."""
    a = torch.tensor([[r["messages_per_rank"], r["sent_bytes"]] for r in rows], dtype=torch.float64)
    t = torch.tensor([r["round_trip_ms"] * 1e-3 for r in rows], dtype=torch.float64)
    solution = torch.linalg.lstsq(a, t.unsqueeze(1)).solution.view(-1)
    return float(solution[0]), float(solution[1])


def predict(
    nodes: int, per_node: int, payload: float, alpha: float, beta_intra: float, beta_inter: float
) -> dict:
    """Round-trip time of each algorithm for a per-rank payload at nodes x per_node ranks.

    ``beta_inter`` is the seconds per byte of a node's link to the others, which the node's
    ``per_node`` ranks share: each rank's inter-node bytes cost ``per_node * beta_inter``."""
    p = nodes * per_node
    shared_inter = per_node * beta_inter
    flat = 2 * (
        (p - 1) * alpha
        + payload * (per_node - 1) / p * beta_intra
        + payload * (p - per_node) / p * shared_inter
    )
    hier = 2 * (
        (per_node - 1) * alpha
        + payload * (per_node - 1) / per_node * beta_intra  # intra-node stage
        + (nodes - 1) * alpha
        + payload * (nodes - 1) / nodes * shared_inter  # inter-node stage
    )
    return {"flat_ms": 1e3 * flat, "hierarchical_ms": 1e3 * hier, "speedup": flat / hier}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--inter-node-gbps", type=float, default=35.0, help="inter-node link for the prediction"
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(worker, args=(args, out_path, port), nprocs=WORLD, join=True)
        with open(out_path) as f:
            rows = json.load(f)

    alpha, beta = fit_alpha_beta([r for r in rows if r["wire"] == "fp32"])
    print(
        f"all-to-all round trip (exchange + reverse), world {WORLD} = 2 nodes x {LOCAL} ranks, "
        "gloo on loopback"
    )
    header = [
        "payload",
        "wire",
        "flat ms",
        "hier ms",
        "flat/hier",
        "msgs flat",
        "msgs hier",
        "x-node B flat",
        "x-node B hier",
    ]
    print(" | ".join(f"{h:>13}" for h in header))
    table = []
    for size in sorted({r["payload_bytes"] for r in rows}):
        for wire in WIRES:
            pair = {r["algorithm"]: r for r in rows if r["payload_bytes"] == size and r["wire"] == wire}
            if len(pair) < 2:
                continue
            f, h = pair["flat"], pair["hierarchical"]
            line = [
                f"{size / 1024:.0f} KiB",
                wire,
                f"{f['round_trip_ms']:.3f}",
                f"{h['round_trip_ms']:.3f}",
                f"{f['round_trip_ms'] / h['round_trip_ms']:.2f}",
                f["messages_per_rank"],
                h["messages_per_rank"],
                f["cross_node_bytes_per_rank"],
                h["cross_node_bytes_per_rank"],
            ]
            table.append(line)
            print(" | ".join(f"{v!s:>13}" for v in line))
    print(
        f"\nalpha-beta fit over the {len(rows) // len(WIRES)} fp32-wire measurements: "
        f"alpha = {alpha * 1e6:.1f} us/message, "
        f"beta = {beta * 1e9:.3f} ns/byte ({1 / beta / 1e9 if beta > 0 else float('inf'):.2f} GB/s)"
    )
    beta_inter = 8 / (args.inter_node_gbps * 1e9)
    predictions = {}
    for payload_mib in (1, 16):
        pred = predict(60, 8, payload_mib * 2**20, alpha, beta, beta_inter)
        predictions[f"{payload_mib}MiB"] = pred
        print(
            f"model at 60 nodes x 8 (fitted alpha, fitted beta inside a node, {args.inter_node_gbps:g} Gb/s "
            f"per node shared by its 8 ranks), {payload_mib} MiB per rank: flat {pred['flat_ms']:.1f} ms, "
            f"hierarchical {pred['hierarchical_ms']:.1f} ms, {pred['speedup']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "all_to_all",
                    "rows": rows,
                    "alpha_s": alpha,
                    "beta_s_per_byte": beta,
                    "prediction_60x8": predictions,
                },
                f,
                indent=2,
            )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
