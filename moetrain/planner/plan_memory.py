"""The memory stage of :func:`~moetrain.planner.plan.make_plan`: GPU memory per rank (weights,
optimizer states, all-to-all buffers, DDP's buckets, the step peak with the recompute plan it
allows, the reserve), host memory per node and the checkpoint sizes (:class:`PlanMemory`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from moetrain.comm.chunking import chunked_comm_bytes, unchunked_comm_bytes
from moetrain.planner.activations import ActivationModel, ceil_fraction
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.peak import (
    StepPeak,
    layer_working_bytes,
    loss_working_bytes,
    optimizer_step_peak,
    step_peak,
)
from moetrain.planner.plan_layout import (
    ADAM_STATE_BYTES,
    PlanLayout,
    nodes_reached,
    wire_encodes,
    wire_row_bytes,
)
from moetrain.planner.reserve import FRAGMENTATION, Communicator, reserve_terms
from moetrain.planner.settings import PlanSettings
from moetrain.recompute import RecomputeOption, solve_recompute

AUTO_TRIES = 4  # "auto": budgets tried after the first choice (each less the last one's excess)


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


@dataclass(frozen=True)
class PlanMemory:
    """What :func:`memory_stage` computed: bytes per GPU by term (``gpu``), every gradient of the rank,
    the step peak's parts, the reserve's terms, the usable GPU memory, the recompute plan, bytes
    per node by term (``host``) and the checkpoint sizes."""

    gpu: dict[str, int]
    gradient_bytes: int
    step_memory: StepPeak
    reserve: dict[str, int]
    usable: int
    recompute: RecomputeChoice
    host: dict[str, int]
    checkpoint: dict[str, int]


def memory_stage(
    model: ModelDescription, cluster: ClusterSpec, layout: PlanLayout, kernels: str
) -> PlanMemory:
    """GPU memory (with the step peak and its recompute plan), host memory and checkpoints."""
    settings, per_rank, weight_b = layout.settings, layout.per_rank, layout.weight_b
    gradient_bytes = per_rank * weight_b
    copies = per_rank * 2 if settings.autocast else 0  # autocast's low-precision weights: in the peak
    gpu = {
        "weights": per_rank * weight_b,
        "optimizer_states": 0 if settings.offload else per_rank * layout.optimizer_b,
        "all_to_all_buffers": 0,  # below, once the chunk count is known
        # DDP's gradient buckets: a flat copy of the dense gradients, kept for the whole run
        "ddp_buckets": layout.dense * weight_b if layout.world > 1 else 0,
        "step_peak": 0,
        "reserved": 0,
    }
    gpu["all_to_all_buffers"] = _all_to_all_buffers(
        layout.moe_layers, model.arch, layout.b, layout.ep, layout.algorithm, settings,
        layout.ep_layout.nodes, layout.max_nodes, layout.chunks,
    )  # fmt: skip
    communicators = plan_communicators(
        layout.stage_world, layout.ep, layout.stage_world // layout.ep, layout.algorithm, layout.ep_layout
    )
    modelled = cluster.gpu_reserved_bytes is None
    if modelled:
        reserve = reserve_terms(cluster.gpu.name, cluster.gpus_per_node, communicators, 0)
        fixed_reserve = sum(reserve.values())
    else:
        reserve = {"given": cluster.gpu_reserved_bytes}
        fixed_reserve = cluster.gpu_reserved_bytes
    usable = settings.usable_memory(cluster.gpu.memory_bytes)
    # "auto": the activation budget is what the rest leaves of the usable memory (fragmentation on
    # the dynamic part included)
    fragmentation = FRAGMENTATION if modelled else 0.0  # of the step peak and the all-to-all buffers
    room = int(
        (usable - sum(gpu.values()) - fixed_reserve - fragmentation * gpu["all_to_all_buffers"])
        / (1 + fragmentation)
    )
    recompute, memory_peak = _step_peak(model, layout, kernels, room, gradient_bytes, copies)
    gpu["step_peak"] = memory_peak.total
    if modelled:
        dynamic = memory_peak.total + gpu["all_to_all_buffers"]
        reserve = reserve_terms(cluster.gpu.name, cluster.gpus_per_node, communicators, dynamic)
    gpu["reserved"] = sum(reserve.values())
    host, checkpoint = _host_memory(model, cluster, layout)
    return PlanMemory(gpu, gradient_bytes, memory_peak, reserve, usable, recompute, host, checkpoint)


def _step_peak(
    model: ModelDescription, layout: PlanLayout, kernels: str, room: int, gradient_bytes: int, copies: int
) -> tuple[RecomputeChoice, StepPeak]:
    """The recompute plan and the step peak with it; ``room``: the bytes the step peak may take."""
    arch, acts, settings, b, ep = model.arch, layout.acts, layout.settings, layout.b, layout.ep
    flops_per_s, weight_b = layout.flops_per_s, layout.weight_b
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
        other_gradients += layout.experts * 2
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
            layout.work,
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

    # "auto": a first choice assumes every gradient, copy and the largest working set on top of the
    # kept activations; a second one uses what that choice's peak puts on top of them, and is taken
    # when it fits. The knapsack does not see every byte a choice keeps (the weight copies of the
    # layers it does not recompute), so a second choice over the room is tried again with a budget
    # less the excess and below its own bytes, a few times. A choice is feasible when its peak fits
    # the room.
    recompute = choose_recompute(
        acts, settings, flops_per_s, max(room - gradient_bytes - copies - working, 0)
    )
    memory_peak = peak_of(recompute)
    if settings.recompute == "auto":
        budget = max(room - (memory_peak.total - recompute.activation_bytes), 0)
        for _ in range(AUTO_TRIES):
            second = choose_recompute(acts, settings, flops_per_s, budget)
            second_peak = peak_of(second)
            if second.feasible and second_peak.total <= room:
                recompute, memory_peak = second, second_peak
                break
            if not second.feasible or budget == 0:
                break
            # less the excess, and below this choice's bytes so that the next choice keeps less
            budget = max(min(budget - (second_peak.total - room), second.activation_bytes - 1), 0)
        if not recompute.feasible and memory_peak.total <= room:
            recompute = replace(recompute, feasible=True)  # below its first, pessimistic budget
    if not settings.offload:  # one temporary of one state's size (the state has the weight's dtype)
        optimizer_peak = optimizer_step_peak(gradient_bytes, layout.per_rank * weight_b, memory_peak.total)
        if optimizer_peak.total > memory_peak.total:
            memory_peak = optimizer_peak
        else:
            memory_peak = replace(
                memory_peak, backward_total=memory_peak.total, optimizer_total=optimizer_peak.total
            )
    pipeline = layout.pipeline
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
    return recompute, memory_peak


def _host_memory(
    model: ModelDescription, cluster: ClusterSpec, layout: PlanLayout
) -> tuple[dict[str, int], dict[str, int]]:
    """Host memory per node by term, and the checkpoint's bytes per rank and per run."""
    settings, per_rank, weight_b = layout.settings, layout.per_rank, layout.weight_b
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
    state_b = ADAM_STATE_BYTES if settings.offload else layout.optimizer_b
    checkpoint = {
        "rank_bytes": per_rank * (weight_b + state_b),
        "run_bytes": model.params.total * (weight_b + state_b),
    }
    if settings.async_checkpoint:
        host["checkpoint_staging"] = cluster.gpus_per_node * checkpoint["rank_bytes"]
    return host, checkpoint


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
    row_bytes = wire_row_bytes(arch.d_model, settings.precision, settings.comm_dtype)
    permuted = rows.sent * arch.d_model * b
    sent, received = rows.sent * row_bytes, rows.received * row_bytes
    stages = 2 if algorithm == "hierarchical" else 1
    if chunks > 1:
        return permuted + math.ceil(chunked_comm_bytes(sent, received, stages, chunks))
    encoded = wire_encodes(settings.precision, settings.comm_dtype)
    total = permuted + math.ceil(unchunked_comm_bytes(sent, received, stages, encoded))
    if algorithm == "node_dedup":
        copies = rows.sent * nodes_reached(arch.moe, nodes, max_nodes) / arch.moe.top_k
        total += math.ceil(2 * copies) * row_bytes
    return total
