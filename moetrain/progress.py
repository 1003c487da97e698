"""A dependency-free progress bar for long loops: ``step/total``, metrics, rate and ETA on one line."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Redraws one line on ``stream`` (a terminal: with ``\\r``; a log file: a line every
    ``log_every`` steps). ``update(step, **metrics)`` formats floats with 4 significant digits.
    ``initial``: steps already done before this bar started (a resumed run); the ETA uses the
    rate of the steps done since."""

    def __init__(
        self,
        total: int,
        description: str = "",
        width: int = 24,
        stream: TextIO | None = None,
        log_every: int = 50,
        initial: int = 0,
    ):
        self.total = max(total, 1)
        self.description = description
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.log_every = log_every
        self.initial = initial
        self.start = time.perf_counter()
        self._last_len = 0

    def _render(self, step: int, metrics: dict) -> str:
        done = min(step, self.total)
        filled = int(self.width * done / self.total)
        elapsed = time.perf_counter() - self.start
        since_start = done - self.initial
        eta = elapsed / since_start * (self.total - done) if since_start > 0 else 0.0
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        bar = "#" * filled + "." * (self.width - filled)
        prefix = f"{self.description} " if self.description else ""
        return f"{prefix}[{bar}] {done}/{self.total} | " + " | ".join(parts) + f" | eta {eta:4.0f}s"

    def update(self, step: int, **metrics) -> None:
        line = self._render(step, metrics)
        if self.interactive:
            self.stream.write("\r" + line + " " * max(0, self._last_len - len(line)))
            self._last_len = len(line)
        elif step % self.log_every == 0 or step >= self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
