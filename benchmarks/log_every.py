"""What logging every step costs: training step time with ``log_every=1`` vs ``log_every=50``, in one run.

On a logging step the engine brings the step's metrics to the host (loss, aux loss, tokens: one
small all-reduce; expert load per layer: one all-reduce; ``.item()`` of each), which on a GPU waits
for every queued kernel; between logging steps the values stay on the device. This measures the
difference on the engine's own loop (``Trainer.train_step``), both configurations interleaved round
by round, median over rounds of ``--steps`` steps each. On a CPU run there is no device queue to
drain, so the ratio shows only the host-side cost of the metrics themselves.

Usage: python benchmarks/log_every.py [--rounds 5] [--steps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import output_path, positive_int, write_json  # noqa: E402


def make_trainer(log_every: int, out_dir: Path) -> Trainer:
    config = {
        "model": {
            "name": "moe_lm", "d_model": 128, "num_layers": 2, "num_heads": 4, "max_seq_len": 64,
            "moe": {"d_ff": 256, "num_experts": 8, "top_k": 2},
        },
        "data": {"micro_batch_size": 8, "seq_len": 64}, "steps": 10**6, "log_every": log_every,
        "out_dir": str(out_dir), "threads": 2, "device": "cpu",
    }  # fmt: skip
    return Trainer(config_from_dict(TrainConfig, config))


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--json", type=output_path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="log-every-"))
    trainers = {every: make_trainer(every, root / f"every{every}") for every in (1, 50)}
    for trainer in trainers.values():  # warm-up
        for _ in range(5):
            trainer.train_step()
    per_step_ms = {every: [] for every in trainers}
    for _ in range(args.rounds):
        for every, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            per_step_ms[every].append(1e3 * (time.perf_counter() - start) / args.steps)
    ratios = [a / b for a, b in zip(per_step_ms[1], per_step_ms[50], strict=True)]
    result = {
        "machine": platform.processor() or platform.machine(),
        "step_ms_log_every_1": statistics.median(per_step_ms[1]),
        "step_ms_log_every_50": statistics.median(per_step_ms[50]),
        "ratio_1_over_50": statistics.median(ratios),
    }
    print(
        f"step time, MoE LM d_model 128 x 2 layers, 8 experts, CPU, median of {args.rounds} rounds x "
        f"{args.steps} steps: log_every=1 {result['step_ms_log_every_1']:.2f} ms, log_every=50 "
        f"{result['step_ms_log_every_50']:.2f} ms, ratio {result['ratio_1_over_50']:.3f}"
    )
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
