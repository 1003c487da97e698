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
  ``time/backward_s`` (seconds per step, every micro-step): ``e = e0 * C / M``, where ``C =
  compute_s + recompute_s`` is the plan's at ``e0`` (compute scales as ``1 / e``) and ``M`` the
  measured compute: the median over the records of each record's ``forward + backward -
  all_to_all`` (``time/all_to_all_s``, 0 when not logged), less the planned time (with the link
  constants found) of the other collectives the engine runs inside forward and backward
  (:func:`engine_collectives`: DDP's dense all-reduce, in the last micro-step's backward; FSDP's
  reductions; the tensor-parallel all-reduces). Without phases, from the step time: ``e = e0 * C /
  (step - R)``, ``R = step_s - C`` the plan's other terms (None when the measured step is not
  longer than R: the other terms are then too pessimistic).
- **Link constants** (several ranks, with ``time/all_to_all_s`` and / or ``time/grad_sync_s``): one
  factor ``f`` on both bandwidths that makes the plan's time of the collectives timed in those
  phases equal the measured one: the all-to-all's exposed time (less what a chunked exchange,
  ``a2a_chunks > 1``, hides behind the experts) and the reductions ``time/grad_sync_s`` holds
  (:func:`engine_collectives`). Each collective takes ``latency_time + bytes_time / f`` (the plan's
  alpha-beta split); unchunked, ``f = bytes_time / (measured - latency_time)``; chunked, the hidden
  time depends on ``f`` and on the experts' time (``e``), and ``f`` is found by bisection.
  Reported as the calibrated ``intra_node_gbs`` and ``inter_node_gbps``.
- **Memory**: ``memory/peak_allocated_bytes`` (the largest over the records used: the first, whose
  window holds the start-up's one-time work, is left out as for the times) against the plan's GPU
  total less its reserve (what ``torch.cuda.max_memory_allocated`` counts); with
  ``memory/peak_reserved_bytes`` also the fragmentation ``(reserved - allocated) / (step peak +
  all-to-all buffers)`` the allocator showed, against the plan's assumed share
  (:data:`~moetrain.planner.reserve.FRAGMENTATION`).

The calibrated plan (the efficiency and link constants found, the efficiency capped at 1, each left
as it was where nothing was measured; ``a2a_chunks="auto"`` fixed at the plan's count, the one
fitted) is planned again; its step time is reported beside the measured one.
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

from moetrain.comm.chunking import ExchangeCost
from moetrain.planner.comm import (
    DDP_BUCKET_BYTES,
    EXPERT_BUCKET_BYTES,
    Traffic,
    all_reduce_traffic,
    group_layout,
)
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription, resolve_model
from moetrain.planner.overlap import hidden_behind_experts
from moetrain.planner.plan import Plan, make_plan
from moetrain.planner.plan_layout import PlanLayout, layout_stage
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
# and at most these (no run logs more): a step of 10^6 s (11.6 days), 10^12 tokens/s, 2^60 bytes
MAX_SECONDS, MAX_TOKENS_PER_S, MAX_BYTES = 1e6, 1e12, 2**60


@dataclass
class RunRecords:
    """What a run directory says: its config file, world size (None when it has no rank logs),
    ``records`` used (metrics.jsonl, the first left out when there are several), per-record
    ``tokens_per_s`` and phase seconds (median over the records), peak memory (max), and
    ``compute``: the median of each record's own ``forward + backward - all_to_all`` (never more
    than its step: the medians of the three phases, taken apart, can add up to more)."""

    run_dir: Path
    config: dict
    world_size: int | None
    records: int
    tokens_per_s: float | None
    phases: dict[str, float] = field(default_factory=dict)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the allocated peak in each phase
    # forward + backward - all_to_all of each record that has the first two, median (seconds)
    compute: float | None = None
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
    not a finite number (a bool is not one) in its range: > 0 for ``POSITIVE_KEYS``, >= 0 for
    ``NONNEGATIVE_KEYS``, at most ``MAX_SECONDS`` (times), ``MAX_TOKENS_PER_S`` or ``MAX_BYTES``
    (peaks); ``dropped_fraction`` a list of numbers in [0, 1]. Between keys: the reserved peak at
    least the allocated one, and the all-to-all (timed inside forward and backward) at most their
    sum."""
    for key in (*POSITIVE_KEYS, *NONNEGATIVE_KEYS):
        if key in record:
            high = MAX_BYTES if key.startswith("memory/") else MAX_SECONDS
            high = MAX_TOKENS_PER_S if key == "tokens_per_s" else high
            require_number(f"{where}: {key}", record[key], low=0, high=high, low_open=key in POSITIVE_KEYS)
    if "dropped_fraction" in record:
        require_numbers(f"{where}: dropped_fraction", record["dropped_fraction"], low=0, high=1)
    if (
        PEAK_RESERVED in record
        and PEAK_ALLOCATED in record
        and record[PEAK_RESERVED] < record[PEAK_ALLOCATED]
    ):
        raise ValueError(
            f"{where}: {PEAK_RESERVED} must be >= {PEAK_ALLOCATED} = {record[PEAK_ALLOCATED]!r} (the "
            f"allocator reserves what it allocates), got {record[PEAK_RESERVED]!r}"
        )
    forward, backward, a2a = (PHASE_KEYS[name] for name in ("forward", "backward", "all_to_all"))
    if (
        all(key in record for key in (forward, backward, a2a))
        and record[a2a] > record[forward] + record[backward]
    ):
        raise ValueError(
            f"{where}: {a2a} must be <= {forward} + {backward} = {record[forward] + record[backward]!r} "
            f"(the exchanges are timed inside them), got {record[a2a]!r}"
        )


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
    forward, backward, a2a = (PHASE_KEYS[name] for name in ("forward", "backward", "all_to_all"))
    computes = [r[forward] + r[backward] - r.get(a2a, 0.0) for r in used if forward in r and backward in r]
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
        compute=statistics.median(computes) if computes else None,
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
            ("compute (forward + backward - communication)", m.get("compute_s"), p["compute_s"], "s"),
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
    phases = PhaseModel.of(model, cluster, settings, kernels, plan, _replica(run.config))
    link = phases.link_factor(run.phases, run.compute) if cluster.world_size > 1 else None
    if link is None and cluster.world_size > 1:
        notes.append(
            "no time/all_to_all_s or time/grad_sync_s in the records, no planned collective in those phases, "
            "or the measured time not longer than the latencies: the link constants stay as given"
        )
    efficiency = _fitted_efficiency(measured, run.compute, phases, link, plan.time, notes)
    predicted = _predicted(plan, phases)
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
    if settings.a2a_chunks == "auto":  # the count fitted, not one chosen again with the new constants
        calibrated_settings = settings.replace(a2a_chunks=plan.time["a2a_chunks"])
    if efficiency is not None:
        calibrated_settings = calibrated_settings.replace(compute_efficiency=min(efficiency, 1.0))
        if efficiency > 1:
            notes.append(
                f"compute_efficiency {efficiency:.3g} > 1: the run computed faster than the cluster's peak "
                "FLOP/s allow (give this machine's --peak-tflops); planned again at 1"
            )
    calibrated_plan = make_plan(model, calibrated_cluster, calibrated_settings, kernels)
    result = Calibration(plan, calibrated_plan, run, kernels, measured, predicted, constants, notes)
    _check_finite(result)
    return result


def _replica(config: dict) -> str:
    """The run's ``parallel.replica`` (``"ddp"``, the default, when the config does not say)."""
    parallel = config.get("parallel")
    return parallel.get("replica", "ddp") if isinstance(parallel, dict) else "ddp"


def engine_collectives(
    plan: Plan, cluster: ClusterSpec, replica: str, layout: PlanLayout | None = None
) -> dict[str, list[Traffic]]:
    """The plan's collectives by the engine phase that times them (``moetrain/engine/step.py``,
    ``moetrain/parallelize.py``'s reducers), ``replica`` the run's ``parallel.replica``:

    - ``"all_to_all"``: the expert exchanges and their counts (``time/all_to_all_s``);
    - ``"grad_sync"``: what ``reduce_gradients`` runs after the last backward
      (``time/grad_sync_s``): under DDP the expert-DP all-reduce and, with ``tp_size > 1``, the
      split parameters' share of the dense one; with pipeline stages (no DDP) both all-reduces;
      under FSDP none;
    - ``"inside"``: the others, inside ``time/forward_s + time/backward_s``: DDP's dense
      all-reduce (in the last micro-step's backward), FSDP's reductions (in the backward), the
      tensor-parallel all-reduces.

    ``layout``: the plan's :class:`PlanLayout`, needed with ``tp_size > 1`` under DDP (the dense
    all-reduce is then split into DDP's part and the split parameters' part, each in its buckets)."""
    phases: dict[str, list[Traffic]] = {"all_to_all": [], "grad_sync": [], "inside": []}
    for t in plan.traffic:
        if t.name.startswith("all_to_all"):
            phases["all_to_all"].append(t)
        elif t.name == "tp_all_reduce" or replica == "fsdp":
            phases["inside"].append(t)
        elif t.name == "expert_dp_all_reduce" or plan.settings.pp_size > 1:
            phases["grad_sync"].append(t)
        elif plan.settings.tp_size > 1:  # dp_all_reduce: DDP's replicated part, the reducer's split part
            if layout is None:
                raise ValueError("engine_collectives: tp_size > 1 needs the plan's layout")
            split = layout.split["elements"] // layout.tp * layout.weight_b
            dense = group_layout(list(range(0, layout.stage_world, layout.tp)), cluster.gpus_per_node)
            replicated = layout.dense * layout.weight_b - split
            phases["inside"].append(all_reduce_traffic(cluster, t.name, dense, replicated, DDP_BUCKET_BYTES))
            phases["grad_sync"].append(
                all_reduce_traffic(cluster, "split_dp_all_reduce", dense, split, EXPERT_BUCKET_BYTES)
            )
        else:
            phases["inside"].append(t)
    return phases


def _bytes_time(t: Traffic, cluster: ClusterSpec) -> float:
    """The bandwidth part of a collective's alpha-beta time (the rest is its latencies)."""
    return (
        t.intra_bytes / cluster.intra_node_bandwidth
        + cluster.gpus_per_node * t.inter_bytes / cluster.inter_node_bandwidth
    )


@dataclass(frozen=True)
class PhaseModel:
    """The plan's communication as the engine's phases time it, at a factor ``f`` on both link
    bandwidths and a compute efficiency ``e``: ``collectives`` (:func:`engine_collectives`) on
    ``cluster``; ``efficiency`` the plan's, at which ``compute`` (its ``compute_s + recompute_s``)
    holds; ``overlap``: ``(one exchange's cost, the experts' seconds, chunks, layers x micro-steps)``
    of a chunked all-to-all (:mod:`moetrain.planner.overlap`), None when unchunked."""

    collectives: dict[str, list[Traffic]]
    cluster: ClusterSpec
    efficiency: float
    compute: float
    overlap: tuple[ExchangeCost, float, int, int] | None

    @classmethod
    def of(
        cls,
        model: ModelDescription,
        cluster: ClusterSpec,
        settings: PlanSettings,
        kernels: str,
        plan: Plan,
        replica: str,
    ) -> PhaseModel:
        """``plan``'s (made of ``model``, ``cluster``, ``settings``, ``kernels``), for a run with
        ``replica``."""
        chunks = plan.time["a2a_chunks"]
        layout = None
        if plan.settings.tp_size > 1 or chunks > 1:
            layout = layout_stage(model, cluster, settings.replace(a2a_chunks=chunks), kernels)
        overlap = None
        if chunks > 1 and layout.overlap is not None:
            cost, expert_s = layout.overlap
            overlap = (cost, expert_s, chunks, layout.layers_here * plan.settings.grad_accum)
        compute = plan.time["compute_s"] + plan.time["recompute_s"]
        collectives = engine_collectives(plan, cluster, replica, layout)
        return cls(collectives, cluster, plan.settings.compute_efficiency, compute, overlap)

    def seconds(self, phase: str, f: float = 1.0) -> float:
        """The ``phase``'s collectives (a key of ``collectives``) at ``f``: ``latency_time +
        bytes_time / f`` each."""
        total = 0.0
        for t in self.collectives[phase]:
            bytes_time = _bytes_time(t, self.cluster)
            total += t.seconds - bytes_time + bytes_time / f
        return total

    def hidden(self, f: float, e: float) -> float:
        """Seconds per step the chunked all-to-all hides behind the experts at ``f`` and ``e`` (capped
        at 1, as the calibrated plan): the experts take ``e0 / e`` times the plan's."""
        if self.overlap is None:
            return 0.0
        cost, expert_s, chunks, rounds = self.overlap
        experts = expert_s * self.efficiency / min(e, 1.0)
        exchange = ExchangeCost(cost.latency, cost.transfer / f)
        return rounds * hidden_behind_experts(exchange, experts, chunks)

    def efficiency_at(self, f: float, compute: float) -> float:
        """``e`` that makes the plan's compute take ``compute`` (a run's forward + backward -
        all-to-all) less the ``"inside"`` collectives at ``f``: ``e0 * C / (compute - inside)``;
        inf when nothing is left."""
        left = compute - self.seconds("inside", f)
        return self.efficiency * self.compute / left if left > 0 else math.inf

    def link_factor(self, phases: dict[str, float], compute: float | None) -> float | None:
        """``f`` that makes the planned ``all_to_all`` (exposed: less the hidden part) and
        ``grad_sync`` collectives take the measured ``phases`` (those logged); ``compute``: the run's
        forward + backward - all-to-all (the experts' time in the hidden part), None: the plan's.
        A phase whose collectives move no planned bytes is left out; None when no phase is left or
        the measured time is not above the latencies."""
        chosen = [  # a phase without planned bytes (its time is the norm's, the reducers' work) stays out
            phase
            for phase in ("all_to_all", "grad_sync")
            if phase in phases and any(_bytes_time(t, self.cluster) > 0 for t in self.collectives[phase])
        ]
        if not chosen:
            return None
        measured = sum(phases[phase] for phase in chosen)
        bytes_time = sum(_bytes_time(t, self.cluster) for phase in chosen for t in self.collectives[phase])
        if self.overlap is None or "all_to_all" not in chosen:
            latency = sum(self.seconds(phase) for phase in chosen) - bytes_time
            return bytes_time / (measured - latency) if measured > latency else None

        def excess(f: float) -> float:  # planned - measured: non-increasing in f (and in e)
            e = self.efficiency if compute is None else self.efficiency_at(f, compute)
            return sum(self.seconds(phase, f) for phase in chosen) - self.hidden(f, e) - measured

        return _decreasing_root(excess)


def _decreasing_root(excess, steps: int = 200) -> float | None:
    """The ``f > 0`` where the non-increasing ``excess(f)`` crosses 0, by bisection over ``log f``
    (to a relative 1e-12) from a bracket doubled out of 1; None when none is found within
    ``2^-steps .. 2^steps``."""
    lo = hi = 1.0
    for _ in range(steps):
        if excess(hi) <= 0:
            break
        lo, hi = hi, 2 * hi
    else:
        return None
    for _ in range(steps):
        if excess(lo) > 0:
            break
        lo, hi = lo / 2, lo
    else:
        return None
    while hi / lo > 1 + 1e-12:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return math.sqrt(lo * hi)


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
    """The run's step time, throughput, phases and peak memory (``compute_s`` and
    ``inside_collectives_s``, the planned collectives left out of it, filled in by
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
        "inside_collectives_s": None,
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
    measured: dict, compute: float | None, phases: PhaseModel, link: float | None, t: dict, notes: list[str]
) -> float | None:
    """The compute efficiency that makes the plan's compute take the measured time: from the run's
    ``compute`` (forward + backward - all-to-all, per record, median) less the planned collectives
    inside them at the ``link`` factor found (None: as given) when logged (sets
    ``measured["compute_s"]``), else from the whole step with the plan's other terms as they are;
    None when it cannot be fitted."""
    e0, planned, step = phases.efficiency, phases.compute, measured["step_s"]
    if compute is not None:
        inside = phases.seconds("inside", link or 1.0)
        measured["inside_collectives_s"] = inside
        measured["compute_s"] = compute - inside
        if inside > 0:
            names = ", ".join(sorted({x.name for x in phases.collectives["inside"] if x.seconds > 0}))
            notes.append(
                f"{names} run inside time/forward_s + time/backward_s (DDP all-reduces the dense gradients "
                "in the last micro-step's backward, FSDP reduces in the backward, tensor parallelism in "
                f"both): their planned time with the {'given' if link is None else 'calibrated'} links, "
                f"{inside:.4g} s, is left out of the measured compute"
            )
        if measured["compute_s"] <= 0:
            measured["compute_s"] = None  # no compute left to show
            notes.append(
                f"forward + backward - all-to-all ({compute:.4g} s) is not longer than the planned "
                f"collectives inside them ({inside:.4g} s): compute_efficiency not fitted"
                + ("" if link is None else " (the link factor fitted to the exchanges does not carry over)")
            )
            return None
        return e0 * planned / measured["compute_s"]
    rest = t["step_s"] - planned
    efficiency = e0 * planned / (step - rest) if step > rest else None
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


def _predicted(plan: Plan, phases: PhaseModel) -> dict:
    """The plan's figures that the run measures (the gradient sync: the collectives the engine
    times in ``time/grad_sync_s``, :func:`engine_collectives`)."""
    t = plan.time
    return {
        "step_s": t["step_s"],
        "tokens_per_s": t["tokens_per_s"],
        "compute_s": t["compute_s"] + t["recompute_s"],
        "all_to_all_s": t["all_to_all_s"] - t["all_to_all_hidden_s"],
        "grad_sync_s": phases.seconds("grad_sync"),
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
