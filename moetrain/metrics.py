"""The metrics file of a run: ``out_dir/metrics.jsonl`` (one JSON object per logged step) and, when
the optional ``tensorboard`` package is installed, TensorBoard events under ``out_dir/tensorboard``.

A run resumed at ``resumed_step`` first drops the records of later steps (written before a crash,
then redone), so every step appears once.

Every line is standard JSON: a value that is not finite (the gradient norm of a skipped step, a
loss gone inf or NaN) is written as ``null`` (Python's ``json`` would write ``Infinity`` / ``NaN``,
which other JSON readers refuse); TensorBoard gets the value as it is.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON line per logged step (and TensorBoard scalars when available)."""

    def __init__(self, out_dir: Path, resumed_step: int = 0):
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        drop_records_after(path, resumed_step)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events of steps >= it from the earlier attempt.
            self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resumed_step + 1)
        except ImportError:
            self.tensorboard = None
            log.info("tensorboard is not installed: metrics go to metrics.jsonl only")

    def write(self, metrics: dict) -> None:
        self.file.write(json.dumps(finite_or_null(metrics), allow_nan=False) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            step = metrics["step"]
            for key, value in metrics.items():
                if isinstance(value, list):
                    for layer, item in enumerate(value):
                        self.tensorboard.add_scalar(f"{key}/layer{layer}", item, step)
                elif key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def finite_or_null(value):
    """``value`` with every float that is inf or NaN replaced by None (in dicts and lists too)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def drop_records_after(path: Path, step: int) -> None:
    """Rewrites ``path`` (JSON lines with a ``step``) without the records after ``step``, via a
    temporary file and an atomic rename; a torn last line (a crash mid-write) is dropped too."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if _record_step(line) <= step]
    if len(kept) < len(lines):
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temporary, path)


def _record_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # unreadable: dropped
