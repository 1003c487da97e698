"""What node-limited routing (``max_nodes_per_token``) changes in the expert-parallel exchanges, at
world 8 as 2 nodes x 4 ranks and as 4 nodes x 2, for the three all-to-all algorithms (gloo, CPU).

Every rank routes 4,096 random tokens through a real ``MoELayer`` (32 experts, top-4, d_model 64;
the same random weights on every rank and for every algorithm: orthonormal router rows, which make
every choice of 4 experts equally likely, or the router's own N(0, 0.02) initialisation) and runs one
forward + backward with ``all_to_all`` = flat, hierarchical and node_dedup, while a wrapper of
``dist.all_to_all_single`` counts, from the split sizes of every call, the rows and bytes each rank
sends to ranks on other nodes. Compared with the planner's expectation
(:mod:`moetrain.planner.node_limit`): the per-slot algorithms send ``K (N - 1) / N`` rows per token
across whatever the limit; node_dedup sends one copy per other node a token reaches,
``remote_nodes_per_token``. Then the layer's forward + backward is timed for each algorithm
(orthonormal router only), the three interleaved: each of ``--repeats`` rounds (after ``--warmup``)
runs flat, hierarchical and node_dedup once, in turn, so drift of the machine hits them alike; the
times are medians over the rounds and the ratios medians of the per-round ratios. On loopback every
hop costs the same, so the time ratio shows the extra work and messages of the dedup path, not the
inter-node bandwidth it saves.

Usage: ``python benchmarks/node_limited.py [--json PATH] [--repeats N] [--warmup N]``.
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
from moetrain.planner.node_limit import cross_node_row_share, remote_nodes_per_token

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import nonnegative_int, output_path, positive_int, write_json  # noqa: E402

WORLD = 8


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
    layer = shard_experts(MoELayer(config), ctx)
    if weights == "orthonormal":
        with torch.no_grad():
            basis = torch.linalg.qr(torch.randn(NL_DIM, NL_EXPERTS))[0]  # orthonormal columns
            layer.router.weight.copy_(basis.t())
    return layer


def _layers_ms(layers: dict[str, MoELayer], x, upstream, args) -> dict[str, list[float]]:
    """Milliseconds of one forward + backward (the slowest rank's time) of each layer, per round:
    ``args.warmup`` untimed rounds, then ``args.repeats`` timed ones, every round running each layer
    once, in turn."""
    samples = {name: [] for name in layers}
    for i in range(args.warmup + args.repeats):
        for name, layer in layers.items():
            xi = x.clone().requires_grad_(True)
            dist.barrier()
            start = time.perf_counter()
            layer(xi).backward(upstream)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                samples[name].append(1e3 * float(elapsed))
    return samples


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
                layers = {}
                for algo, ctx in contexts.items():
                    layer = layers[algo] = _node_limited_layer(config, ctx, weights)
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
                    samples = _layers_ms(layers, x, upstream, args)
                    for algo, times in samples.items():
                        row[f"{algo}_layer_ms"] = statistics.median(times)
                    for name, base in (("flat", "flat"), ("hier", "hierarchical")):
                        row[f"dedup_over_{name}"] = statistics.median(
                            d / b for d, b in zip(samples["node_dedup"], samples[base], strict=True)
                        )
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
    print(
        "\ntime per layer (forward + backward, median, slowest rank), orthonormal router, gloo on loopback; "
        "the three interleaved round by round, ratios: median of the per-round ratios"
    )
    header = ["grid", "limit", "flat ms", "hier ms", "dedup ms", "dedup/flat", "dedup/hier"]
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        if "flat_layer_ms" not in r:
            continue
        flat, hier, dedup = r["flat_layer_ms"], r["hierarchical_layer_ms"], r["node_dedup_layer_ms"]
        line = [f"{r['nodes']} x {r['ranks_per_node']}", _limit_label(r), f"{flat:.1f}", f"{hier:.1f}",
                f"{dedup:.1f}", f"{r['dedup_over_flat']:.2f}", f"{r['dedup_over_hier']:.2f}"]  # fmt: skip
        print(" | ".join(f"{v!s:>12}" for v in line))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--warmup", type=nonnegative_int, default=2)
    parser.add_argument("--json", metavar="PATH", type=output_path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(node_limited_worker, args=(args, out_path, free_port()), nprocs=WORLD, join=True)
        with open(out_path) as f:
            rows = json.load(f)
    print_node_limited(rows)
    if args.json:
        write_json(args.json, {"benchmark": "all_to_all_node_limited", "rows": rows})


if __name__ == "__main__":
    main()
