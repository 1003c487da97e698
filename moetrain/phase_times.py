"""Where a training step's time goes, per phase, without waiting for the device on every step.

``PhaseTimer.phase(name)`` brackets one phase of a step (forward, backward, gradient sync,
optimizer): on CUDA with a pair of CUDA events, which are read only when the metrics are logged,
elsewhere with the wall clock. :meth:`PhaseTimer.window_means` returns ``{"time/<name>_s": seconds
per optimizer step}`` over the steps since its last call (a phase run several times in a step, such
as the forward of each micro-batch, adds up). The planner's ``--calibrate`` reads these keys.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._spans.append((name, start, end))
        else:
            start = time.perf_counter()
            yield
            self._spans.append((name, start, time.perf_counter()))

    def window_means(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase since the last call (``steps`` optimizer steps)."""
        spans, self._spans = self._spans, []
        if self.on_cuda and spans:
            spans[-1][2].synchronize()
        totals: dict[str, float] = defaultdict(float)
        for name, start, end in spans:
            totals[name] += start.elapsed_time(end) / 1e3 if self.on_cuda else end - start
        return {f"time/{name}_s": total / max(steps, 1) for name, total in totals.items()}
