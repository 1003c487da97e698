"""The pipeline bubble measured on gloo stages against ``(p - 1) / (m + p - 1)``.

``p`` processes (2 and 4), each one stage of ``torch.distributed.pipelining`` (the GPipe and 1F1B
schedules :class:`moetrain.pipeline.Pipeline` runs), take ``m`` micro-batches per step. A
stage's work is a fixed time per micro-batch, ``--forward-ms`` forward and twice that backward,
spent in ``time.sleep`` inside an autograd function: on this 2-core machine 4 computing
processes would contend for the cores and the measurement would be of the contention, not of the
schedule. The ideal step is ``m * (f + b)`` (one stage doing all its micro-batches back to back);
the measured bubble is ``1 - ideal / step`` (median of ``--steps`` steps after 2 of warm-up),
against the formula's ``(p - 1) / (m + p - 1)``. What is left between them is the schedule's
own overhead (gloo sends, Python).

Usage: python benchmarks/pipeline_bubble.py [--forward-ms 20] [--steps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli import output_path, positive_float, positive_int, write_json  # noqa: E402

from moetrain.pipeline import bubble_fraction  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402


class _Busy(torch.autograd.Function):
    """Identity that takes ``seconds`` forward and ``2 * seconds`` backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Stage(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Busy.apply(x * self.scale, self.seconds)


def worker(rank, world, schedule, microbatches, seconds, steps):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(Stage(seconds), rank, world, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    run = kind(stage, microbatches, loss_fn=lambda out, target: (out - target).square().mean())
    x = torch.randn(microbatches * 2, 8)
    times = []
    for _ in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        if rank == 0:
            run.step(x)
        elif rank == world - 1:
            run.step(target=x)
        else:
            run.step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-ms", type=positive_float, default=20.0)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--json", type=output_path, default=None)
    args = parser.parse_args()
    seconds = args.forward_ms / 1000
    rows = []
    for stages in (2, 4):
        for microbatches in (4, 8):
            for schedule in ("gpipe", "1f1b"):
                step = run_distributed(worker, stages, schedule, microbatches, seconds, args.steps)[0]
                ideal = microbatches * 3 * seconds
                rows.append(
                    {
                        "stages": stages,
                        "microbatches": microbatches,
                        "schedule": schedule,
                        "step_ms": round(step * 1000, 1),
                        "ideal_ms": round(ideal * 1000, 1),
                        "bubble": round(1 - ideal / step, 3),
                        "formula": round(bubble_fraction(stages, microbatches), 3),
                    }
                )
    work = f"{args.forward_ms:g} ms fwd + {2 * args.forward_ms:g} ms bwd"
    print(f"pipeline bubble, gloo, stage work (sleep) {work} per micro-batch")
    header = ("stages", "microbatches", "schedule", "step_ms", "ideal_ms", "bubble", "formula")
    print(" | ".join(f"{h:>12}" for h in header))
    for row in rows:
        print(" | ".join(f"{row[h]!s:>12}" for h in header))
    worst = max(abs(r["bubble"] - r["formula"]) for r in rows)
    print(f"largest |bubble - formula| = {worst:.3f}")
    if args.json:
        write_json(args.json, {"machine": platform.platform(), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
