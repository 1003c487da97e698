"""Where a training step's time goes, per phase, without waiting for the device on every step.

``PhaseTimer.phase(name)`` brackets one phase of a step (forward, backward, gradient sync,
optimizer): on CUDA with a pair of CUDA events, which are read only when the metrics are logged,
elsewhere with the wall clock. :meth:`PhaseTimer.window_means` returns ``{"time/<name>_s": seconds
per optimizer step}`` over the steps since its last call (a phase run several times in a step, such
as the forward of each micro-batch, adds up). The planner's ``--calibrate`` reads these keys.

On CUDA it also keeps the allocator's peaks: at every phase boundary the peak since the last one
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) is folded into the window's and
into each open phase's (phases nest: the all-to-all inside forward and backward), then the
allocator's peak is reset (host-side bookkeeping, no device synchronisation).
:meth:`PhaseTimer.window_peaks` returns ``{"memory/peak_allocated_bytes", "memory/peak_reserved_bytes",
"memory/peak_<name>_bytes"}`` since its last call: where in the step the memory peaks.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

# The engine's phases: every rank reports all of them (0 where one did not run), so that the
# ranks' peaks are reduced in one tensor of one size.
PHASES = ("forward", "backward", "all_to_all", "grad_sync", "optimizer", "pipeline")


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []
        self._open: list[str] = []
        self._window_peaks = [0, 0]  # allocated, reserved
        self._phase_peaks: dict[str, int] = defaultdict(int)

    def _fold_peaks(self) -> None:
        """The allocator's peaks since the last boundary go to the window and the open phases."""
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        self._window_peaks = [max(self._window_peaks[0], allocated), max(self._window_peaks[1], reserved)]
        for name in self._open:
            self._phase_peaks[name] = max(self._phase_peaks[name], allocated)
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._fold_peaks()
            self._open.append(name)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._fold_peaks()
                self._open.pop()
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

    def window_peaks(self) -> dict[str, int]:
        """CUDA only: the allocator's peaks (bytes) since the last call, of the whole window and of
        each phase (every one of :data:`PHASES`, 0 where it did not run); the window's start anew."""
        self._fold_peaks()
        (allocated, reserved), phases = self._window_peaks, dict(self._phase_peaks)
        self._window_peaks, self._phase_peaks = [0, 0], defaultdict(int)
        peaks = {"memory/peak_allocated_bytes": allocated, "memory/peak_reserved_bytes": reserved}
        names = [*PHASES, *sorted(set(phases) - set(PHASES))]
        peaks.update({f"memory/peak_{name}_bytes": phases.get(name, 0) for name in names})
        return peaks
