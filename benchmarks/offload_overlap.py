"""The delayed offloaded-optimizer update (``OffloadOptimizer(overlap="delayed")``) against ``none``.

Each step is "device work" then ``optimizer.step()``. The device work is emulated on the calling
thread: ``--device-work sleep`` (default) sleeps, as the host thread does while a GPU computes (it
takes no CPU); ``--device-work model`` runs the forward and backward of a CPU MLP on one torch
thread, which competes with the host Adam for the CPU as a data loader would. The host step is
real: the fused C++ Adam over ``--params`` bf16 parameters (fp32 masters and moments on the host).
With ``none`` a step takes ``device + host``; with ``delayed`` the host step runs on the worker
thread during the next step's device work, so a step takes ``max(device, host) + copies`` (the
gradient snapshot and the weight write, memcpy on the calling thread here; PCIe on a GPU).

Figures (medians over ``--rounds`` alternated rounds of ``--steps`` steps of each, after 2 warm-up
steps per round; device and host step as measured in the ``none`` loop): ``speedup = step(none) /
step(delayed)`` and ``hidden_fraction = (step(none) - step(delayed)) / min(device, host)``, the
share of the hideable time actually hidden (1.0: perfect overlap), and ``delayed_over_predicted``,
the delayed step over the planner's formula ``max(device, host) + copies`` (``copies``: the gradient
snapshot and the weight write, timed alone). The device work defaults to the measured host step,
where the ideal speedup is 2.

Usage: ``python benchmarks/offload_overlap.py [--params 2e7] [--steps 6] [--rounds 3]
[--device-work sleep|model] [--device-s S] [--threads N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moetrain.offload import OffloadOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import number_at_least, output_path, positive_float, positive_int, write_atomic  # noqa: E402

SHARDS = 8  # parameters: equal slices of the total, as a model's layers would be


def make_params(numel: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for _ in range(SHARDS):
        p = torch.nn.Parameter(torch.randn(numel // SHARDS, generator=generator).to(torch.bfloat16))
        p.grad = (torch.randn(numel // SHARDS, generator=generator) * 1e-3).to(torch.bfloat16)
        params.append(p)
    return params


class SleepWork:
    """The host thread's view of a GPU computing: it waits ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self) -> None:
        time.sleep(self.seconds)


class ModelWork:
    """Forward and backward of an MLP ``[rows, width] -> width x 4 -> width`` on the calling thread,
    repeated to take about ``seconds``."""

    def __init__(self, seconds: float, width: int = 512, rows: int = 256) -> None:
        generator = torch.Generator().manual_seed(1)
        self.w1 = torch.randn(width, 4 * width, generator=generator, requires_grad=True)
        self.w2 = torch.randn(4 * width, width, generator=generator, requires_grad=True)
        self.x = torch.randn(rows, width, generator=generator)
        self.repeats = 1
        start = time.perf_counter()
        self._once()
        self.repeats = max(1, round(seconds / (time.perf_counter() - start)))

    def _once(self) -> None:
        y = torch.relu(self.x @ self.w1) @ self.w2
        y.square().mean().backward()
        self.w1.grad = self.w2.grad = None

    def __call__(self) -> None:
        for _ in range(self.repeats):
            self._once()


def run(overlap: str, numel: int, device_work, steps: int) -> tuple[list[float], list[float]]:
    """Per step after 2 warm-up steps: (seconds of device work + ``step()``, seconds of the ``step()``
    call alone: the whole host step with ``none``, with ``delayed`` the copies on the calling thread
    and any wait for the worker)."""
    params = make_params(numel)
    optimizer = OffloadOptimizer(params, lr=1e-4, overlap=overlap)
    totals, calls = [], []
    for i in range(steps + 2):
        start = time.perf_counter()
        device_work()
        called = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        if i >= 2:
            totals.append(end - start)
            calls.append(end - called)
    optimizer.close()
    return totals, calls


def host_step_seconds(numel: int, repeats: int = 3) -> float:
    """Median seconds of one exact ``step()`` (nothing else running)."""
    return statistics.median(run("none", numel, lambda: None, repeats)[1])


def copies_seconds(numel: int, repeats: int = 3) -> float:
    """Median seconds of the delayed update's copies on the calling thread: every gradient into the
    host snapshot and every new weight into the parameters (bf16, ``numel`` each)."""
    params = make_params(numel)
    snapshot = [torch.empty_like(p.grad) for p in params]
    weights = [torch.empty_like(p.detach()) for p in params]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for p, grad, weight in zip(params, snapshot, weights, strict=True):
            grad.copy_(p.grad)
            p.detach().copy_(weight)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--params",
        type=number_at_least(SHARDS, f" ({SHARDS} parameters of at least one element)"),
        default=2e7,
    )
    parser.add_argument("--steps", type=positive_int, default=6, help="steps per round")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of none then delayed")
    parser.add_argument("--device-work", choices=("sleep", "model"), default="sleep")
    parser.add_argument(
        "--device-s", type=positive_float, help="device work per step, seconds (default: the host step)"
    )
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=output_path, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    numel = int(args.params) // SHARDS * SHARDS
    host_s = host_step_seconds(numel)
    device_s = host_s if args.device_s is None else args.device_s
    if args.device_work == "model":
        work = ModelWork(device_s)
        start = time.perf_counter()
        work()
        device_s = time.perf_counter() - start
    else:
        work = SleepWork(device_s)
    measured: dict[str, tuple[list[float], list[float]]] = {"none": ([], []), "delayed": ([], [])}
    for _ in range(args.rounds):  # alternated, so that a change in the machine's load hits both
        for overlap, (totals, calls) in measured.items():
            more_totals, more_calls = run(overlap, numel, work, args.steps)
            totals += more_totals
            calls += more_calls
    none = statistics.median(measured["none"][0])
    delayed = statistics.median(measured["delayed"][0])
    host_in_loop = statistics.median(measured["none"][1])  # the exact step() while nothing else runs
    device_in_loop = statistics.median([total - call for total, call in zip(*measured["none"], strict=True)])
    copies = copies_seconds(numel)
    predicted = max(device_in_loop, host_in_loop) + copies  # the planner's delayed step
    result = {
        "params": numel,
        "dtype": "bf16",
        "device_work": args.device_work,
        "threads": torch.get_num_threads(),
        "steps": args.steps * args.rounds,
        "host_step_s": host_in_loop,
        "device_s": device_in_loop,
        "step_none_s": none,
        "step_delayed_s": delayed,
        "delayed_step_call_s": statistics.median(measured["delayed"][1]),
        "copies_s": copies,
        "predicted_delayed_s": predicted,
        "delayed_over_predicted": delayed / predicted,
        "speedup": none / delayed,
        "ideal_speedup": (device_in_loop + host_in_loop) / max(device_in_loop, host_in_loop),
        "hidden_fraction": (none - delayed) / min(device_in_loop, host_in_loop),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "load_average": os.getloadavg()[0],
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        write_atomic(args.json, text + "\n")
    return result


if __name__ == "__main__":
    main()
