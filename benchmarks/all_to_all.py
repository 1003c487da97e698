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

``--node-limited``: instead, counts what node-limited routing (``max_nodes_per_token``) changes in
the exchange, at world 8 as 2 nodes x 4 ranks and as 4 nodes x 2. Every rank routes 4,096 random
tokens through the router of a real ``MoELayer`` (32 experts, top-4; the same random weights on
every rank: orthonormal rows, which make every choice of 4 experts equally likely, or the router's
own N(0, 0.02) initialisation), builds the dispatch plan, exchanges counts and rows with the EP
group (flat and hierarchical), and counts from the plan's split sizes the rows it sends to ranks on
other nodes, and from the expert ids the other nodes each token reaches (what a dispatch sending
a token once per node would send across). Both are compared with the planner's expectation
(:mod:`moetrain.planner.node_limit`): ``(N - 1) / N`` of the rows cross nodes whatever the limit,
and ``remote_nodes_per_token``.
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

from moetrain import MoEConfig, MoELayer
from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, exchange_counts
from moetrain.layers.dispatch import build_dispatch_plan
from moetrain.parallel import ParallelContext
from moetrain.planner.node_limit import cross_node_row_share, remote_nodes_per_token

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


NL_EXPERTS, NL_TOP_K, NL_DIM, NL_TOKENS = 32, 4, 64, 4096
NL_GRIDS = (4, 2)  # ranks per node: 2 nodes x 4, 4 nodes x 2
NL_LIMITS = (None, 1, 2)


def node_limited_worker(rank: int, args, out_path: str, port: int) -> None:
    """Routes, exchanges and counts (module docstring) for every grid, algorithm, router weights
    and limit; rank 0 writes the totals over the 8 ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    rows_out = []
    for local in NL_GRIDS:
        for algo in ("flat", "hierarchical"):
            ctx = ParallelContext(ep_size=WORLD, all_to_all=algo, local_world_size=local)
            nodes, per_node = ctx.ep_node_grid
            for weights in ("orthonormal", "default"):
                for limit in NL_LIMITS:
                    config = MoEConfig(d_model=NL_DIM, d_ff=8, num_experts=NL_EXPERTS, top_k=NL_TOP_K,
                                       capacity_factor=None, max_nodes_per_token=limit)  # fmt: skip
                    torch.manual_seed(0)  # the same router on every rank
                    layer = MoELayer(config, parallel=ctx)
                    if weights == "orthonormal":
                        with torch.no_grad():
                            basis = torch.linalg.qr(torch.randn(NL_DIM, NL_EXPERTS))[0]  # orthonormal columns
                            layer.router.weight.copy_(basis.t())
                    x = torch.randn(NL_TOKENS, NL_DIM, generator=torch.Generator().manual_seed(100 + rank))
                    with torch.no_grad():
                        expert_ids = layer.router(x).expert_ids_TK
                    plan = build_dispatch_plan(expert_ids, NL_EXPERTS, None)
                    _, a2a = exchange_counts(plan.kept_per_expert_E.view(WORLD, -1), ctx)
                    all_to_all(torch.zeros(a2a.rows_sent, NL_DIM), a2a)  # the rows really travel
                    _, _, cross_bytes = traffic(ctx, a2a, 4 * NL_DIM)
                    node_TK = expert_ids // (NL_EXPERTS // nodes)
                    reached_TN = torch.zeros(NL_TOKENS, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
                    remote = reached_TN.sum() - reached_TN[:, ctx.ep_rank // per_node].sum()
                    totals = torch.tensor(
                        [
                            cross_bytes // (4 * NL_DIM),
                            NL_TOKENS * NL_TOP_K,
                            int(remote),
                            NL_TOKENS,
                            cross_bytes,
                        ],
                        dtype=torch.float64,
                    )
                    dist.all_reduce(totals)
                    span = torch.tensor([int(reached_TN.sum(1).max())])
                    dist.all_reduce(span, op=dist.ReduceOp.MAX)
                    cross_rows, rows, remote_copies, tokens, cross_total = totals.tolist()
                    rows_out.append(
                        {
                            "nodes": nodes,
                            "ranks_per_node": per_node,
                            "algorithm": algo,
                            "weights": weights,
                            "max_nodes_per_token": limit,
                            "limit_binds": layer.router.limits_nodes,
                            "cross_node_row_share": cross_rows / rows,
                            "expected_cross_node_row_share": cross_node_row_share(nodes),
                            "cross_node_bytes_per_rank": cross_total / WORLD,
                            "remote_nodes_per_token": remote_copies / tokens,
                            "expected_remote_nodes_per_token": remote_nodes_per_token(
                                NL_EXPERTS, NL_TOP_K, nodes, 1, limit
                            ),
                            "expected_is_bound": layer.router.limits_nodes and limit > 1,
                            "max_nodes_reached": int(span),
                        }
                    )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)
    dist.destroy_process_group()


def print_node_limited(rows) -> None:
    print(
        f"node-limited routing at world {WORLD}: {NL_TOKENS} tokens per rank, {NL_EXPERTS} experts, "
        f"top-{NL_TOP_K}, fp32 rows of {4 * NL_DIM} B; totals over the {WORLD} ranks"
    )
    print(
        "x-node rows: share of the routed rows sent to another node (expected: (N-1)/N); remote/token: "
        "other nodes a token reaches; max nodes: the most nodes any token reached"
    )
    header = ["grid", "algorithm", "weights", "limit", "x-node rows", "expected", "x-node B/rank",
              "remote/token", "expected", "max nodes"]  # fmt: skip
    print(" | ".join(f"{h:>13}" for h in header))
    for r in rows:
        limit = "none" if r["max_nodes_per_token"] is None else str(r["max_nodes_per_token"])
        if r["max_nodes_per_token"] is not None and not r["limit_binds"]:
            limit += " (no-op)"
        expected = f"{'<= ' if r['expected_is_bound'] else ''}{r['expected_remote_nodes_per_token']:.4f}"
        line = [
            f"{r['nodes']} x {r['ranks_per_node']}",
            r["algorithm"],
            r["weights"],
            limit,
            f"{r['cross_node_row_share']:.4f}",
            f"{r['expected_cross_node_row_share']:.4f}",
            f"{r['cross_node_bytes_per_rank']:.0f}",
            f"{r['remote_nodes_per_token']:.4f}",
            expected,
            r["max_nodes_reached"],
        ]
        print(" | ".join(f"{v!s:>13}" for v in line))


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
    parser.add_argument(
        "--node-limited", action="store_true", help="count what max_nodes_per_token changes (no timing)"
    )
    args = parser.parse_args()
    port = _free_port()
    if args.node_limited:
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "rows.json")
            mp.spawn(node_limited_worker, args=(args, out_path, port), nprocs=WORLD, join=True)
            with open(out_path) as f:
                rows = json.load(f)
        print_node_limited(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "all_to_all_node_limited", "rows": rows}, f, indent=2)
        return
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
