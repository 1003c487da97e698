"""How long a training step stalls for a checkpoint: synchronous vs asynchronous save, in one run.

A MoE language model of a few hundred MB (``--d-model``, ``--layers``, ``--experts``) trains with
AdamW (the checkpoint holds weights + two moments: ~3x the weights). Measured, as medians over
``--rounds`` rounds that each run the three cases back to back:

- ``step_ms``: a training step (forward, backward, optimizer step) without a checkpoint;
- ``sync_stall_ms``: the time ``CheckpointWriter(asynchronous=False).save`` blocks the loop: the whole
  save (build entries, DCP write with fsync, checksums, manifest, rename);
- ``async_stall_ms``: the time ``CheckpointWriter(asynchronous=True).save`` blocks the loop: building
  the entries and staging them into host memory; the write runs on a background thread;
- ``async_drag_ms``: what the background write costs the steps that run while it is in flight
  (their summed time minus as many plain steps; on a 2-core machine the write competes for the
  cores), so ``async_stall_ms + async_drag_ms`` is the full cost to the training loop.

Ratios: ``async_stall / sync_stall`` (what pre-emption-safe frequent checkpoints cost now) and
``(async_stall + async_drag) / sync_stall``.

Usage: python benchmarks/checkpoint_stall.py [--rounds 5] [--json PATH] [--dir DIR]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_lm import LMConfig, MoETransformerLM
from moetrain.checkpoint import CheckpointWriter
from moetrain.config import MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import existing_directory, nonnegative_int, output_path, positive_int, write_json  # noqa: E402


def build(d_model: int, layers: int, experts: int, d_ff: int):
    moe = MoEConfig(d_model=d_model, d_ff=d_ff, num_experts=experts, top_k=2, capacity_factor=None)
    model = MoETransformerLM(
        LMConfig(vocab_size=256, d_model=d_model, num_layers=layers, num_heads=8, max_seq_len=64, moe=moe)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, optimizer


def train_step(model, optimizer, batch: torch.Tensor) -> None:
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(model, optimizer, batch: torch.Tensor, root: Path, args) -> list[dict]:
    """The ``--rounds`` rounds of the module docstring, checkpoints written under ``root``: one dict
    of figures per round."""
    sync_writer = CheckpointWriter(root / "sync", keep_last=1, asynchronous=False)
    async_writer = CheckpointWriter(root / "async", keep_last=1, asynchronous=True)
    try:
        for _ in range(args.warmup):
            train_step(model, optimizer, batch)
        step = 0
        sync_writer.save(step, model=model, optimizer=optimizer)  # warm-up of both save paths
        async_writer.save(step, model=model, optimizer=optimizer)
        async_writer.wait()

        rows = []
        for _ in range(args.rounds):
            plain = []
            for _ in range(3):
                start = time.perf_counter()
                train_step(model, optimizer, batch)
                plain.append(time.perf_counter() - start)
            step_s = statistics.median(plain)

            step += 1
            train_step(model, optimizer, batch)
            start = time.perf_counter()
            sync_writer.save(step, model=model, optimizer=optimizer)
            sync_stall = time.perf_counter() - start

            step += 1
            train_step(model, optimizer, batch)
            start = time.perf_counter()
            async_writer.save(step, model=model, optimizer=optimizer)
            async_stall = time.perf_counter() - start
            in_flight_steps, in_flight_s = 0, 0.0
            while async_writer.in_flight and async_writer._thread.is_alive():
                start = time.perf_counter()
                train_step(model, optimizer, batch)
                in_flight_s += time.perf_counter() - start
                in_flight_steps += 1
            result = async_writer.wait()
            drag = max(0.0, in_flight_s - in_flight_steps * step_s)
            rows.append(
                {
                    "step_ms": 1e3 * step_s,
                    "sync_stall_ms": 1e3 * sync_stall,
                    "async_stall_ms": 1e3 * async_stall,
                    "async_drag_ms": 1e3 * drag,
                    "async_write_ms": 1e3 * result.total_s,
                    "steps_during_write": in_flight_steps,
                    "checkpoint_mb": result.total_bytes / 2**20,
                }
            )
    finally:
        sync_writer.close()
        async_writer.close()
    return rows


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--d-model", type=positive_int, default=512)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--d-ff", type=positive_int, default=2048)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument(
        "--dir",
        type=existing_directory,
        default=None,
        help="the directory under which a fresh one takes the checkpoints, removed afterwards "
        "(default: the system's temporary directory)",
    )
    parser.add_argument("--json", type=output_path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, optimizer = build(args.d_model, args.layers, args.experts, args.d_ff)
    batch = torch.randint(0, 256, (args.batch, 65))
    weight_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    root = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))  # never a directory of the user's
    try:
        rows = measure(model, optimizer, batch, root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    ratios = {
        "async_stall_over_sync_stall": statistics.median(
            r["async_stall_ms"] / r["sync_stall_ms"] for r in rows
        ),
        "async_total_over_sync_stall": statistics.median(
            (r["async_stall_ms"] + r["async_drag_ms"]) / r["sync_stall_ms"] for r in rows
        ),
    }
    print(
        f"checkpoint stall, MoE LM d_model={args.d_model} layers={args.layers} experts={args.experts} "
        f"d_ff={args.d_ff}: weights {weight_mb:.0f} MiB, checkpoint {median['checkpoint_mb']:.0f} MiB "
        f"(weights + AdamW moments), {args.threads} threads, median of {args.rounds} rounds"
    )
    for key, value in median.items():
        print(f"  {key:>22}: {value:10.1f}")
    for key, value in ratios.items():
        print(f"  {key:>28}: {value:.3f}")
    if args.json:
        write_json(
            args.json,
            {
                "machine": platform.processor() or platform.machine(),
                "median": median,
                "ratios": ratios,
                "rounds": rows,
                "weight_mb": weight_mb,
            },
        )


if __name__ == "__main__":
    main()
