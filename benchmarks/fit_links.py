"""Writes the emulated cluster's alpha-beta constants beside the chunk cost model (``EMULATED_GLOO_LINKS`` in
``moetrain/comm/chunk_cost.py``, between its ``fit-constants`` marker lines), from a run of
``benchmarks/all_to_all.py --emulated-mbit R --json PATH`` and a measurement of the experts' GEMM
rate on this machine (one thread, fp32, the expert shape of ``benchmarks/moe_layer_ep.py``).

Constants: one least-squares fit over every emulated run in the file (:func:`joint_fit`) gives
``alpha`` (seconds per message, both links: gloo's per-message cost dominates either way), ``1 /
beta_intra`` (bytes/s a rank sends inside its node, over loopback) and, per rate, ``1 / beta_inter``
(bytes/s of the node link); the block takes the link of the run at rate R; plus the GEMM FLOP/s. They are what
``a2a_chunks="auto"`` assumes for CPU ranks, and what the planner's formulas need to describe the
emulated cluster.

Usage: ``python benchmarks/fit_links.py all_to_all.json --rate 200 [--write]`` (without
``--write`` it prints the block).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import existing_file, positive_float, write_atomic  # noqa: E402
from all_to_all import joint_fit  # noqa: E402

HARDWARE = Path(__file__).resolve().parent.parent / "moetrain" / "comm" / "chunk_cost.py"
BEGIN, END = "# fit-constants:begin", "# fit-constants:end"


def gemm_flops_per_s(rows: int = 1024, d_model: int = 256, d_ff: int = 1024, repeats: int = 20) -> float:
    """Median FLOP/s of ``[rows, d_model] @ [d_model, d_ff]`` and back, one thread, fp32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, w1, w2 = torch.randn(rows, d_model), torch.randn(d_model, d_ff), torch.randn(d_ff, d_model)
        times = []
        for i in range(repeats + 3):
            start = time.perf_counter()
            (a @ w1) @ w2
            if i >= 3:
                times.append(time.perf_counter() - start)
        return 2 * 2 * rows * d_model * d_ff / statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _number(value: float) -> str:
    """Four significant digits, written as ``ruff format`` keeps them."""
    return repr(float(f"{value:.4g}"))


def block(fit: dict, rate: float, flops: float, source: str) -> list[str]:
    pieces = textwrap.wrap(source, 90)
    return [
        f"{BEGIN} (written by benchmarks/fit_links.py; edit the script's inputs, not this block)",
        "EMULATED_GLOO_LINKS = Links(",
        f"    intra_node_latency={_number(fit['alpha_s'])},",
        f"    inter_node_latency={_number(fit['alpha_s'])},",
        f"    intra_node_bandwidth={_number(1 / fit['beta_intra_s_per_byte'])},",
        f"    inter_node_bandwidth={_number(1 / fit['beta_inter_s_per_byte'])},  # {rate:g} Mbit/s tbf",
        f"    flops_per_s={_number(flops)},",
        "    source=(",
        *[
            f"        {json.dumps(piece + (' ' if i < len(pieces) - 1 else ''))}"
            for i, piece in enumerate(pieces)
        ],
        "    ),",
        ")",
        END,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("all_to_all_json", type=existing_file)
    parser.add_argument(
        "--rate", type=positive_float, required=True, help="the emulated run (Mbit/s) to take"
    )
    parser.add_argument("--write", action="store_true", help=f"rewrite the block in {HARDWARE.name}")
    args = parser.parse_args()
    report = json.loads(Path(args.all_to_all_json).read_text())
    runs = {name: run["rows"] for name, run in report["runs"].items() if name != "loopback"}
    if f"{args.rate:g}mbit" not in runs:
        raise SystemExit(
            f"no emulated run at {args.rate:g} Mbit/s in {args.all_to_all_json} (has {sorted(runs)})"
        )
    fits = joint_fit(runs)  # the same fit benchmarks/all_to_all.py prints
    for name, beta in fits["beta_inter_s_per_byte"].items():
        rate = float(name[:-4])
        print(f"{name}: node link {8 / beta / 1e6:.0f} Mbit/s ({8 / beta / (rate * 1e6):.0%} of nominal)")
    print(
        f"alpha {fits['alpha_s'] * 1e6:.1f} us/message, beta_intra {fits['beta_intra_s_per_byte'] * 1e9:.2f} "
        f"ns/byte ({1 / fits['beta_intra_s_per_byte'] / 1e6:.0f} MB/s per rank inside a node)"
    )
    fit = {
        "alpha_s": fits["alpha_s"],
        "beta_intra_s_per_byte": fits["beta_intra_s_per_byte"],
        "beta_inter_s_per_byte": fits["beta_inter_s_per_byte"][f"{args.rate:g}mbit"],
    }
    positive = min(fit["alpha_s"], fit["beta_intra_s_per_byte"], fit["beta_inter_s_per_byte"]) > 0
    if not positive:
        print(f"the fit has a non-positive constant ({fit}): measure again with more repeats and sizes")
        if args.write:
            raise SystemExit(f"not written to {HARDWARE.name}")
        return
    flops = gemm_flops_per_s()
    source = (
        f"fitted {date.today().isoformat()} from benchmarks/all_to_all.py --emulated-mbit "
        f"{' '.join(name[:-4] for name in sorted(runs))} (2 nodes x 2 ranks, gloo, one fit: the node "
        f"link is the {args.rate:g} Mbit/s run's) and a 1-thread fp32 GEMM on this machine"
    )
    lines = block(fit, args.rate, flops, source)
    if not args.write:
        print("\n".join(lines))
        return
    text = HARDWARE.read_text(encoding="utf-8")
    pattern = re.compile(rf"^{re.escape(BEGIN)}.*?^{re.escape(END)}$", re.S | re.M)
    if not pattern.search(text):
        raise SystemExit(f"{HARDWARE}: the '{BEGIN}' / '{END}' lines are missing")
    write_atomic(HARDWARE, pattern.sub(lambda _: "\n".join(lines), text, count=1))
    print(f"updated {HARDWARE}")


if __name__ == "__main__":
    main()
