"""One configuration on one cluster: memory per GPU and per node, traffic per collective, step time.

:func:`make_plan` runs the stages in order, passing plain records between them: layout
(:mod:`~moetrain.planner.plan_layout`), memory (:mod:`~moetrain.planner.plan_memory`), traffic
(:mod:`~moetrain.planner.plan_traffic`), time (:mod:`~moetrain.planner.plan_time`), then the report
(the :class:`Plan`). Together:

- parameters per rank from the model built on ``meta`` (:mod:`moetrain.planner.model`);
- GPU memory: weights + optimizer states (unless offloaded) + all-to-all buffers + DDP's gradient
  buckets (the dense gradients once more, world > 1) + the step's
  peak of activations (autocast's weight copies included), gradients and working memory
  (:mod:`moetrain.planner.peak`, with the recompute plan) + reserved, against the usable memory
  ``memory_bytes * (1 - settings.memory_headroom)`` (the headroom is kept free);
- host memory per node: offloaded optimizer states (12 bytes/parameter: fp32 master and two
  moments) and pinned staging (two apply groups of gradients + weight copies) for each of the
  node's GPUs, plus the node's reserve;
- traffic per optimizer step (:mod:`moetrain.planner.comm`): all-to-all rows and counts, the DP
  all-reduce of dense gradients (over the ``world / tp_size`` ranks of a tp index), the expert-DP
  all-reduce of expert gradients, and with ``tp_size > 1`` the activation all-reduces of the split
  units in the tp group (:mod:`moetrain.planner.split`); split units' parameters count ``1/tp``
  per rank in the memory terms and their FLOPs ``1/tp`` in the compute;
- step time = compute + recompute + all-to-all + gradient sync + optimizer step, not overlapped
  (an upper bound: DDP overlaps its all-reduce with backward in practice):
  compute ``= grad_accum * 3 * forward FLOPs / (peak * compute_efficiency)`` (backward = 2x forward),
  optimizer on the GPU ``= params * 28 B / memory bandwidth``, offloaded
  ``= max(params * max(grad, weight bytes) / PCIe, gpus_per_node * params * (24 + grad + weight
  bytes) / host memory bandwidth)`` (CPU Adam is bound by host memory; copies overlap it).
  ``settings.optim_overlap = "delayed"`` (offload only; ZeRO-Offload's one-step delayed update):
  the host step of step t runs during step t+1's device work, so ``optimizer_exposed_s = max(0,
  host_s - device_s) + h2d_s`` replaces ``optimizer_s`` in the step, where ``device_s`` is every
  other term of the step, ``host_s = d2h_s / G + max(d2h_s * (G - 1) / G, cpu)`` (the first apply
  group's gradients reach the host before its Adam starts; the rest overlap it), ``d2h_s = params *
  grad bytes / PCIe``, and ``h2d_s = params * weight bytes / PCIe`` (the new weights are written
  between the backward of t+1 and the forward of t+2: nothing overlaps it). Host staging becomes
  one gradient and one weight copy of every parameter (pinned).

Terms that are estimates, not validated by a test: the reserve and every time (the step peak and
the all-to-all buffers are checked against measured peaks on the CPU,
tests/unit/planner/test_planner_validation.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from moetrain.planner.activations import ActivationModel
from moetrain.planner.comm import Traffic
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.peak import StepPeak
from moetrain.planner.pipeline import PipelinePlan
from moetrain.planner.plan_layout import (
    ADAM_STATE_BYTES,
    ITEMSIZE,
    PlanLayout,
    layout_stage,
    resolve_capacity_factor,
    resolve_seq_len,
    workload,
)
from moetrain.planner.plan_memory import (
    PlanMemory,
    RecomputeChoice,
    choose_recompute,
    memory_stage,
    plan_communicators,
)
from moetrain.planner.plan_time import CPU_ADAM_STATE_TRAFFIC, GPU_ADAM_TRAFFIC, time_stage
from moetrain.planner.plan_traffic import PlanTraffic, traffic_stage
from moetrain.planner.settings import PlanSettings

__all__ = [  # the names other modules import from here (the stages' modules hold them)
    "ADAM_STATE_BYTES",
    "CPU_ADAM_STATE_TRAFFIC",
    "GPU_ADAM_TRAFFIC",
    "GPU_MEMORY_TERMS",
    "ITEMSIZE",
    "Plan",
    "RecomputeChoice",
    "choose_recompute",
    "make_plan",
    "plan_communicators",
    "resolve_capacity_factor",
    "resolve_seq_len",
    "workload",
]

GPU_MEMORY_TERMS = (
    "weights",
    "optimizer_states",
    "all_to_all_buffers",
    "ddp_buckets",
    "step_peak",
    "reserved",
)


@dataclass
class Plan:
    """Everything :func:`make_plan` computed. Bytes per GPU in ``gpu_memory`` (named terms, see
    ``GPU_MEMORY_TERMS``; ``step_memory`` breaks the step peak down, ``reserve`` the reserved
    memory, ``gradient_bytes`` is every gradient of the rank, ``recompute.activation_bytes`` the
    activations kept), per node in
    ``host_memory``; traffic per rank per step in ``traffic``;
    seconds in ``time``; ``all_to_all_alternative``: rows and counts of the all-to-all algorithm not
    chosen, for comparison (not in the step time); ``node_limit``: with a ``max_nodes_per_token``,
    the nodes a token's rows reach and the inter-node bytes with and without per-node
    deduplication (:func:`moetrain.planner.node_limit.node_limit_figures`), else None.
    ``gpu_capacity``: the GPU's memory (bytes);
    ``gpu_usable``: what a plan may fill, the capacity less ``settings.memory_headroom``. ``fits`` is
    True when the GPU total is within ``gpu_usable`` and the host total within ``host_capacity``;
    ``overflow`` names what does not, by how much and its largest term (e.g. ``"GPU memory: 37.06
    GiB > 28.80 GiB usable (32.00 GiB less 10% headroom) by 8.26 GiB (largest term:
    optimizer_states 25.08 GiB)"``)."""

    model: str
    cluster: ClusterSpec
    settings: PlanSettings
    world_size: int
    dp_size: int
    expert_dp_size: int
    all_to_all: str
    capacity_factor: float | None
    params: dict[str, int]
    gpu_memory: dict[str, int]
    gradient_bytes: int
    step_memory: StepPeak
    reserve: dict[str, int]
    checkpoint: dict[str, int]
    gpu_capacity: int
    gpu_usable: int
    host_memory: dict[str, int]
    host_capacity: int
    recompute: RecomputeChoice
    activations: ActivationModel = field(repr=False)
    traffic: list[Traffic] = field(default_factory=list)
    all_to_all_alternative: Traffic | None = None
    time: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    node_limit: dict | None = None

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu_memory.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_memory.values())

    @property
    def fits(self) -> bool:
        return (
            self.gpu_total <= self.gpu_usable
            and self.host_total <= self.host_capacity
            and self.recompute.feasible
        )

    @property
    def overflow(self) -> str | None:
        """Which memory does not fit, by how much, and its largest term; None when it fits."""
        problems = []
        usable = (
            f"{_gib(self.gpu_usable)} usable ({_gib(self.gpu_capacity)} less {self.headroom_label} headroom)"
        )
        for where, terms, total, capacity, limit in (
            ("GPU memory", self.gpu_memory, self.gpu_total, self.gpu_usable, usable),
            ("host memory per node", self.host_memory, self.host_total, self.host_capacity, None),
        ):
            if total > capacity:
                largest = max(terms, key=terms.get)
                problems.append(
                    f"{where}: {_gib(total)} > {limit or _gib(capacity)} by {_gib(total - capacity)} "
                    f"(largest term: {largest} {_gib(terms[largest])})"
                )
        if not self.recompute.feasible and self.recompute.mode == "budget":
            problems.append(
                f"activations: recompute_budget_bytes {_gib(self.settings.recompute_budget_bytes)} is below "
                f"the minimum {_gib(self.recompute.min_activation_bytes)} any recompute reaches"
            )
        return "; ".join(problems) or None

    @property
    def headroom_label(self) -> str:
        """``settings.memory_headroom`` as a percentage, e.g. ``"10%"``."""
        return f"{100 * self.settings.memory_headroom:g}%"

    @property
    def tokens_per_s(self) -> float:
        return self.time["tokens_per_s"]

    def to_dict(self) -> dict:
        """JSON-ready: plain numbers, strings, lists and dicts."""
        return {
            "model": self.model,
            "cluster": self.cluster.to_dict(),
            "settings": self.settings.to_dict(),
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "expert_dp_size": self.expert_dp_size,
            "all_to_all": self.all_to_all,
            "capacity_factor": self.capacity_factor,
            "params": dict(self.params),
            "gpu_memory": dict(self.gpu_memory),
            "gradient_bytes": self.gradient_bytes,
            "step_peak": asdict(self.step_memory),
            "reserve": dict(self.reserve),
            "checkpoint": dict(self.checkpoint),
            "gpu_total": self.gpu_total,
            "gpu_capacity": self.gpu_capacity,
            "gpu_usable": self.gpu_usable,
            "host_memory": dict(self.host_memory),
            "host_total": self.host_total,
            "host_capacity": self.host_capacity,
            "recompute": asdict(self.recompute),
            "activation_terms": {
                "outside": dict(self.activations.outside),
                "per_layer": [dict(layer.terms) for layer in self.activations.layers],
            },
            "traffic": [t.to_dict() for t in self.traffic],
            "all_to_all_alternative": (
                None if self.all_to_all_alternative is None else self.all_to_all_alternative.to_dict()
            ),
            "time": dict(self.time),
            "node_limit": None if self.node_limit is None else dict(self.node_limit),
            "fits": self.fits,
            "overflow": self.overflow,
            "notes": list(self.notes),
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
        }

    def format_table(self) -> str:
        """The plan as a text table."""
        from moetrain.planner.report import format_plan

        return format_plan(self)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def make_plan(
    model: ModelDescription, cluster: ClusterSpec, settings: PlanSettings, kernels: str = "cuda"
) -> Plan:
    """Memory, traffic and time of ``model`` trained with ``settings`` on ``cluster`` (see the
    module docstring). ``kernels``: whose saving rules the activation model applies, ``"cuda"``
    (the GPUs planned for) or ``"cpu"`` (to compare with a run on this machine). ValueError when
    the layout is impossible (ep_size not dividing the world size or the expert count, an
    unsupported precision on the GPU, ...). ``settings.seq_len`` None is planned as the model's
    maximum, and the plan's ``settings`` say which."""
    layout = layout_stage(model, cluster, settings, kernels)
    memory = memory_stage(model, cluster, layout, kernels)
    traffic = traffic_stage(model, cluster, layout)
    time = time_stage(model, cluster, layout, memory.recompute, traffic.traffic)
    return report_stage(model, cluster, layout, memory, traffic, time)


def report_stage(
    model: ModelDescription,
    cluster: ClusterSpec,
    layout: PlanLayout,
    memory: PlanMemory,
    traffic: PlanTraffic,
    time: dict[str, float],
) -> Plan:
    """The :class:`Plan` of the stages' records (the notes: the layout's, then the traffic's)."""
    arch, ep, tp = model.arch, layout.ep, layout.tp
    return Plan(
        model=model.name,
        cluster=cluster,
        settings=layout.settings,
        world_size=layout.world,
        dp_size=layout.stage_world,
        expert_dp_size=layout.stage_world // (ep * tp),
        all_to_all=layout.algorithm,
        capacity_factor=layout.cf,
        params={
            "total": model.params.total,
            "dense": layout.dense,
            "expert_total": model.params.expert_total,
            "expert_per_rank": layout.experts,
            "per_rank": layout.per_rank,
            "experts_per_rank_per_layer": arch.moe.num_experts // ep if arch.moe_layers else 0,
        },
        gpu_memory=memory.gpu,
        gradient_bytes=memory.gradient_bytes,
        step_memory=memory.step_memory,
        reserve=memory.reserve,
        checkpoint=memory.checkpoint,
        gpu_capacity=cluster.gpu.memory_bytes,
        gpu_usable=memory.usable,
        host_memory=memory.host,
        host_capacity=cluster.host_memory_bytes,
        recompute=memory.recompute,
        activations=layout.acts,
        traffic=traffic.traffic,
        all_to_all_alternative=traffic.alternative,
        time=time,
        notes=[*layout.notes, *traffic.notes],
        pipeline=layout.pipeline,
        node_limit=traffic.node_limit,
    )
