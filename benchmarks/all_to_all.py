"""Flat vs hierarchical (2-D) all-to-all, on loopback or on an emulated two-node cluster.

Loopback (default): world 8 emulated as 2 nodes x 4 ranks on this machine (gloo, every link the
same). ``--emulated-mbit R``: the ranks run in two network namespaces joined by a link limited to R
Mbit/s per direction (``benchmarks/emulated_cluster.py``, root only), so the inter-node link is
slow and intra-node traffic is not; several rates may be given.

For per-rank payloads of fp32 rows it measures the round trip (exchange + reverse, as in MoE
dispatch + combine) of both algorithms on three wires: fp32 as is, ``comm_dtype="bf16"`` and
``comm_dtype="fp16"`` (scaled), the last two including their encode and decode, and counts per rank
the messages sent, the bytes to ranks of the same node and the bytes its node sends to the other.
Every case is warmed up first; then each measured round runs every case once, in turn, so machine
drift hits all cases alike (a median over rounds).

Fit (fp32-wire rows, least squares weighted by 1/t): emulated, one fit over every rate, ``t = alpha
* messages + beta_intra * intra_bytes + beta_inter[rate] * node_inter_bytes`` where
``node_inter_bytes`` is what the rank's node sends across (its ranks share the link);
``beta_inter`` times the nominal rate is the link's efficiency (TCP and tbf overheads). Loopback:
alpha and one beta for every byte. Each fit is carried to 60 nodes x 8 with a 35 Gb/s node link at
that efficiency (at most 100%): what this CPU cluster's constants would give at that scale.

Usage: ``python benchmarks/all_to_all.py [--emulated-mbit R ...] [--ranks-per-node L] [--json PATH]``.
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

from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, exchange_counts
from moetrain.launch import free_port
from moetrain.parallel import ParallelContext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import existing_file, nonnegative_int, output_path, positive_float, positive_int, write_json  # noqa: E402
from emulated_cluster import can_emulate, run_on_emulated_cluster  # noqa: E402

LOOPBACK_WORLD, LOOPBACK_LOCAL = 8, 4
SIZES_KIB = {"loopback": [4, 64, 1024, 16384], "emulated": [16, 256, 1024, 4096]}
WIRES = ("fp32", "bf16", "fp16")  # fp32 rows sent as they are, as bf16, as scaled fp16
HIDDEN = 32


def traffic(ctx, plan, row_bytes: int) -> tuple[int, int, int]:
    """(messages this rank sends with a non-empty payload, bytes it sends to ranks of its node,
    bytes it sends to other nodes) for one exchange, from the plan's split sizes."""
    if ctx.all_to_all == "flat":
        others = [(p, n) for p, n in enumerate(plan.send) if ctx.ep_ranks[p] != ctx.rank]
        cross = sum(n for p, n in others if ctx.ep_ranks[p] // ctx.local_world_size != ctx.node)
        return (
            sum(1 for _, n in others if n),
            (sum(n for _, n in others) - cross) * row_bytes,
            cross * row_bytes,
        )
    nodes, per_node = ctx.ep_node_grid
    my_m, my_l = divmod(ctx.ep_rank, per_node)
    intra = [n for lp, n in enumerate(plan.intra_send) if lp != my_l]
    inter = [n for mp_, n in enumerate(plan.inter_send) if mp_ != my_m]
    return sum(1 for n in intra + inter if n), sum(intra) * row_bytes, sum(inter) * row_bytes


def measure(rank: int, world: int, local: int, args, sizes_kib: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    contexts = {
        algo: ParallelContext(ep_size=world, all_to_all=algo, local_world_size=local)
        for algo in ("flat", "hierarchical")
    }
    cases = []
    for size_kib in sizes_kib:
        rows = max(world, size_kib * 1024 // (4 * HIDDEN))
        counts = torch.full((world, 1), rows // world)
        x = torch.randn(int(counts.sum()), HIDDEN)
        for wire in WIRES:
            for algo, ctx in contexts.items():
                _, plan = exchange_counts(counts, ctx)
                cases.append((size_kib, wire, algo, ctx, plan, x))

    def round_trip(case) -> float:
        _, wire, _, _, plan, x = case
        comm_dtype = None if wire == "fp32" else wire
        dist.barrier()
        start = time.perf_counter()
        all_to_all_reverse(all_to_all(x, plan, comm_dtype), plan, comm_dtype)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for case in cases:  # every case warmed up before any is measured
        for _ in range(args.warmup):
            round_trip(case)
    samples = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, case in enumerate(cases):
            samples[i].append(round_trip(case))
    rows_out = []
    for case, times in zip(cases, samples, strict=True):
        _, wire, algo, ctx, plan, x = case
        row_bytes = {"fp32": 4 * HIDDEN, "bf16": 2 * HIDDEN, "fp16": 2 * (HIDDEN + 1)}[wire]
        messages, intra, cross = traffic(ctx, plan, row_bytes)
        rows_out.append(
            {
                "algorithm": algo,
                "wire": wire,
                "payload_bytes": int(x.numel() * x.element_size()),
                "round_trip_ms": 1e3 * statistics.median(times),
                "messages_per_rank": 2 * messages,
                "intra_bytes_per_rank": 2 * intra,
                "cross_node_bytes_per_rank": 2 * cross,
                "node_inter_bytes": 2 * cross * local,
            }
        )
    return rows_out


def _spawned(rank: int, args, out_path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=LOOPBACK_WORLD, timeout=timedelta(seconds=300))
    rows = measure(rank, LOOPBACK_WORLD, LOOPBACK_LOCAL, args, args.sizes_kib or SIZES_KIB["loopback"])
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _launched(args) -> None:
    """One rank of an emulated-cluster run (torchrun's variables set by the launcher)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    rows = measure(rank, world, local, args, args.sizes_kib or SIZES_KIB["emulated"])
    if rank == 0:
        Path(args.worker).write_text(json.dumps(rows))
    dist.destroy_process_group()


def fit_loopback(rows: list[dict]) -> dict:
    """Loopback: intra- and inter-node bytes take the same path, so one beta per rank's bytes:
    ``t = alpha * messages + beta * (intra_bytes + cross_node_bytes)``, weighted by ``1 / t``."""
    a = torch.tensor(
        [[r["messages_per_rank"], r["intra_bytes_per_rank"] + r["cross_node_bytes_per_rank"]] for r in rows],
        dtype=torch.float64,
    )
    t = torch.tensor([r["round_trip_ms"] * 1e-3 for r in rows], dtype=torch.float64)
    weight = (1 / t).unsqueeze(1)
    alpha, beta = torch.linalg.lstsq(a * weight, t.unsqueeze(1) * weight).solution.view(-1).tolist()
    return {"alpha_s": alpha, "beta_intra_s_per_byte": beta, "beta_inter_s_per_byte": beta}


def joint_fit(runs: dict[str, list[dict]]) -> dict:
    """One least-squares fit over the fp32-wire rows of every emulated run: ``t = alpha * messages +
    beta_intra * intra_bytes + beta_inter[rate] * node_inter_bytes``, one ``beta_inter`` per link
    rate and one alpha and beta_intra for all (more rows than per run, so steadier), each row
    weighted by ``1 / t``."""
    names = sorted(runs)
    features, times = [], []
    for i, name in enumerate(names):
        for r in runs[name]:
            if r["wire"] != "fp32":
                continue
            inter = [0.0] * len(names)
            inter[i] = r["node_inter_bytes"]
            features.append([r["messages_per_rank"], r["intra_bytes_per_rank"], *inter])
            times.append(r["round_trip_ms"] * 1e-3)
    a, t = torch.tensor(features, dtype=torch.float64), torch.tensor(times, dtype=torch.float64)
    weight = (1 / t).unsqueeze(1)
    solution = torch.linalg.lstsq(a * weight, t.unsqueeze(1) * weight).solution.view(-1).tolist()
    return {
        "alpha_s": solution[0],
        "beta_intra_s_per_byte": solution[1],
        "beta_inter_s_per_byte": dict(zip(names, solution[2:], strict=True)),
    }


def fit_links(rows: list[dict]) -> dict:
    """Least squares of ``t = alpha * messages + beta_intra * intra_bytes + beta_inter *
    node_inter_bytes`` (seconds, bytes) over ``rows``, each row weighted by ``1 / t`` (relative
    errors: the small payloads, which carry alpha, count as much as the large ones)."""
    a = torch.tensor(
        [[r["messages_per_rank"], r["intra_bytes_per_rank"], r["node_inter_bytes"]] for r in rows],
        dtype=torch.float64,
    )
    t = torch.tensor([r["round_trip_ms"] * 1e-3 for r in rows], dtype=torch.float64)
    weight = (1 / t).unsqueeze(1)
    solution = torch.linalg.lstsq(a * weight, (t.unsqueeze(1) * weight)).solution
    alpha, beta_intra, beta_inter = solution.view(-1).tolist()
    return {"alpha_s": alpha, "beta_intra_s_per_byte": beta_intra, "beta_inter_s_per_byte": beta_inter}


def predict(
    nodes: int, per_node: int, payload: float, alpha: float, beta_intra: float, beta_inter: float
) -> dict:
    """Round-trip time of each algorithm for a per-rank payload at nodes x per_node ranks;
    ``beta_inter``: seconds per byte of a node's link, which its ``per_node`` ranks share."""
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


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    header = ["payload", "wire", "flat ms", "hier ms", "flat/hier", "msgs flat", "msgs hier", "x-node B/rank"]
    print(" | ".join(f"{h:>13}" for h in header))
    for size in sorted({r["payload_bytes"] for r in rows}):
        for wire in WIRES:
            pair = {r["algorithm"]: r for r in rows if r["payload_bytes"] == size and r["wire"] == wire}
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
            ]
            print(" | ".join(f"{v!s:>13}" for v in line))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument(
        "--emulated-mbit", type=positive_float, nargs="*", help="inter-node link rates to emulate"
    )
    parser.add_argument("--ranks-per-node", type=positive_int, default=2, help="emulated cluster only")
    parser.add_argument(
        "--inter-node-gbps", type=positive_float, default=35.0, help="node link of the 60x8 prediction"
    )
    parser.add_argument(
        "--sizes-kib", type=positive_int, nargs="+", help="payloads per rank (default: per mode)"
    )
    parser.add_argument("--json", metavar="PATH", type=output_path)
    parser.add_argument(
        "--report", metavar="JSON", type=existing_file, help="print the tables and fits of a saved --json run"
    )
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)  # a launched rank
    args = parser.parse_args()
    if args.worker:
        _launched(args)
        return
    if args.report:
        report(json.loads(Path(args.report).read_text())["runs"], args)
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        if args.emulated_mbit:
            problem = can_emulate()
            if problem is not None:
                parser.error(f"--emulated-mbit: cannot emulate the cluster: {problem}")
            for rate in args.emulated_mbit:
                forwarded = ["--worker", out, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
                if args.sizes_kib:
                    forwarded += ["--sizes-kib", *map(str, args.sizes_kib)]
                code = run_on_emulated_cluster(
                    [__file__, *forwarded], args.ranks_per_node, rate, timeout_s=3000
                )
                if code != 0:
                    raise SystemExit(f"a rank failed with exit status {code}")
                rows = json.loads(Path(out).read_text())
                runs[f"{rate:g}mbit"] = {"rows": rows, "ranks_per_node": args.ranks_per_node}
        else:
            mp.spawn(_spawned, args=(args, out, free_port()), nprocs=LOOPBACK_WORLD, join=True)
            runs["loopback"] = {"rows": json.loads(Path(out).read_text()), "ranks_per_node": LOOPBACK_LOCAL}
    report(runs, args)


def report(runs: dict[str, dict], args) -> None:
    """Prints each run's table (``runs[name]``: its ``rows`` and the ``ranks_per_node`` it ran with;
    a file saved before that was recorded takes ``--ranks-per-node``); the fit (loopback: alpha and
    one beta; emulated: one fit over every rate, :func:`joint_fit`, with each rate's node link) and,
    when every constant of the fit is positive, the 60 x 8 prediction; writes them to ``args.json``."""
    saved = {"benchmark": "all_to_all", "runs": runs}
    for name, run in runs.items():
        rows, local = run["rows"], run.get("ranks_per_node", args.ranks_per_node)
        world = LOOPBACK_WORLD if name == "loopback" else 2 * local
        link = "gloo on loopback" if name == "loopback" else f"inter-node link {name[:-4]} Mbit/s (tbf)"
        print_table(
            rows, f"all-to-all round trip (exchange + reverse), world {world} = 2 nodes x {local}, {link}"
        )
        print()
    fits = {}
    if "loopback" in runs:
        fit = fit_loopback([r for r in runs["loopback"]["rows"] if r["wire"] == "fp32"])
        print(
            f"loopback fit over the fp32-wire rows (one beta: every link is loopback): alpha = "
            f"{fit['alpha_s'] * 1e6:.1f} us/message, beta = {fit['beta_intra_s_per_byte'] * 1e9:.3f} ns/byte"
        )
        fits["loopback"] = {**fit, "link_efficiency": 1.0}
    emulated = {name: run["rows"] for name, run in runs.items() if name != "loopback"}
    if emulated:
        joint = joint_fit(emulated)
        print(
            f"emulated fit, fp32-wire rows of every rate: alpha = {joint['alpha_s'] * 1e6:.1f} us/msg, "
            f"beta_intra = {joint['beta_intra_s_per_byte'] * 1e9:.2f} ns/byte "
            f"({1 / joint['beta_intra_s_per_byte'] / 1e6:.0f} MB/s per rank inside a node)"
        )
        efficiencies = []
        for name, beta in joint["beta_inter_s_per_byte"].items():
            efficiency = 8 / (float(name[:-4]) * 1e6) / beta
            efficiencies.append(efficiency)
            print(f"  node link at {name[:-4]} Mbit/s: {8 / beta / 1e6:.0f} Mbit/s ({efficiency:.0%} of it)")
        fits["emulated"] = {
            "alpha_s": joint["alpha_s"],
            "beta_intra_s_per_byte": joint["beta_intra_s_per_byte"],
            "beta_inter_s_per_byte": joint["beta_inter_s_per_byte"],
            "link_efficiency": min(statistics.median(efficiencies), 1.0),
        }
    for name, fit in fits.items():
        beta_inter = fit["beta_inter_s_per_byte"]
        betas_inter = list(beta_inter.values()) if isinstance(beta_inter, dict) else [beta_inter]
        if min(fit["alpha_s"], fit["beta_intra_s_per_byte"], *betas_inter) <= 0:
            print(
                f"{name} fit has a non-positive constant (alpha {fit['alpha_s']:.3g} s, beta_intra "
                f"{fit['beta_intra_s_per_byte']:.3g} s/B, beta_inter {betas_inter} s/B): no "
                "prediction; measure again with more repeats and sizes"
            )
            saved[f"fit_{name}"] = fit
            continue
        beta_inter = 8 / (args.inter_node_gbps * 1e9 * fit["link_efficiency"])
        predictions = {}
        for payload_mib in (1, 16):
            pred = predict(
                60, 8, payload_mib * 2**20, fit["alpha_s"], fit["beta_intra_s_per_byte"], beta_inter
            )
            predictions[f"{payload_mib}MiB"] = pred
            print(
                f"{name} fit carried to 60 nodes x 8 ({args.inter_node_gbps:g} Gb/s node link at "
                f"{fit['link_efficiency']:.0%}), {payload_mib} MiB per rank: flat {pred['flat_ms']:.1f} ms, "
                f"hierarchical {pred['hierarchical_ms']:.1f} ms, {pred['speedup']:.2f}x"
            )
        saved[f"fit_{name}"] = {**fit, "prediction_60x8": predictions}
    if args.json:
        write_json(args.json, saved)


if __name__ == "__main__":
    main()
