"""The time stage of :func:`~moetrain.planner.plan.make_plan`: seconds per optimizer step (compute,
recompute, all-to-all (with the latency its chunks add) less what hides behind the experts,
gradient sync, tensor-parallel all-reduces, the optimizer step or what of it the delayed update
exposes, the pipeline's bubble and point-to-point), tokens and samples per second and the model
FLOPs utilization."""

from __future__ import annotations

from moetrain.planner.comm import Traffic
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.overlap import chunk_latency_seconds, hidden_behind_experts
from moetrain.planner.plan_layout import PlanLayout
from moetrain.planner.plan_memory import RecomputeChoice

CPU_ADAM_STATE_TRAFFIC = 24  # master, exp_avg, exp_avg_sq read and written: 3 x 4 x 2 bytes
GPU_ADAM_TRAFFIC = 28  # bytes per parameter an Adam step moves on the GPU (states + grad + weight)


def time_stage(
    model: ModelDescription,
    cluster: ClusterSpec,
    layout: PlanLayout,
    recompute: RecomputeChoice,
    traffic: list[Traffic],
) -> dict[str, float]:
    """Seconds per optimizer step by term, and the throughput they give (see the plan's docstring)."""
    arch, settings, acts, split = model.arch, layout.settings, layout.acts, layout.split
    tp, pp, world, per_rank, weight_b = layout.tp, layout.pp, layout.world, layout.per_rank, layout.weight_b
    flops_per_s, peak, pipeline = layout.flops_per_s, layout.peak, layout.pipeline
    overlap, chunks, layers_here = layout.overlap, layout.chunks, layout.layers_here
    accum = settings.grad_accum
    forward = acts.forward_flops - (split["flops"] * settings.micro_batch * (1 - 1 / tp))
    compute = accum * 3 * forward / flops_per_s
    recompute_s = accum * recompute.extra_flops / flops_per_s
    a2a_s = sum(t.seconds for t in traffic if t.name.startswith("all_to_all"))
    hidden_s = chunk_latency_s = 0.0  # chunk_latency_s: part of a2a_s
    if overlap is not None:  # per MoE layer and micro-step (see moetrain.planner.overlap)
        cost, expert_s = overlap
        hidden_s = layers_here * accum * hidden_behind_experts(cost, expert_s, chunks)
        chunk_latency_s = layers_here * accum * chunk_latency_seconds(cost, chunks)
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
    return {
        "compute_s": compute,
        "recompute_s": recompute_s,
        "all_to_all_s": a2a_s,
        "all_to_all_chunk_latency_s": chunk_latency_s,
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
