"""Where a run's metrics go: sinks behind one small protocol, chosen by ``metrics.sinks``.

A sink (:class:`MetricsSink`) is started once per run, gets the metrics of every logging step, one
summary at the end, and is finished:

- ``start(run)``: ``run`` is a :class:`RunInfo` (``out_dir``, the step the run starts at, the
  config as a dict, the rank, the project name);
- ``log(step, metrics)``: the step's metrics, as the engine makes them: numbers, plus per MoE
  layer a list (``expert_load_cv``, ...); :func:`scalars` flattens them to ``name -> float`` with
  ``name/layer<i>`` names, which is what the trackers get;
- ``summary(values)``: once, at the end of a run that finished or stopped after a checkpoint
  (the last logged values and the step reached);
- ``finish()``: always, failed runs included.

Only rank 0 has sinks, unless a sink class says ``all_ranks = True`` (then every rank starts one;
``RunInfo.rank`` tells them apart). The built-in sinks (``METRIC_SINKS`` in :mod:`moetrain.config`):

- ``jsonl``: ``out_dir/metrics.jsonl``, one JSON object per logging step, and ``out_dir/summary.json``.
  Every line is standard JSON: a value that is not finite (the gradient norm of a skipped step, a
  loss gone inf or NaN) is written as ``null`` (Python's ``json`` would write ``Infinity`` /
  ``NaN``, which other JSON readers refuse). A run resumed at step S first drops the records of
  later steps (written before a crash, then redone), so every step appears once.
- ``tensorboard``: events under ``out_dir/tensorboard`` (the scalars of :func:`scalars`; the
  summary as ``summary/<name>``); when the package is missing, one log line and no events.
- ``wandb``: ``wandb.init(project, dir=out_dir, config, id, resume="allow")`` with the run id kept in
  ``out_dir/wandb_run_id`` (a resumed run continues the same W&B run), ``wandb.log(scalars,
  step=step)``, the summary into ``run.summary``, ``wandb.finish()``.
- ``mlflow``: ``mlflow.set_experiment(project)``, ``mlflow.start_run`` (the run id kept in
  ``out_dir/mlflow_run_id``), the flattened config as params on a fresh start,
  ``mlflow.log_metrics(scalars, step=step)``, the summary as metrics, ``mlflow.end_run()``.

``wandb`` and ``mlflow`` are imported only when chosen: :func:`check_sinks` imports them on every
rank at set-up, so a missing package stops the run before training with one line on every rank.
TensorBoard and the trackers get values as they are (inf / NaN included).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Protocol, TextIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInfo:
    """What a sink is told when the run starts."""

    out_dir: Path
    resumed_step: int  # the step the run starts at (0: a fresh run)
    config: dict
    rank: int = 0
    project: str | None = None  # metrics.project, else the out_dir's name


class MetricsSink(Protocol):
    """The protocol of a metrics sink (see the module docstring)."""

    all_ranks: ClassVar[bool]

    def start(self, run: RunInfo) -> None: ...

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def summary(self, values: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """``name -> float`` of a step's metrics: numbers and booleans as they are (as floats), a
    list ``name = [v0, v1, ...]`` as ``name/layer0``, ``name/layer1``, ...; ``step`` left out."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "step":
            continue
        if isinstance(value, (list, tuple)):
            for layer, item in enumerate(value):
                flat[f"{key}/layer{layer}"] = float(item)
        elif isinstance(value, (bool, int, float)):
            flat[key] = float(value)
    return flat


def finite_or_null(value):
    """``value`` with every float that is inf or NaN replaced by None (in dicts and lists too)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


class JsonlSink:
    """``out_dir/metrics.jsonl`` and ``out_dir/summary.json``."""

    all_ranks = False

    def start(self, run: RunInfo) -> None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        path = run.out_dir / "metrics.jsonl"
        drop_records_after(path, run.resumed_step)
        self.summary_path = run.out_dir / "summary.json"
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(finite_or_null({"step": step, **metrics}), allow_nan=False) + "\n")
        self.file.flush()

    def summary(self, values: dict[str, Any]) -> None:
        replace_text(self.summary_path, json.dumps(finite_or_null(values), allow_nan=False, indent=2))

    def finish(self) -> None:
        self.file.close()


class TensorBoardSink:
    """TensorBoard events under ``out_dir/tensorboard`` (nothing when the package is missing)."""

    all_ranks = False

    def start(self, run: RunInfo) -> None:
        self.writer, self.step = None, run.resumed_step
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed: no TensorBoard events (metrics.sinks)")
            return
        # purge_step: TensorBoard hides the events of steps >= it from the earlier attempt.
        self.writer = SummaryWriter(str(run.out_dir / "tensorboard"), purge_step=run.resumed_step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.step = step
        if self.writer is not None:
            for name, value in scalars(metrics).items():
                self.writer.add_scalar(name, value, step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.writer is not None:
            for name, value in scalars(values).items():
                self.writer.add_scalar(f"summary/{name}", value, self.step)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _run_id(path: Path, new) -> str:
    """The tracker run id kept in ``path`` (a resumed run continues its tracker run), else (no file,
    or an empty one) ``new()`` written there atomically (a ``.tmp`` file renamed over it)."""
    if path.exists():
        run_id = path.read_text(encoding="utf-8").strip()
        if run_id:
            return run_id
    run_id = str(new())
    replace_text(path, run_id + "\n")
    return run_id


class WandbSink:
    """Weights & Biases (``import wandb`` when started)."""

    all_ranks = False

    def start(self, run: RunInfo) -> None:
        self.wandb = importlib.import_module("wandb")
        run.out_dir.mkdir(parents=True, exist_ok=True)
        run_id = _run_id(run.out_dir / "wandb_run_id", self.wandb.util.generate_id)
        self.run = self.wandb.init(
            project=run.project, dir=str(run.out_dir), config=run.config, id=run_id, resume="allow"
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.wandb.log(scalars(metrics), step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(scalars(values))

    def finish(self) -> None:
        self.wandb.finish()


class MlflowSink:
    """MLflow (``import mlflow`` when started)."""

    all_ranks = False

    def start(self, run: RunInfo) -> None:
        from moetrain.run_dir import flatten

        self.mlflow = importlib.import_module("mlflow")
        run.out_dir.mkdir(parents=True, exist_ok=True)
        path = run.out_dir / "mlflow_run_id"
        self.mlflow.set_experiment(run.project)
        resumed = path.exists()
        active = self.mlflow.start_run(
            run_id=path.read_text(encoding="utf-8").strip() if resumed else None, run_name=run.out_dir.name
        )
        if not resumed:
            path.write_text(active.info.run_id + "\n", encoding="utf-8")
            self.mlflow.log_params({key: str(value)[:500] for key, value in flatten(run.config).items()})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.mlflow.log_metrics(scalars(metrics), step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self.mlflow.log_metrics({f"summary/{name}": value for name, value in scalars(values).items()})

    def finish(self) -> None:
        self.mlflow.end_run()


SINKS: dict[str, type] = {
    "jsonl": JsonlSink,
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "mlflow": MlflowSink,
}
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # sinks whose package must be installed


def check_sinks(names) -> None:
    """Imports the package of every chosen tracker sink; ``ImportError`` (one line naming the key
    and the package) when one is missing. Call it on every rank before training."""
    for name in names:
        package = _PACKAGES.get(name)
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError:
            raise ImportError(
                f"metrics.sinks: {name!r} needs the {package} package, which is not installed "
                f"(pip install {package}, or remove {name!r} from metrics.sinks)"
            ) from None


class MetricsLog:
    """The sinks of one rank for one run: ``log`` / ``summary`` / ``finish`` go to each in order.
    ``names``: the ``metrics.sinks``; a rank other than 0 gets only ``all_ranks`` sinks."""

    def __init__(self, names, run: RunInfo):
        self.sinks = [SINKS[name]() for name in names if run.rank == 0 or SINKS[name].all_ranks]
        started = []
        try:
            for sink in self.sinks:
                sink.start(run)
                started.append(sink)
        except BaseException:
            for sink in started:
                sink.finish()
            raise

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def summary(self, values: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.summary(values)

    def finish(self) -> None:
        for sink in self.sinks:
            try:
                sink.finish()
            except Exception as error:  # noqa: BLE001 - one sink's failure must not keep the others open
                log.error("metrics sink %s could not finish: %s", type(sink).__name__, error)


def replace_text(path: Path, text: str, mode: int | None = None) -> None:
    """``text`` (UTF-8) into ``path`` through a temporary file of its own in the same directory,
    written, synced to disk and renamed over ``path``: a reader sees the old file or the new one,
    never half of one, and the temporary file is removed when writing fails. The file gets
    ``mode`` when given, else ``0o666`` less the umask, as ``open`` gives (the kernel applies the
    umask: reading it would mean setting it, a race with other threads)."""
    _replace_with(path, lambda file: file.write(text), mode)


def _replace_with(path: Path, write: Callable[[TextIO], object], mode: int | None = None) -> None:
    """:func:`replace_text` with the text written by ``write(file)`` (a text file, UTF-8)."""
    path = Path(path)
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def drop_records_after(path: Path, step: int) -> None:
    """Removes from ``path`` (JSON lines with a ``step``) the records after ``step`` and every line
    that is not such a record (a torn last line, from a crash mid-write). Lines are as
    ``str.splitlines`` splits the file read as UTF-8 (undecodable bytes as U+FFFD). The file is read
    as a stream, one line at a time: memory is one line, not the file. When the lines kept are the
    file's first bytes unchanged (steps increase: the usual case), the file is truncated there and
    synced (the kept bytes are not rewritten); otherwise the kept lines are written through a
    temporary file and an atomic rename (:func:`replace_text`)."""
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        return
    with file:
        cut = _first_dropped(file, step)
    if cut is None:
        return
    if cut >= 0:
        with open(path, "r+b") as file:
            file.truncate(cut)
            os.fsync(file.fileno())
        return
    with open(path, "rb") as source:
        _replace_with(path, lambda out: out.writelines(line + "\n" for line in _kept_lines(source, step)))


def _lines(raw: bytes) -> list[str]:
    """One line of the file (bytes, its newline included) -> its lines as :func:`drop_records_after`
    reads them (several where it holds other line breaks that ``str.splitlines`` splits at)."""
    return raw.decode("utf-8", errors="replace").splitlines()


def _kept_lines(file: BinaryIO, step: int) -> Iterator[str]:
    for raw in file:
        yield from (line for line in _lines(raw) if _record_step(line) <= step)


def _first_dropped(file: BinaryIO, step: int) -> int | None:
    """None when no line of ``file`` is dropped; else the byte offset to truncate at (every line
    before it kept, written back as it is, and none after it kept), or -1 when the kept lines must
    be rewritten."""
    offset, cut = 0, None
    for raw in file:
        lines = _lines(raw)
        kept = [_record_step(line) <= step for line in lines]
        if cut is None:
            if not all(kept):
                cut = offset
            elif "".join(line + "\n" for line in lines).encode("utf-8") != raw:
                return -1 if _any_dropped(file, step) else None  # kept, but not byte for byte
        if cut is not None and any(kept):
            return -1
        offset += len(raw)
    return cut


def _any_dropped(file: BinaryIO, step: int) -> bool:
    return any(_record_step(line) > step for raw in file for line in _lines(raw))


def _record_step(line: str) -> float:
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return math.inf  # unreadable: dropped
    return step if isinstance(step, (int, float)) else math.inf  # a string would not compare
