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

``--node-limited``: instead, what node-limited routing (``max_nodes_per_token``) changes in the
exchanges, at world 8 as 2 nodes x 4 ranks and as 4 nodes x 2, for the three algorithms. Every rank
routes 4,096 random tokens through a real ``MoELayer`` (32 experts, top-4, d_model 64; the same
random weights on every rank and for every algorithm: orthonormal router rows, which make every
choice of 4 experts equally likely, or the router's own N(0, 0.02) initialisation) and runs one
forward + backward with ``all_to_all`` = flat, hierarchical and node_dedup, while a wrapper of
``dist.all_to_all_single`` counts, from the split sizes of every call, the rows and bytes each rank
sends to ranks on other nodes. Compared with the planner's expectation
(:mod:`moetrain.planner.node_limit`): the per-slot algorithms send ``K (N - 1) / N`` rows per token
across whatever the limit; node_dedup sends one copy per other node a token reaches,
``remote_nodes_per_token``. Then the layer's forward + backward is timed for each algorithm
(orthonormal router only). On loopback every hop costs the same, so the time ratio shows the extra
work and messages of the dedup path, not the inter-node bandwidth it saves.
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


NL_EXPERTS, NL_TOP_K, NL_DIM, NL_FF, NL_TOKENS = 32, 4, 64, 32, 4096
NL_GRIDS = (4, 2)  # ranks per node: 2 nodes x 4, 4 nodes x 2
NL_LIMITS = (None, 1, 2)
NL_ALGORITHMS = ("flat", "hierarchical", "node_dedup")


class CrossNodeCounter:
    """Wraps ``dist.all_to_all_single`` and logs, per call, the rows and bytes this rank sends to
    ranks on other nodes (from the split sizes it is called with: what really travels), whether
    its group spans nodes, and the payload dtype."""

    def __init__(self, local_world_size: int):
        self.local = local_world_size
        self.calls: list[dict] = []
        self.node = dist.get_rank() // local_world_size
        self._original = dist.all_to_all_single

    def __enter__(self):
        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(WORLD))
            splits = input_split_sizes or [input.shape[0] // len(ranks)] * len(ranks)
            row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
            cross = sum(n for rank, n in zip(ranks, splits, strict=True) if rank // self.local != self.node)
            spans = len({rank // self.local for rank in ranks}) > 1
            self.calls.append({"dtype": input.dtype, "cross_rows": cross, "cross_bytes": cross * row_bytes,
                               "spans_nodes": spans})  # fmt: skip
            return self._original(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original

    def dispatch_cross_rows(self) -> int:
        """Rows of the forward's first token exchange across nodes (int64 calls carry counts)."""
        return next(c["cross_rows"] for c in self.calls if c["spans_nodes"] and c["dtype"] != torch.int64)


def _node_limited_layer(config, ctx, weights: str) -> MoELayer:
    torch.manual_seed(0)  # the same router and experts on every rank and for every algorithm
    layer = MoELayer(config, parallel=ctx)
    if weights == "orthonormal":
        with torch.no_grad():
            basis = torch.linalg.qr(torch.randn(NL_DIM, NL_EXPERTS))[0]  # orthonormal columns
            layer.router.weight.copy_(basis.t())
    return layer


def _layer_ms(layer, x, upstream, args) -> float:
    """Median over ``args.repeats`` of one forward + backward (the slowest rank's time)."""
    samples = []
    for i in range(args.warmup + args.repeats):
        xi = x.clone().requires_grad_(True)
        dist.barrier()
        start = time.perf_counter()
        layer(xi).backward(upstream)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            samples.append(float(elapsed))
    return 1e3 * statistics.median(samples)


def node_limited_worker(rank: int, args, out_path: str, port: int) -> None:
    """Routes, exchanges, counts and times (module docstring) for every grid, router weights, limit
    and algorithm; rank 0 writes the totals over the 8 ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    rows_out = []
    for local in NL_GRIDS:
        contexts = {
            algo: ParallelContext(ep_size=WORLD, all_to_all=algo, local_world_size=local)
            for algo in NL_ALGORITHMS
        }
        nodes, per_node = contexts["flat"].ep_node_grid
        for weights in ("orthonormal", "default"):
            for limit in NL_LIMITS:
                config = MoEConfig(d_model=NL_DIM, d_ff=NL_FF, num_experts=NL_EXPERTS, top_k=NL_TOP_K,
                                   capacity_factor=None, max_nodes_per_token=limit)  # fmt: skip
                g = torch.Generator().manual_seed(100 + rank)
                x, upstream = (
                    torch.randn(NL_TOKENS, NL_DIM, generator=g),
                    torch.randn(NL_TOKENS, NL_DIM, generator=g),
                )
                row = {
                    "nodes": nodes,
                    "ranks_per_node": per_node,
                    "weights": weights,
                    "max_nodes_per_token": limit,
                }
                for algo, ctx in contexts.items():
                    layer = _node_limited_layer(config, ctx, weights)
                    with CrossNodeCounter(local) as counter:
                        layer(x.clone().requires_grad_(True)).backward(upstream)
                    totals = torch.tensor(
                        [counter.dispatch_cross_rows(), sum(c["cross_bytes"] for c in counter.calls)],
                        dtype=torch.float64,
                    )
                    dist.all_reduce(totals)
                    row[f"{algo}_dispatch_cross_rows_per_token"] = float(totals[0]) / (WORLD * NL_TOKENS)
                    row[f"{algo}_cross_node_bytes_per_rank"] = float(totals[1]) / WORLD
                    if weights == "orthonormal":
                        row[f"{algo}_layer_ms"] = _layer_ms(layer, x, upstream, args)
                with torch.no_grad():
                    expert_ids = layer.router(x).expert_ids_TK
                node_TK = expert_ids // (NL_EXPERTS // nodes)
                reached_TN = torch.zeros(NL_TOKENS, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
                remote = torch.tensor([float(reached_TN.sum() - reached_TN[:, rank // per_node].sum())])
                span = torch.tensor([int(reached_TN.sum(1).max())])
                dist.all_reduce(remote)
                dist.all_reduce(span, op=dist.ReduceOp.MAX)
                row.update(
                    limit_binds=layer.router.limits_nodes,
                    remote_nodes_per_token=float(remote) / (WORLD * NL_TOKENS),
                    expected_cross_node_rows_per_token=NL_TOP_K * cross_node_row_share(nodes),
                    expected_remote_nodes_per_token=remote_nodes_per_token(
                        NL_EXPERTS, NL_TOP_K, nodes, 1, limit
                    ),
                    expected_is_bound=layer.router.limits_nodes and limit > 1,
                    # 4 row trips of w bytes per copy vs per slot, + 12 K bytes of ids and gates per copy
                    expected_dedup_byte_ratio=remote_nodes_per_token(NL_EXPERTS, NL_TOP_K, nodes, 1, limit)
                    / (NL_TOP_K * cross_node_row_share(nodes))
                    * (1 + 3 * NL_TOP_K / (4 * NL_DIM)),  # fp32 rows: w = 4 * NL_DIM bytes
                    max_nodes_reached=int(span),
                )
                rows_out.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)
    dist.destroy_process_group()


def _limit_label(r) -> str:
    limit = "none" if r["max_nodes_per_token"] is None else str(r["max_nodes_per_token"])
    return limit + (" (no-op)" if r["max_nodes_per_token"] is not None and not r["limit_binds"] else "")


def print_node_limited(rows) -> None:
    print(
        f"node-limited routing at world {WORLD}: {NL_TOKENS} tokens per rank, {NL_EXPERTS} experts, "
        f"top-{NL_TOP_K}, fp32 rows of {4 * NL_DIM} B, one MoELayer forward + backward; totals over the "
        f"{WORLD} ranks, counted from the split sizes of every all_to_all_single call"
    )
    print(
        "per-slot x-node rows/token: rows of the dispatch exchange a token sends to other nodes by flat (and "
        "hierarchical: the same); dedup copies/token: the same for node_dedup (one per other node "
        "reached); x-node KiB/rank: every exchange of the forward and backward, counts included"
    )
    header = ["grid", "weights", "limit", "per-slot/tok", "expected", "dedup/tok", "expected",
              "KiB flat", "KiB hier", "KiB dedup", "dedup/flat", "expected", "max nodes"]  # fmt: skip
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        expected = f"{'<= ' if r['expected_is_bound'] else ''}{r['expected_remote_nodes_per_token']:.4f}"
        line = [
            f"{r['nodes']} x {r['ranks_per_node']}",
            r["weights"],
            _limit_label(r),
            f"{r['flat_dispatch_cross_rows_per_token']:.4f}",
            f"{r['expected_cross_node_rows_per_token']:.4f}",
            f"{r['node_dedup_dispatch_cross_rows_per_token']:.4f}",
            expected,
            f"{r['flat_cross_node_bytes_per_rank'] / 1024:.0f}",
            f"{r['hierarchical_cross_node_bytes_per_rank'] / 1024:.0f}",
            f"{r['node_dedup_cross_node_bytes_per_rank'] / 1024:.0f}",
            f"{r['node_dedup_cross_node_bytes_per_rank'] / r['flat_cross_node_bytes_per_rank']:.3f}",
            f"{'<= ' if r['expected_is_bound'] else ''}{r['expected_dedup_byte_ratio']:.3f}",
            r["max_nodes_reached"],
        ]
        print(" | ".join(f"{v!s:>12}" for v in line))
    print("\ntime per layer (forward + backward, median, slowest rank), orthonormal router, gloo on loopback")
    header = ["grid", "limit", "flat ms", "hier ms", "dedup ms", "dedup/flat", "dedup/hier"]
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        if "flat_layer_ms" not in r:
            continue
        flat, hier, dedup = r["flat_layer_ms"], r["hierarchical_layer_ms"], r["node_dedup_layer_ms"]
        line = [f"{r['nodes']} x {r['ranks_per_node']}", _limit_label(r), f"{flat:.1f}", f"{hier:.1f}",
                f"{dedup:.1f}", f"{dedup / flat:.2f}", f"{dedup / hier:.2f}"]  # fmt: skip
        print(" | ".join(f"{v!s:>12}" for v in line))


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
        "--node-limited",
        action="store_true",
        help="count and time what max_nodes_per_token changes for flat, hierarchical and node_dedup",
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
