"""Where the metrics of logging steps go (:class:`MetricsConfig`: the sinks) and its validation."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.options import option
from moetrain.validation import require_choice

METRIC_SINKS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class MetricsConfig:
    """Where the metrics of logging steps go (:mod:`moetrain.metrics`): ``sinks``, any of
    ``METRIC_SINKS`` in any order: ``jsonl`` (``out_dir/metrics.jsonl``), ``tensorboard``
    (``out_dir/tensorboard``; skipped with one log line when the package is not installed),
    ``wandb`` and ``mlflow`` (their packages imported only when chosen; a missing one stops the
    run before training with one line). ``project``: the Weights & Biases project / MLflow
    experiment (None: the name of ``out_dir``'s directory)."""

    sinks: tuple[str, ...] = option(
        ("jsonl", "tensorboard"), "where metrics go: any of jsonl, tensorboard, wandb, mlflow"
    )
    project: str | None = option(None, "Weights & Biases project / MLflow experiment; None: out_dir's name")

    def __post_init__(self) -> None:
        if isinstance(self.sinks, str) or not isinstance(self.sinks, (list, tuple)):
            raise ValueError(f"metrics.sinks must be a list of sink names, got {self.sinks!r}")
        object.__setattr__(self, "sinks", tuple(self.sinks))
        for sink in self.sinks:
            require_choice("metrics.sinks", sink, METRIC_SINKS)
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"metrics.sinks names a sink twice: {list(self.sinks)}")
        if self.project is not None and (not isinstance(self.project, str) or not self.project):
            raise ValueError(f"metrics.project must be a name or null, got {self.project!r}")
