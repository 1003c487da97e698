"""The first stage of :func:`~moetrain.planner.plan.make_plan`: checks the layout and resolves what
every later stage reads (:class:`PlanLayout`): the parallel groups and the all-to-all algorithm,
the parameters and bytes per rank, the activation model, the pipeline and the all-to-all's chunks."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moetrain.comm import compression
from moetrain.planner.activations import ActivationModel, LayerActivations, Workload, activation_model
from moetrain.planner.comm import GroupLayout, choose_all_to_all, expert_groups, group_layout
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.node_limit import nodes_reached_per_token
from moetrain.planner.overlap import layer_overlap_inputs, plan_chunks
from moetrain.planner.peak import layer_working_bytes, loss_working_bytes
from moetrain.planner.pipeline import PipelinePlan, plan_pipeline
from moetrain.planner.settings import ITEMSIZE, MODEL_CAPACITY, PlanSettings
from moetrain.planner.split import split_plan_terms

ADAM_STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq, per parameter
ROW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a precision's rows


@dataclass(frozen=True)
class PlanLayout:
    """What :func:`layout_stage` resolved, read by the memory, traffic and time stages.

    ``settings``: with ``seq_len`` filled in (and ``recompute`` ``"none"`` under a pipeline);
    ``stage_world``: the ranks of one pipeline stage; ``peak``: the GPU's FLOP/s in the precision,
    ``flops_per_s`` that times ``compute_efficiency``; ``split``: :func:`split_plan_terms`;
    ``dense``, ``experts``, ``per_rank``: parameters per rank (the largest pipeline rank's with
    stages); ``b``: activation bytes per element, ``weight_b`` a weight's, ``optimizer_b`` the
    optimizer states' per parameter; ``max_nodes``: the nodes a token may reach (None: any);
    ``cf``: the capacity factor (None: dropless); ``work``/``acts``: the workload and its activation
    model, ``moe_layers`` the MoE layers of ``acts``, ``layers_here`` those of one rank;
    ``chunks``/``overlap``: the all-to-all's chunk count and the inputs of its overlap with the
    experts (None: not overlapped); ``notes``: what the report says about these choices."""

    settings: PlanSettings
    world: int
    ep: int
    tp: int
    pp: int
    stage_world: int
    peak: float
    flops_per_s: float
    split: dict
    dense: int
    experts: int
    per_rank: int
    b: int
    weight_b: int
    optimizer_b: int
    expert_dp_groups: list[list[int]]
    algorithm: str
    ep_layout: GroupLayout
    max_nodes: int | None
    cf: float | None
    work: Workload
    acts: ActivationModel
    moe_layers: list[LayerActivations]
    pipeline: PipelinePlan | None
    layers_here: int
    chunks: int
    overlap: tuple | None
    notes: tuple[str, ...]


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


def layout_stage(
    model: ModelDescription, cluster: ClusterSpec, settings: PlanSettings, kernels: str
) -> PlanLayout:
    """Checks the layout (ValueError when impossible) and resolves :class:`PlanLayout`."""
    settings = resolve_seq_len(model, settings)
    _check_layout(model, cluster, settings)
    world = cluster.world_size
    ep, tp, pp = settings.ep_size, settings.tp_size, settings.pp_size
    if pp > 1 and settings.recompute == "auto":
        settings = settings.replace(recompute="none")  # recompute is not planned with stages
    arch = model.arch
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
        work = replace(work, nodes_reached=nodes_reached(arch.moe, ep_layout.nodes, max_nodes))
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
    whole_build = 4 * params.total  # experts_init whole: every parameter, fp32, on every rank's host
    host_share = cluster.host_memory_bytes // cluster.gpus_per_node
    if settings.experts_init == "whole" and params.expert_total and whole_build > host_share:
        notes.append(
            f"experts_init 'whole': every rank first builds the whole model on its host "
            f"({whole_build / 2**30:,.0f} GiB in fp32), more than its share of the node's host memory "
            f"({host_share / 2**30:,.0f} GiB): set experts_init: local (each rank allocates only its own "
            "experts)"
        )
    if moe_layers and cf is None:
        notes.append(
            "dropless routing: activations assume balanced routing (N = T*k rows); an imbalanced step "
            f"can receive up to ep_size*T*k = {ep * acts.tokens * arch.moe.top_k} rows per layer"
        )

    # ---- the all-to-all's chunks (overlap with the experts)
    chunks, overlap = 1, None
    if moe_layers and ep > 1 and algorithm != "node_dedup":  # node_dedup is never chunked
        balanced = moe_layers[0].balanced_rows.sent
        overlap = layer_overlap_inputs(
            cluster, ep_layout, algorithm, balanced,
            wire_row_bytes(arch.d_model, settings.precision, settings.comm_dtype),
            arch.d_model, arch.moe.d_ff, arch.moe.activation, flops_per_s,
        )  # fmt: skip
        chunks = plan_chunks(settings.a2a_chunks, *overlap)
    return PlanLayout(
        settings, world, ep, tp, pp, stage_world, peak, flops_per_s, split, dense, experts, per_rank, b,
        weight_b, optimizer_b, expert_dp_groups, algorithm, ep_layout, max_nodes, cf, work, acts,
        moe_layers, pipeline, layers_here, chunks, overlap, tuple(notes),
    )  # fmt: skip


def _check_layout(model: ModelDescription, cluster: ClusterSpec, settings: PlanSettings) -> None:
    """ValueError when the layout is impossible (``settings.seq_len`` already resolved)."""
    world = cluster.world_size
    ep, tp, pp = settings.ep_size, settings.tp_size, settings.pp_size
    if world % (ep * tp * pp):
        raise ValueError(
            f"{f'pp_size = {pp} x ' if pp > 1 else ''}ep_size = {ep}{f' x tp_size = {tp}' if tp > 1 else ''} "
            f"must divide the world size = {world} ({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs)"
        )
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


def wire_row_bytes(d_model: int, precision: str, comm_dtype: str | None) -> int:
    """Bytes of one row of ``precision`` on the wire, as the run sends it
    (:func:`moetrain.comm.compression.wire_row_bytes`): ``D*b`` unencoded or on its own dtype's
    wire, ``D*2`` on the bf16 wire, ``(D+1)*2`` on the scaled fp16 wire for fp32 and bf16 rows (the
    exponent column)."""
    return compression.wire_row_bytes(d_model, ROW_DTYPES[precision], comm_dtype)


def wire_encodes(precision: str, comm_dtype: str | None) -> bool:
    """Whether rows of ``precision`` are encoded into a buffer of their own before the wire (a wire
    of another dtype: :func:`moetrain.comm.compression.encode_rows`)."""
    return comm_dtype is not None and ROW_DTYPES[precision] != compression.WIRE_DTYPES[comm_dtype]


def nodes_reached(moe, nodes: int, max_nodes: int | None) -> float:
    """Nodes one token's rows reach (:func:`~moetrain.planner.node_limit.nodes_reached_per_token`)."""
    return nodes_reached_per_token(moe.num_experts, moe.top_k, nodes, moe.num_prototypes, max_nodes)
