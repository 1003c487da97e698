"""``moetrain plan --calibrate RUN_DIR``: the plan of a run that happened, against what it measured.

A run directory (``moetrain train``'s ``out_dir``) holds ``config.json`` (the run's config),
``metrics.jsonl`` (one record per logged step) and ``logs/rank_<r>.log`` (one per rank: the world
size). The plan is made for that model and those settings on the cluster given on the command line
(the GPUs the run used; its world size must be the run's), and compared with the run:

- **Step time**, seconds per optimizer step: ``time/step_s`` when the records have it, else
  ``tokens_per_step / tokens_per_s`` (``tokens_per_s`` is over the steps since the previous logged
  step, every rank's tokens). The median over the records, the first left out when there are
  several (its window holds the start-up).
- **compute_efficiency** that makes the compute terms agree. With ``time/forward_s`` and
  ``time/backward_s`` (seconds per step, every micro-step): ``e = e0 * C / (forward + backward -
  all_to_all)``, where ``C = compute_s + recompute_s`` is the plan's at ``e0`` (compute scales as
  ``1 / e``) and ``all_to_all`` is ``time/all_to_all_s`` (0 when not logged). Without phases, from
  the step time: ``e = e0 * C / (step - R)``, ``R = step_s - C`` the plan's other terms (None when
  the measured step is not longer than R: the other terms are then too pessimistic).
- **Link constants** (several ranks, with ``time/all_to_all_s`` and / or ``time/grad_sync_s``): one
  factor ``f`` on both bandwidths that makes the plan's time of those collectives equal the
  measured one, ``f = bytes_time / (measured - latency_time)``, the plan's alpha-beta split of the
  same collectives (``latency_time = messages x latency``); reported as the calibrated
  ``intra_node_gbs`` and ``inter_node_gbps``.
- **Memory**: ``memory/peak_allocated_bytes`` (the largest over the records used: the first, whose
  window holds the start-up's one-time work, is left out as for the times) against the plan's GPU
  total less its reserve (what ``torch.cuda.max_memory_allocated`` counts); with
  ``memory/peak_reserved_bytes`` also the fragmentation ``(reserved - allocated) / (step peak +
  all-to-all buffers)`` the allocator showed, against the plan's assumed share
  (:data:`~moetrain.planner.reserve.FRAGMENTATION`).

The calibrated plan (the efficiency and link constants found, capped at 1 and left as they were
where nothing was measured) is planned again; its step time is reported beside the measured one.
The records' phase keys are the engine's per-step phase times (mean seconds per step over the
logging window): ``time/step_s``, ``time/forward_s``, ``time/backward_s``, ``time/all_to_all_s``
(inside forward and backward), ``time/grad_sync_s``, ``time/optimizer_s`` (the ``step()`` call:
with the delayed update, its exposed part) and, on CUDA, ``memory/peak_allocated_bytes`` /
``memory/peak_reserved_bytes`` since the previous logged step, with the allocated peak of each
phase (``memory/peak_<phase>_bytes``): the backward's and the optimizer step's are compared with
the plan's (its step peak is the larger of the two). The plan keeps an expert row for every routed
slot (up to the experts' capacity); where the records say the run dropped routed slots at the
capacity (``dropped_fraction``, per MoE layer), a note gives the share: the plan's expert
activations are then an upper bound the run did not reach (the 0.57B calibration model dropped
37-69% in its first 12 steps on an H100).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription, resolve_model
from moetrain.planner.plan import Plan, make_plan
from moetrain.planner.reserve import FRAGMENTATION
from moetrain.planner.settings import PlanSettings
from moetrain.validation import is_number, require_number, require_numbers

PHASE_KEYS = {
    "step": "time/step_s",
    "forward": "time/forward_s",
    "backward": "time/backward_s",
    "all_to_all": "time/all_to_all_s",
    "grad_sync": "time/grad_sync_s",
    "optimizer": "time/optimizer_s",
}
PEAK_ALLOCATED = "memory/peak_allocated_bytes"
PEAK_RESERVED = "memory/peak_reserved_bytes"
PHASE_PEAKS = {name: f"memory/peak_{name}_bytes" for name in ("backward", "optimizer")}
# the records' numbers read: each finite, > 0 where it divides (the step time, the throughput),
# else >= 0 (a phase that took no measurable time; a phase peak is 0 where the phase did not run)
POSITIVE_KEYS = (PHASE_KEYS["step"], "tokens_per_s")
NONNEGATIVE_KEYS = (
    *(key for key in PHASE_KEYS.values() if key not in POSITIVE_KEYS),
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    *PHASE_PEAKS.values(),
)


@dataclass
class RunRecords:
    """What a run directory says: its config file, world size (None when it has no rank logs),
    ``records`` used (metrics.jsonl, the first left out when there are several), per-record
    ``tokens_per_s`` and phase seconds (median over the records), peak memory (max)."""

    run_dir: Path
    config: dict
    world_size: int | None
    records: int
    tokens_per_s: float | None
    phases: dict[str, float] = field(default_factory=dict)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the allocated peak in each phase
    # routed slots dropped at the capacity, mean over MoE layers and records
    dropped_fraction: float | None = None


def _read_text(run_dir: Path, path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--calibrate {run_dir}: {path.name} must be UTF-8 text (byte {error.start}: {error.reason})"
        ) from None


def _read_config(run_dir: Path, path: Path) -> dict:
    """``config.json``: a JSON object (ValueError naming the file otherwise)."""
    try:
        config = json.loads(_read_text(run_dir, path))
    except json.JSONDecodeError as error:
        raise ValueError(f"--calibrate {run_dir}: {path.name} must be a JSON object: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"--calibrate {run_dir}: {path.name} must be a JSON object, got {type(config).__name__}"
        )
    return config


def _check_record(record: dict, where: str) -> None:
    """ValueError naming ``where`` (file:line) and the key of a number the calibration reads that is
    not a finite number (a bool is not one) in its range: see ``POSITIVE_KEYS`` and
    ``NONNEGATIVE_KEYS``; ``dropped_fraction`` a list of numbers in [0, 1]."""
    for key in (*POSITIVE_KEYS, *NONNEGATIVE_KEYS):
        if key in record:
            require_number(f"{where}: {key}", record[key], low=0, low_open=key in POSITIVE_KEYS)
    if "dropped_fraction" in record:
        require_numbers(f"{where}: dropped_fraction", record["dropped_fraction"], low=0, high=1)


def read_run(run_dir: str | Path) -> RunRecords:
    """Reads ``config.json``, ``metrics.jsonl`` and the rank logs of a run directory. ValueError
    naming the file when one is missing, is not UTF-8 text, holds no logged step, or (config.json)
    is not a JSON object; and naming ``metrics.jsonl:<line>`` and the key for a value read (see
    :func:`_check_record`) that is not a finite number in its range."""
    run_dir = Path(run_dir)
    config_path, metrics_path = run_dir / "config.json", run_dir / "metrics.jsonl"
    for path in (config_path, metrics_path):
        if not path.is_file():
            raise ValueError(f"--calibrate {run_dir}: no {path.name} (is it a moetrain train out_dir?)")
    config = _read_config(run_dir, config_path)
    records = []
    for number, line in enumerate(_read_text(run_dir, metrics_path).splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if isinstance(record, dict) and "step" in record:
            _check_record(record, f"--calibrate {run_dir}: {metrics_path.name}:{number}")
            records.append(record)
    if not records:
        raise ValueError(f"--calibrate {run_dir}: {metrics_path.name} has no logged step")
    used = records[1:] if len(records) > 1 else records
    rank_logs = list((run_dir / "logs").glob("rank_*.log"))

    def median(key: str) -> float | None:
        values = [r[key] for r in used if key in r]
        return statistics.median(values) if values else None

    def largest(key: str) -> int | None:  # the step's peak: the start-up's one-time work left out too
        values = [r[key] for r in used if key in r]
        return int(max(values)) if values else None

    phases = {name: median(key) for name, key in PHASE_KEYS.items()}
    dropped = []  # each record's mean over its MoE layers
    for r in used:
        if r.get("dropped_fraction"):
            dropped.append(statistics.fmean(r["dropped_fraction"]))
    return RunRecords(
        run_dir=run_dir,
        config=config,
        world_size=len(rank_logs) or None,
        records=len(used),
        tokens_per_s=median("tokens_per_s"),
        phases={name: value for name, value in phases.items() if value is not None},
        peak_allocated=largest(PEAK_ALLOCATED),
        peak_reserved=largest(PEAK_RESERVED),
        phase_peaks={name: value for name, key in PHASE_PEAKS.items() if (value := largest(key)) is not None},
        dropped_fraction=statistics.fmean(dropped) if dropped else None,
    )


def run_model(run: RunRecords) -> tuple[ModelDescription, dict]:
    """The run's model and default plan settings, as ``moetrain plan --model <its config>`` gives
    them; a ``model`` section without ``name`` (the run wrote its config's fields) gets the name of
    the one registered model config class with exactly those fields."""
    from moetrain.config import model_config_classes

    data = json.loads(json.dumps(run.config))
    model = data.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"--calibrate {run.run_dir}: config.json has no 'model' section")
    if "name" not in model:
        matches = [
            name
            for name, cls in model_config_classes().items()
            if {f.name for f in fields(cls)} == set(model)
        ]
        if len(matches) != 1:
            raise ValueError(
                f"--calibrate {run.run_dir}: config.json's model has no 'name' and its fields match "
                f"{len(matches)} registered models; give --model CONFIG"
            )
        model["name"] = matches[0]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / f"{run.run_dir.name or 'run'}.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        return resolve_model(str(path))


@dataclass
class Calibration:
    """Measured vs predicted, and the constants that make them agree (see the module docstring).
    Seconds per optimizer step; bytes per GPU; ``None`` where the run did not measure it."""

    plan: Plan
    calibrated_plan: Plan
    run: RunRecords
    kernels: str
    measured: dict
    predicted: dict
    constants: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "run_dir": str(self.run.run_dir),
            "world_size": self.plan.world_size,
            "records": self.run.records,
            "kernels": self.kernels,
            "measured": dict(self.measured),
            "predicted": dict(self.predicted),
            "calibrated": dict(self.constants),
            "calibrated_step_s": self.calibrated_plan.time["step_s"],
            "notes": list(self.notes),
            "settings": self.plan.settings.to_dict(),
        }

    def format_table(self) -> str:
        def cell(value, unit: str) -> str:
            if value is None:
                return "-"
            if unit == "GiB":
                return f"{value / 2**30:.3f} GiB"
            return f"{value:.4g} {unit}".rstrip()

        m, p, c = self.measured, self.predicted, self.constants
        rows = [
            ("step time", m["step_s"], p["step_s"], "s"),
            ("tokens/s", m["tokens_per_s"], p["tokens_per_s"], ""),
            ("compute (forward + backward - all-to-all)", m.get("compute_s"), p["compute_s"], "s"),
            ("all-to-all", m.get("all_to_all_s"), p["all_to_all_s"], "s"),
            ("gradient sync", m.get("grad_sync_s"), p["grad_sync_s"], "s"),
            ("optimizer (in the step)", m.get("optimizer_s"), p["optimizer_exposed_s"], "s"),
            ("peak allocated memory per GPU", m.get("peak_allocated_bytes"), p["allocated_bytes"], "GiB"),
        ]
        for phase, label in (("backward", "  in the backward"), ("optimizer", "  in the optimizer step")):
            if m.get(f"peak_{phase}_bytes") is not None:  # CUDA runs log where the memory peaks
                rows.append((label, m[f"peak_{phase}_bytes"], p[f"{phase}_allocated_bytes"], "GiB"))
        lines = [
            f"calibration of {self.run.run_dir} ({_count(self.plan.world_size, 'rank')}, "
            f"{_count(self.run.records, 'logged record')}, {self.kernels} kernels' activation rules)",
            f"  {'':<44} {'measured':>14} {'predicted':>14} {'ratio':>7}",
        ]
        for name, measured, predicted, unit in rows:
            ratio = f"{measured / predicted:.3f}" if measured is not None and predicted else "-"
            lines.append(f"  {name:<44} {cell(measured, unit):>14} {cell(predicted, unit):>14} {ratio:>7}")
        lines.append("constants that make them agree:")
        for key, value in c.items():
            lines.append(f"  {key:<44} {'-' if value is None else f'{value:.4g}'}")
        lines.append(
            f"  step time planned with them: {self.calibrated_plan.time['step_s']:.4g} s "
            f"(measured {m['step_s']:.4g} s)"
        )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def calibrate(
    model: ModelDescription,
    cluster: ClusterSpec,
    settings: PlanSettings,
    run: RunRecords,
    kernels: str | None = None,
) -> Calibration:
    """Plans ``model`` with ``settings`` on ``cluster`` and compares it with ``run`` (see the module
    docstring). ``kernels``: the activation rules (None: ``"cuda"`` when the run logged CUDA peak
    memory, else ``"cpu"``). ValueError when the cluster's world size is not the run's."""
    if run.world_size is not None and cluster.world_size != run.world_size:
        raise ValueError(
            f"--calibrate {run.run_dir}: the run had {run.world_size} ranks; the cluster must have as many "
            f"GPUs (--nodes x --gpus-per-node), got {cluster.world_size}"
        )
    kernels = kernels or ("cuda" if run.peak_allocated is not None else "cpu")
    plan = make_plan(model, cluster, settings, kernels)
    notes: list[str] = []
    measured = _measured(run, plan.time)
    efficiency = _fitted_efficiency(measured, run.phases, plan.time, settings.compute_efficiency, notes)
    link = _link_factor(plan, cluster, run.phases)
    if link is None and cluster.world_size > 1:
        notes.append(
            "no time/all_to_all_s or time/grad_sync_s in the records (or not longer than the latencies): "
            "the link constants stay as given"
        )
    predicted = _predicted(plan)
    constants = {"compute_efficiency": efficiency}
    calibrated_cluster = cluster
    if link is not None:
        calibrated_cluster = replace(
            cluster,
            intra_node_bandwidth=cluster.intra_node_bandwidth * link,
            inter_node_bandwidth=cluster.inter_node_bandwidth * link,
        )
        constants["link_bandwidth_factor"] = link
        constants["intra_node_gbs"] = calibrated_cluster.intra_node_bandwidth / 1e9
        constants["inter_node_gbps"] = calibrated_cluster.inter_node_bandwidth * 8 / 1e9
    constants.update(_memory_constants(run, plan, predicted["allocated_bytes"], notes))
    if run.dropped_fraction and run.peak_allocated is not None:
        notes.append(
            f"the run dropped {run.dropped_fraction:.0%} of its routed slots at the experts' capacity "
            "(mean over MoE layers and records); the plan keeps an expert row for every routed slot, an "
            "upper bound on the expert activations that this run's routing did not reach"
        )
    calibrated_settings = settings
    if efficiency is not None:
        calibrated_settings = settings.replace(compute_efficiency=min(efficiency, 1.0))
        if efficiency > 1:
            notes.append(
                f"compute_efficiency {efficiency:.3g} > 1: the run computed faster than the cluster's peak "
                "FLOP/s allow (give this machine's --peak-tflops); planned again at 1"
            )
    calibrated_plan = make_plan(model, calibrated_cluster, calibrated_settings, kernels)
    result = Calibration(plan, calibrated_plan, run, kernels, measured, predicted, constants, notes)
    _check_finite(result)
    return result


def _check_finite(result: Calibration) -> None:
    """ValueError when a figure found from the records is not finite (finite records at the ends of
    the float range, e.g. a step of 1e-320 s, can overflow the quotients): the report (and its
    ``--json``) holds finite numbers only."""
    out = result.to_dict()
    figures = {**out["measured"], **out["calibrated"], "calibrated_step_s": out["calibrated_step_s"]}
    for key, value in figures.items():
        if is_number(value) and not math.isfinite(value):
            raise ValueError(
                f"--calibrate {result.run.run_dir}: the records give {key} = {value} (not finite): "
                "their times or peaks are out of any plausible range"
            )


def _measured(run: RunRecords, t: dict) -> dict:
    """The run's step time, throughput, phases and peak memory (``compute_s`` filled in by
    :func:`_fitted_efficiency`); ValueError when the records have no step time."""
    phases = run.phases
    if "step" in phases:
        step = phases["step"]
    elif run.tokens_per_s:
        step = t["tokens_per_step"] / run.tokens_per_s
    else:
        raise ValueError(f"--calibrate {run.run_dir}: the records have neither time/step_s nor tokens_per_s")
    return {
        "step_s": step,
        "tokens_per_s": t["tokens_per_step"] / step,
        "compute_s": None,
        "all_to_all_s": phases.get("all_to_all"),
        "grad_sync_s": phases.get("grad_sync"),
        "optimizer_s": phases.get("optimizer"),
        "peak_allocated_bytes": run.peak_allocated,
        "peak_reserved_bytes": run.peak_reserved,
        "peak_backward_bytes": run.phase_peaks.get("backward"),
        "peak_optimizer_bytes": run.phase_peaks.get("optimizer"),
        "dropped_fraction": run.dropped_fraction,
    }


def _fitted_efficiency(
    measured: dict, phases: dict[str, float], t: dict, e0: float, notes: list[str]
) -> float | None:
    """The compute efficiency that makes the plan's compute take the measured time: from the
    forward and backward phases when logged (sets ``measured["compute_s"]``), else from the whole
    step with the plan's other terms as they are; None when it cannot be fitted."""
    compute = t["compute_s"] + t["recompute_s"]
    step = measured["step_s"]
    if "forward" in phases and "backward" in phases:
        measured["compute_s"] = phases["forward"] + phases["backward"] - phases.get("all_to_all", 0.0)
        return e0 * compute / measured["compute_s"] if measured["compute_s"] > 0 else None
    rest = t["step_s"] - compute
    efficiency = e0 * compute / (step - rest) if step > rest else None
    notes.append(
        "no time/forward_s and time/backward_s in the records: compute_efficiency is fitted to the whole "
        "step, with the plan's other terms taken as they are"
    )
    if efficiency is None:
        notes.append(
            f"the measured step ({step:.4g} s) is not longer than the plan's non-compute terms "
            f"({rest:.4g} s): those are too pessimistic for this run"
        )
    return efficiency


def _predicted(plan: Plan) -> dict:
    """The plan's figures that the run measures."""
    t = plan.time
    return {
        "step_s": t["step_s"],
        "tokens_per_s": t["tokens_per_s"],
        "compute_s": t["compute_s"] + t["recompute_s"],
        "all_to_all_s": t["all_to_all_s"] - t["all_to_all_hidden_s"],
        "grad_sync_s": t["grad_sync_s"],
        "optimizer_exposed_s": t["optimizer_exposed_s"],
        "allocated_bytes": plan.gpu_total - plan.gpu_memory["reserved"],
        **_phase_allocated(plan),
    }


def _phase_allocated(plan: Plan) -> dict:
    """The plan's allocated memory in the backward and in the optimizer step: what the GPU holds
    besides the step peak, plus that phase's peak (None: the plan has no such phase)."""
    step = plan.step_memory
    fixed = plan.gpu_total - plan.gpu_memory["reserved"] - plan.gpu_memory["step_peak"]
    optimizer = step.optimizer_total
    return {
        "backward_allocated_bytes": fixed + step.backward,
        "optimizer_allocated_bytes": None if optimizer is None else fixed + optimizer,
    }


def _memory_constants(run: RunRecords, plan: Plan, allocated: float, notes: list[str]) -> dict:
    """``allocated_memory_ratio`` (measured / planned peak allocated memory) and ``fragmentation``
    (reserved - allocated, over the step's dynamic memory), where the run logged them."""
    constants = {}
    if run.peak_allocated is not None:
        constants["allocated_memory_ratio"] = run.peak_allocated / allocated
    else:
        notes.append(
            "no memory/peak_allocated_bytes in the records (logged on CUDA only): memory not compared"
        )
    if run.peak_allocated is not None and run.peak_reserved is not None:
        dynamic = plan.gpu_memory["step_peak"] + plan.gpu_memory["all_to_all_buffers"]
        fragmentation = (run.peak_reserved - run.peak_allocated) / dynamic if dynamic else None
        constants["fragmentation"] = fragmentation
        notes.append(f"the plan assumes fragmentation {FRAGMENTATION:g} of the step's dynamic memory")
    return constants


def _link_factor(plan: Plan, cluster: ClusterSpec, phases: dict[str, float]) -> float | None:
    """The factor on both link bandwidths that makes the plan's measured collectives take the
    measured time: ``bytes_time / (measured - latency_time)``; None when nothing was measured, the
    world is one rank, or the measured time is not longer than the latencies."""
    if cluster.world_size == 1:
        return None
    chosen = []
    if "all_to_all" in phases:
        chosen += [t for t in plan.traffic if t.name.startswith("all_to_all")]
    if "grad_sync" in phases:
        chosen += [t for t in plan.traffic if t.name in ("dp_all_reduce", "expert_dp_all_reduce")]
    measured = phases.get("all_to_all", 0.0) + phases.get("grad_sync", 0.0)
    latency = sum(
        t.intra_messages * cluster.intra_node_latency + t.inter_messages * cluster.inter_node_latency
        for t in chosen
    )
    bytes_time = sum(t.seconds for t in chosen) - latency
    if not chosen or measured <= latency or bytes_time <= 0:
        return None
    return bytes_time / (measured - latency)
