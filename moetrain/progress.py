"""Progress of long loops as log records: ``step/total``, metrics, rate and ETA on one line.

A :class:`ProgressBar` writes nothing itself; it logs through ``logging.getLogger("moetrain.progress")``
so that library code with no handler configured stays silent (Python's last-resort handler shows
WARNING and above only), and whoever configures logging decides where progress goes:

- every ``log_every`` steps and at the last step the line is an INFO record (``record.progress ==
  "line"``): any handler shows it as a plain line (the command line's console, a rank's log file, a
  user's ``logging.basicConfig``);
- the updates in between are DEBUG records marked ``record.progress == "redraw"``, and ``close()``
  logs one marked ``"end"``; they are formatted only when the logger is enabled for DEBUG. The
  command line's console handler (:class:`moetrain.logs.ConsoleHandler`) enables them on a terminal
  and redraws the bar in place; its file handlers and a console that is not a terminal drop them.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

PROGRESS_ATTR = "progress"  # the LogRecord attribute: "line", "redraw" or "end"


def progress_kind(record: logging.LogRecord) -> str | None:
    """``"line"``, ``"redraw"`` or ``"end"`` for a record of a :class:`ProgressBar`, else None."""
    return getattr(record, PROGRESS_ATTR, None)


class ProgressBar:
    """``update(step, **metrics)`` formats floats with 4 significant digits. ``initial``: steps
    already done before this bar started (a resumed run); the ETA uses the rate of the steps done
    since. ``log_every``: steps between the INFO lines (see the module docstring)."""

    def __init__(
        self, total: int, description: str = "", width: int = 24, log_every: int = 50, initial: int = 0
    ):
        self.total = max(total, 1)
        self.description = description
        self.width = width
        self.log_every = max(1, log_every)
        self.initial = initial
        self.start = time.perf_counter()

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
        if step % self.log_every == 0 or step >= self.total:
            level, kind = logging.INFO, "line"
        else:
            level, kind = logging.DEBUG, "redraw"
        if log.isEnabledFor(level):
            log.log(level, "%s", self._render(step, metrics), extra={PROGRESS_ATTR: kind})

    def close(self) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", self.description, extra={PROGRESS_ATTR: "end"})
