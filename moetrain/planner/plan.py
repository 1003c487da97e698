"""One configuration on one cluster: memory per GPU and per node, traffic per collective, step time.

:func:`make_plan` puts the pieces together:

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
the all-to-all buffers are checked against measured peaks on the CPU, tests/test_planner_validation.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from moetrain.comm.chunking import chunked_comm_bytes, hidden_seconds, unchunked_comm_bytes
from moetrain.planner.activations import ActivationModel, Workload, activation_model, ceil_fraction
from moetrain.planner.comm import (
    DDP_BUCKET_BYTES,
    EXPERT_BUCKET_BYTES,
    Traffic,
    all_reduce_traffic,
    all_to_all_traffic,
    choose_all_to_all,
    expert_groups,
    group_layout,
    node_dedup_traffic,
)
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.node_limit import node_limit_figures, nodes_reached_per_token
from moetrain.planner.overlap import layer_overlap_inputs, plan_chunks
from moetrain.planner.peak import StepPeak, layer_working_bytes, loss_working_bytes, step_peak
from moetrain.planner.pipeline import PipelinePlan, plan_pipeline
from moetrain.planner.reserve import FRAGMENTATION, Communicator, reserve_terms
from moetrain.planner.settings import MODEL_CAPACITY, PlanSettings
from moetrain.planner.split import split_plan_terms
from moetrain.recompute import RecomputeOption, solve_recompute

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq, per parameter
CPU_ADAM_STATE_TRAFFIC = 24  # master, exp_avg, exp_avg_sq read and written: 3 x 4 x 2 bytes
GPU_ADAM_TRAFFIC = 28  # bytes per parameter an Adam step moves on the GPU (states + grad + weight)
GPU_MEMORY_TERMS = (
    "weights",
    "optimizer_states",
    "all_to_all_buffers",
    "ddp_buckets",
    "step_peak",
    "reserved",
)


@dataclass(frozen=True)
class RecomputeChoice:
    """What is recomputed: module names (``blocks.3``, ``blocks.4.ffn``), the activation bytes
    with and without it, and the extra forward FLOPs per micro-step."""

    mode: str
    recomputed: tuple[str, ...]
    activation_bytes: int
    baseline_bytes: int
    min_activation_bytes: int
    extra_flops: float
    feasible: bool
    kept_per_layer: tuple[int, ...] = ()
    layers_recomputed: int = 0
    ffn_recomputed: tuple[bool, ...] = ()

    @property
    def layers_touched(self) -> int:
        return self.layers_recomputed


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


def resolve_capacity_factor(model: ModelDescription, settings: PlanSettings) -> float | None:
    """The training capacity factor in force: the model's when ``settings.capacity_factor`` is
    ``"model"``; 0 and None mean dropless (None)."""
    cf = (
        model.arch.moe.capacity_factor
        if settings.capacity_factor == MODEL_CAPACITY
        else settings.capacity_factor
    )
    return cf or None


def resolve_seq_len(model: ModelDescription, settings: PlanSettings) -> PlanSettings:
    """``settings`` with ``seq_len`` None replaced by the model's maximum text tokens
    (``max_seq_len``; M6: ``max_text_len``); unchanged otherwise."""
    if settings.seq_len is not None:
        return settings
    return settings.replace(seq_len=model.arch.max_seq_len)


def workload(model: ModelDescription, settings: PlanSettings, kernels: str = "cuda") -> Workload:
    """The per-rank :class:`Workload` of ``settings`` (row bound ``capacity`` for memory; ``seq_len``
    None: the model's maximum)."""
    settings = resolve_seq_len(model, settings)
    return Workload(
        batch=settings.micro_batch,
        seq_len=settings.seq_len,
        itemsize=ITEMSIZE[settings.precision],
        kernels=kernels,
        ep_size=settings.ep_size,
        capacity_factor=resolve_capacity_factor(model, settings),
        row_bound="capacity",
        target_len=settings.target_len,
    )


def choose_recompute(
    acts: ActivationModel, settings: PlanSettings, flops_per_s: float, budget_bytes: int | None
) -> RecomputeChoice:
    """Applies ``settings.recompute`` (see :class:`PlanSettings`); ``budget_bytes`` is the activation
    budget for ``"auto"`` (what the GPU has left) and ignored otherwise."""
    groups = acts.groups(flops_per_s)
    outside = acts.outside_bytes
    baseline = acts.baseline_bytes
    minimum = outside + sum(min(o.activation_bytes for o in g) for g in groups) + acts.attention_mask_bytes
    mode = settings.recompute

    def chosen(options: list[RecomputeOption], feasible: bool = True) -> RecomputeChoice:
        names = tuple(n for o in options for n in o.recomputed)
        bytes_ = outside + sum(o.activation_bytes for o in options)
        if acts.attention_mask_bytes and any(not n.endswith(".ffn") for n in names):
            bytes_ += acts.attention_mask_bytes  # a recomputed layer or attention block keeps the mask
        ms = sum(o.recompute_ms for o in options)
        kept = tuple(o.activation_bytes for o in options)
        touched = sum(1 for o in options if o.recomputed)
        # the whole layer (its last option) or its FFN: the FFN's weights are cast again in the backward
        ffn = tuple(
            o is g[-1] or any(n.endswith(".ffn") for n in o.recomputed)
            for o, g in zip(options, groups, strict=True)
        )
        return RecomputeChoice(
            mode, names, bytes_, baseline, minimum, ms * 1e-3 * flops_per_s, feasible, kept, touched, ffn
        )

    if mode == "none":
        return chosen([g[0] for g in groups])
    if mode == "full":
        return chosen([g[-1] for g in groups])
    if mode == "fraction":
        count = ceil_fraction(settings.recompute_fraction, len(groups))
        return chosen([g[-1] if i < count else g[0] for i, g in enumerate(groups)])
    budget = settings.recompute_budget_bytes if mode == "budget" else budget_bytes
    if baseline <= budget:
        return chosen([g[0] for g in groups])
    room = budget - outside - acts.attention_mask_bytes  # conservative for FFN-only plans (no mask)
    choice = solve_recompute(groups, room) if room >= 0 else None
    if choice is None:  # nothing fits: report the least memory any choice reaches, as not feasible
        return chosen([min(g, key=lambda o: (o.activation_bytes, o.recompute_ms)) for g in groups], False)
    return chosen([g[j] for g, j in zip(groups, choice, strict=True)])


def make_plan(
    model: ModelDescription, cluster: ClusterSpec, settings: PlanSettings, kernels: str = "cuda"
) -> Plan:
    """Memory, traffic and time of ``model`` trained with ``settings`` on ``cluster`` (see the
    module docstring). ``kernels``: whose saving rules the activation model applies, ``"cuda"``
    (the GPUs planned for) or ``"cpu"`` (to compare with a run on this machine). ValueError when
    the layout is impossible (ep_size not dividing the world size or the expert count, an
    unsupported precision on the GPU, ...). ``settings.seq_len`` None is planned as the model's
    maximum, and the plan's ``settings`` say which."""
    settings = resolve_seq_len(model, settings)
    world = cluster.world_size
    ep, tp, pp = settings.ep_size, settings.tp_size, settings.pp_size
    if world % (ep * tp * pp):
        raise ValueError(
            f"{f'pp_size = {pp} x ' if pp > 1 else ''}ep_size = {ep}{f' x tp_size = {tp}' if tp > 1 else ''} "
            f"must divide the world size = {world} ({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs)"
        )
    if pp > 1 and settings.recompute == "auto":
        settings = settings.replace(recompute="none")  # recompute is not planned with stages
    arch = model.arch
    if arch.moe_layers and arch.moe.num_experts % ep:
        raise ValueError(f"ep_size = {ep} must divide num_experts = {arch.moe.num_experts}")
    if settings.seq_len > arch.max_seq_len:
        raise ValueError(
            f"seq_len = {settings.seq_len} exceeds the model's maximum of {arch.max_seq_len} text tokens"
        )
    if not (arch.targets_only or arch.generic) and settings.target_len not in (None, settings.seq_len):
        raise ValueError(
            f"target_len must be None for {model.name} (a language model predicts every position), "
            f"got {settings.target_len}"
        )
    if not arch.moe_layers and ep > 1:
        raise ValueError(f"ep_size = {ep}: the model {model.name} has no MoE layer (use ep_size 1)")
    peak = cluster.gpu.flops_for(settings.precision)
    flops_per_s = peak * settings.compute_efficiency
    params = model.params
    split = split_plan_terms(model, settings, cluster)  # tensor parallelism: 1/tp of these per rank
    split_saved = split["elements"] - split["elements"] // tp if tp > 1 else 0
    dense, experts = params.dense - split_saved, params.expert_per_rank(ep)
    per_rank = dense + experts
    b = ITEMSIZE[settings.precision]
    weight_b = 4 if settings.autocast or settings.precision == "fp32" else b
    optimizer_b = 8 if weight_b == 4 else ADAM_STATE_BYTES  # an fp32 weight is its own master
    notes: list[str] = []

    stage_world = world // pp  # the ranks of one pipeline stage: ep groups and replicas live inside
    groups, expert_dp_groups = expert_groups(stage_world, ep, settings.ep_layout, tp)
    algorithm = (
        choose_all_to_all(settings.all_to_all, ep, groups, cluster.gpus_per_node) if ep > 1 else "flat"
    )
    ep_layout = group_layout(groups[0], cluster.gpus_per_node)
    max_nodes = (
        arch.moe.max_nodes_per_token
        if settings.max_nodes_per_token == MODEL_CAPACITY
        else settings.max_nodes_per_token
    )
    cf = resolve_capacity_factor(model, settings)
    work = workload(model, settings, kernels)
    if algorithm == "node_dedup":
        work = replace(work, nodes_reached=_nodes_reached(arch.moe, ep_layout.nodes, max_nodes))
    acts = activation_model(arch, work)
    moe_layers = [layer for layer in acts.layers if layer.is_moe]
    pipeline = None
    if pp > 1:  # the largest pipeline rank's parameters from here on
        pipeline = plan_pipeline(
            model, acts, settings, cluster, layer_working_bytes(arch, acts, b),
            loss_working_bytes(arch, acts, b), weight_b, optimizer_b, b, flops_per_s,
        )  # fmt: skip
        stage = pipeline.ranks[pipeline.largest]
        dense, experts, per_rank = stage.dense, stage.experts, stage.dense + stage.experts
        notes.append(
            f"pipeline: rank {stage.rank} of {pp} is the largest (layers {stage.layers[0]}-"
            f"{stage.layers[-1]}, "
            f"{stage.in_flight} stage forwards in flight under {settings.pp_schedule}); bubble "
            f"{100 * pipeline.bubble:.1f}% of the step; no recompute planned with stages"
        )
    layers_here = pipeline.moe_layers if pipeline is not None else len(moe_layers)  # MoE layers per rank
    if moe_layers and cf is None:
        notes.append(
            "dropless routing: activations assume balanced routing (N = T*k rows); an imbalanced step "
            f"can receive up to ep_size*T*k = {ep * acts.tokens * arch.moe.top_k} rows per layer"
        )

    # ---- the all-to-all's chunks (overlap with the experts) and its buffers
    chunks, overlap = 1, None
    if moe_layers and ep > 1 and algorithm != "node_dedup":  # node_dedup is never chunked
        balanced = moe_layers[0].balanced_rows.sent
        overlap = layer_overlap_inputs(
            cluster, ep_layout, algorithm, balanced, _wire_row_bytes(arch.d_model, b, settings.comm_dtype),
            arch.d_model, arch.moe.d_ff, arch.moe.activation, flops_per_s,
        )  # fmt: skip
        chunks = plan_chunks(settings.a2a_chunks, *overlap)

    # ---- GPU memory
    gradient_bytes = per_rank * weight_b
    copies = per_rank * 2 if settings.autocast else 0  # autocast's low-precision weights: in the peak
    gpu = {
        "weights": per_rank * weight_b,
        "optimizer_states": 0 if settings.offload else per_rank * optimizer_b,
        "all_to_all_buffers": 0,  # below, once the chunk count is known
        # DDP's gradient buckets: a flat copy of the dense gradients, kept for the whole run
        "ddp_buckets": dense * weight_b if world > 1 else 0,
        "step_peak": 0,
        "reserved": 0,
    }
    gpu["all_to_all_buffers"] = _all_to_all_buffers(
        moe_layers, arch, b, ep, algorithm, settings, ep_layout.nodes, max_nodes, chunks
    )
    communicators = plan_communicators(stage_world, ep, stage_world // ep, algorithm, ep_layout)
    modelled = cluster.gpu_reserved_bytes is None
    if modelled:
        reserve = reserve_terms(cluster.gpu.name, cluster.gpus_per_node, communicators, 0)
        fixed_reserve = sum(reserve.values())
    else:
        reserve = {"given": cluster.gpu_reserved_bytes}
        fixed_reserve = cluster.gpu_reserved_bytes
    usable = settings.usable_memory(cluster.gpu.memory_bytes)
    working = max([loss_working_bytes(arch, acts, b), *layer_working_bytes(arch, acts, b)])
    layer_elements = [count.per_rank(ep) for count in model.layer_params]
    layer_gradients = [elements * weight_b for elements in layer_elements]
    if settings.grad_accum > 1:  # micro-steps after the first start with every gradient allocated
        layer_gradients, other_gradients, input_gradients = [0] * len(layer_gradients), gradient_bytes, 0
    else:
        input_gradients = model.input_params * weight_b  # after layer 0's backward
        other_gradients = gradient_bytes - sum(layer_gradients) - input_gradients
    cpu_buffers = kernels == "cpu" and copies > 0
    if cpu_buffers:  # the CPU grouped GEMM keeps every layer's low-precision expert-gradient buffer
        other_gradients += experts * 2
    layer_copies = [2 * elements for elements in layer_elements] if copies else None
    other_copies = copies - sum(layer_copies) if copies else 0

    def peak_of(choice: RecomputeChoice) -> StepPeak:
        kept_copies = None
        if layer_copies:  # a recomputed layer's (or FFN's) weight copies are not kept from the forward
            pairs = zip(layer_copies, choice.ffn_recomputed, strict=True)
            kept_copies = [0 if rebuilt else c for c, rebuilt in pairs]
        return step_peak(
            arch,
            acts,
            work,
            choice.kept_per_layer,
            layer_gradients,
            other_gradients,
            layer_copies,
            other_copies,
            transient_low_precision_grads=not cpu_buffers,
            kept_copies=kept_copies,
            replayed=choice.ffn_recomputed,
            input_gradients=input_gradients,
        )

    # "auto": the activation budget is what the rest leaves of the usable memory (fragmentation on
    # the dynamic part included). A first choice assumes every gradient, copy and the largest
    # working set on top of the kept activations; a second one uses what that choice's peak puts on
    # top of them, and is taken when it fits.
    fragmentation = FRAGMENTATION if modelled else 0.0  # of the step peak and the all-to-all buffers
    room = int(
        (usable - sum(gpu.values()) - fixed_reserve - fragmentation * gpu["all_to_all_buffers"])
        / (1 + fragmentation)
    )
    recompute = choose_recompute(
        acts, settings, flops_per_s, max(room - gradient_bytes - copies - working, 0)
    )
    memory_peak = peak_of(recompute)
    if settings.recompute == "auto":
        on_top = memory_peak.total - recompute.activation_bytes
        second = choose_recompute(acts, settings, flops_per_s, max(room - on_top, 0))
        second_peak = peak_of(second)
        if second.feasible and second_peak.total <= room:
            recompute, memory_peak = second, second_peak
    if pipeline is not None:
        stage = pipeline.ranks[pipeline.largest]
        memory_peak = StepPeak(
            total=stage.activations + stage.gradients + stage.working,
            where=f"pipeline rank {stage.rank} with {stage.in_flight} stage forwards in flight",
            activations=stage.activations,
            gradients=stage.gradients,
            working=stage.working,
        )
        kept = stage.activations
        recompute = RecomputeChoice("none", (), kept, kept, kept, 0.0, True)
    gpu["step_peak"] = memory_peak.total
    if modelled:
        dynamic = memory_peak.total + gpu["all_to_all_buffers"]
        reserve = reserve_terms(cluster.gpu.name, cluster.gpus_per_node, communicators, dynamic)
    gpu["reserved"] = sum(reserve.values())

    # ---- host memory per node
    host = {
        "offloaded_states": 0,
        "pinned_staging": 0,
        "checkpoint_staging": 0,
        "reserved": cluster.host_reserved_bytes,
    }
    if settings.offload:
        group_elements = math.ceil(per_rank / settings.offload_apply_groups)
        host["offloaded_states"] = cluster.gpus_per_node * per_rank * ADAM_STATE_BYTES
        host["pinned_staging"] = cluster.gpus_per_node * 2 * group_elements * (weight_b + weight_b)
        if settings.optim_overlap == "delayed":  # the gradient snapshot and the new weights, whole
            host["pinned_staging"] = cluster.gpus_per_node * per_rank * (weight_b + weight_b)
    # ---- checkpoints: every rank saves its weights and optimizer states (experts once each)
    state_b = ADAM_STATE_BYTES if settings.offload else optimizer_b
    checkpoint = {
        "rank_bytes": per_rank * (weight_b + state_b),
        "run_bytes": params.total * (weight_b + state_b),
    }
    if settings.async_checkpoint:
        host["checkpoint_staging"] = cluster.gpus_per_node * checkpoint["rank_bytes"]

    # ---- traffic per optimizer step
    traffic = []
    alternative = None
    per_slot = ("flat", 0.0)  # a per-slot all-to-all (the chosen one, else the alternative), inter bytes
    dedup_inter = None  # limit -> inter-node row bytes of node_dedup (a grid layout only)
    accum = settings.grad_accum
    if moe_layers and ep > 1:
        rows = moe_layers[0].rows
        balanced_rows = moe_layers[0].balanced_rows.sent
        row_bytes = _wire_row_bytes(arch.d_model, b, settings.comm_dtype)
        n = layers_here * accum
        local_experts = arch.moe.num_experts // ep

        def per_slot_traffic(name: str) -> tuple[Traffic, Traffic]:
            return all_to_all_traffic(
                cluster, ep_layout, name, balanced_rows / ep, row_bytes, local_experts, 4 * n, n
            )

        def dedup(limit: int | None) -> tuple[Traffic, Traffic]:
            reached = _nodes_reached(arch.moe, ep_layout.nodes, limit)
            return node_dedup_traffic(
                cluster, ep_layout, balanced_rows, arch.moe.top_k, reached, row_bytes, local_experts, n
            )

        if ep_layout.grid:

            def dedup_inter(limit: int | None) -> float:
                return dedup(limit)[0].inter_bytes

        a2a_rows, a2a_counts = dedup(max_nodes) if algorithm == "node_dedup" else per_slot_traffic(algorithm)
        traffic += [a2a_rows, a2a_counts]
        two_d = ep_layout.grid and ep_layout.nodes > 1 and ep_layout.per_node > 1
        if algorithm == "hierarchical":
            other = "flat"
        elif algorithm == "flat":
            other = "hierarchical" if two_d else None
        else:  # node_dedup: against the per-slot algorithm "auto" picks
            other = "hierarchical" if two_d else "flat"
        per_slot = (algorithm, a2a_rows.inter_bytes)
        if other is not None:
            alt_rows, alt_counts = per_slot_traffic(other)
            alternative = Traffic(
                f"all_to_all_{other}",
                alt_rows.calls + alt_counts.calls,
                alt_rows.intra_bytes + alt_counts.intra_bytes,
                alt_rows.inter_bytes + alt_counts.inter_bytes,
                alt_rows.intra_messages + alt_counts.intra_messages,
                alt_rows.inter_messages + alt_counts.inter_messages,
                alt_rows.seconds + alt_counts.seconds,
            )
            if algorithm == "node_dedup":
                per_slot = (other, alt_rows.inter_bytes)
        if cf is not None and balanced_rows != rows.sent:
            notes.append(
                f"all-to-all bytes assume balanced routing ({balanced_rows} rows sent per layer); "
                f"at most {rows.sent} when every expert fills its capacity {rows.capacity}"
            )
    node_limit = None
    if moe_layers and max_nodes is not None:
        node_limit = node_limit_figures(arch.moe, max_nodes, ep_layout, algorithm, per_slot, dedup_inter)
    dense_layout = group_layout(list(range(0, stage_world, tp)), cluster.gpus_per_node)  # same tp index
    traffic.append(
        all_reduce_traffic(cluster, "dp_all_reduce", dense_layout, dense * weight_b, DDP_BUCKET_BYTES)
    )
    if tp > 1:
        traffic.append(
            Traffic(
                "tp_all_reduce", split["calls"], split["intra_bytes"], split["inter_bytes"],
                split["messages"], 0, split["seconds"],
            )
        )  # fmt: skip
    if experts:
        expert_layout = group_layout(expert_dp_groups[0], cluster.gpus_per_node)
        traffic.append(
            all_reduce_traffic(
                cluster, "expert_dp_all_reduce", expert_layout, experts * weight_b, EXPERT_BUCKET_BYTES
            )
        )

    # ---- time per optimizer step
    forward = acts.forward_flops - (split["flops"] * settings.micro_batch * (1 - 1 / tp))
    compute = accum * 3 * forward / flops_per_s
    recompute_s = accum * recompute.extra_flops / flops_per_s
    a2a_s = sum(t.seconds for t in traffic if t.name.startswith("all_to_all"))
    hidden_s = 0.0
    if overlap is not None:  # per MoE layer and micro-step (see moetrain.planner.overlap)
        cost, expert_s = overlap
        hidden_s = layers_here * accum * hidden_seconds(cost, expert_s, expert_s, expert_s, chunks)
    sync_s = sum(t.seconds for t in traffic if t.name.endswith("all_reduce") and t.name != "tp_all_reduce")
    tp_s = sum(t.seconds for t in traffic if t.name == "tp_all_reduce")
    h2d_s = 0.0
    if settings.offload:
        pcie = per_rank * weight_b / cluster.gpu.pcie_bandwidth
        cpu = (
            cluster.gpus_per_node
            * per_rank
            * (CPU_ADAM_STATE_TRAFFIC + 2 * weight_b)
            / cluster.host_memory_bandwidth
        )
        optimizer_s = max(pcie, cpu)
        if settings.optim_overlap == "delayed":  # grad bytes = weight bytes (gradients in the weights' dtype)
            groups_n = settings.offload_apply_groups
            optimizer_s = pcie / groups_n + max(pcie * (groups_n - 1) / groups_n, cpu)
            h2d_s = pcie
    else:
        optimizer_s = per_rank * GPU_ADAM_TRAFFIC / cluster.gpu.memory_bandwidth
    useful = accum * 3 * forward  # the model's FLOPs per data stream
    bubble_s = p2p_s = 0.0
    if pipeline is not None:  # v*m + p - 1 slots of the slowest stage, its share idle
        compute, bubble_s, p2p_s = pipeline.compute_s, pipeline.bubble_s, pipeline.p2p_s
        useful /= pp
    device_s = compute + recompute_s + a2a_s - hidden_s + sync_s + tp_s + p2p_s
    if settings.offload and settings.optim_overlap == "delayed":
        exposed_s = max(0.0, optimizer_s - device_s) + h2d_s
    else:
        exposed_s = optimizer_s
    step = device_s + exposed_s
    streams = world // (tp * pp)  # a tensor-parallel group (a pipeline) reads one data stream
    tokens = streams * settings.micro_batch * (arch.image_tokens + settings.seq_len) * accum
    time = {
        "compute_s": compute,
        "recompute_s": recompute_s,
        "all_to_all_s": a2a_s,
        "all_to_all_hidden_s": hidden_s,
        "a2a_chunks": chunks,
        "grad_sync_s": sync_s,
        "tp_all_reduce_s": tp_s,
        "optimizer_s": optimizer_s,
        "optimizer_exposed_s": exposed_s,
        "pipeline_bubble_s": bubble_s,
        "pipeline_p2p_s": p2p_s,
        "step_s": step,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "samples_per_s": streams * settings.micro_batch * accum / step,
        "model_flops_utilization": useful / (step * peak),
    }
    return Plan(
        model=model.name,
        cluster=cluster,
        settings=settings,
        world_size=world,
        dp_size=stage_world,
        expert_dp_size=stage_world // (ep * tp),
        all_to_all=algorithm,
        capacity_factor=cf,
        params={
            "total": params.total,
            "dense": dense,
            "expert_total": params.expert_total,
            "expert_per_rank": experts,
            "per_rank": per_rank,
            "experts_per_rank_per_layer": arch.moe.num_experts // ep if arch.moe_layers else 0,
        },
        gpu_memory=gpu,
        gradient_bytes=gradient_bytes,
        step_memory=memory_peak,
        reserve=reserve,
        checkpoint=checkpoint,
        gpu_capacity=cluster.gpu.memory_bytes,
        gpu_usable=usable,
        host_memory=host,
        host_capacity=cluster.host_memory_bytes,
        recompute=recompute,
        activations=acts,
        traffic=traffic,
        all_to_all_alternative=alternative,
        time=time,
        notes=notes,
        pipeline=pipeline,
        node_limit=node_limit,
    )


def plan_communicators(world: int, ep: int, expert_dp: int, algorithm: str, ep_layout) -> list[Communicator]:
    """The NCCL communicators a rank creates and uses (see :class:`moetrain.ParallelContext`): the
    world (DDP's all-reduce), the expert-data-parallel group, the EP group and, for the 2-D
    all-to-all and node_dedup, the EP group's members on this node and its peers on the other nodes."""
    communicators = []
    if world > 1:
        communicators.append(Communicator("world", "all_reduce", 0, 0))
    if ep > 1 and expert_dp > 1:
        communicators.append(Communicator("expert_dp", "all_reduce", 0, 0))
    if ep > 1:
        communicators.append(Communicator("ep", "all_to_all", ep_layout.intra_peers, ep_layout.inter_peers))
    if ep > 1 and algorithm in ("hierarchical", "node_dedup"):
        communicators.append(Communicator("ep_intra_node", "all_to_all", ep_layout.per_node - 1, 0))
        communicators.append(Communicator("ep_inter_node", "all_to_all", 0, ep_layout.nodes - 1))
    return communicators


def _wire_row_bytes(d_model: int, b: int, comm_dtype: str | None) -> int:
    """Bytes of one row on the wire: ``D*b``; ``D*2`` for a bf16/fp16 wire. (A scaled fp16 row adds
    one 16-bit column, ``(D+1)*2``, only for fp32 rows on the CPU: not a GPU case.)"""
    return d_model * (b if comm_dtype is None else 2)


def _nodes_reached(moe, nodes: int, max_nodes: int | None) -> float:
    return nodes_reached_per_token(moe.num_experts, moe.top_k, nodes, moe.num_prototypes, max_nodes)


def _all_to_all_buffers(
    moe_layers,
    arch,
    b: int,
    ep: int,
    algorithm: str,
    settings,
    nodes: int,
    max_nodes: int | None,
    chunks: int = 1,
) -> int:
    """Transient bytes of one MoE layer's exchange (the rows a capacity allows at most): the permuted
    rows it sends ``N_s*D*b`` (alive until the exchange returns), plus its wire buffers: unchunked,
    :func:`~moetrain.comm.chunking.unchunked_comm_bytes` (received rows, the encoded rows sent with
    a bf16/fp16 wire, the 2-D algorithm's stage copies); chunked,
    :func:`~moetrain.comm.chunking.chunked_comm_bytes` (the pool's peak, which the layer reports),
    ``min(2 * stages, n) * (S + R) / n``. node_dedup (never chunked) adds its copies sent and
    received, ``2*N_s*R/K`` rows (R nodes reached per token; an estimate)."""
    if not moe_layers or ep == 1:
        return 0
    rows = moe_layers[0].rows
    row_bytes = _wire_row_bytes(arch.d_model, b, settings.comm_dtype)
    permuted = rows.sent * arch.d_model * b
    sent, received = rows.sent * row_bytes, rows.received * row_bytes
    stages = 2 if algorithm == "hierarchical" else 1
    if chunks > 1:
        return permuted + math.ceil(chunked_comm_bytes(sent, received, stages, chunks))
    encoded = settings.comm_dtype is not None and b != 2
    total = permuted + math.ceil(unchunked_comm_bytes(sent, received, stages, encoded))
    if algorithm == "node_dedup":
        copies = rows.sent * _nodes_reached(arch.moe, nodes, max_nodes) / arch.moe.top_k
        total += math.ceil(2 * copies) * row_bytes
    return total
