"""Text tables of a :class:`~moetrain.planner.plan.Plan` and a recommendation."""

from __future__ import annotations

from moetrain.planner.plan import GPU_MEMORY_TERMS
from moetrain.planner.reserve import FRAGMENTATION

GiB = 2**30

_GPU_LABELS = {
    "weights": "weights",
    "optimizer_states": "optimizer states",
    "all_to_all_buffers": "all-to-all buffers",
    "ddp_buckets": "DDP gradient buckets",
    "step_peak": "step peak (activations, gradients, working)",
    "reserved": "reserved",
}
_HOST_LABELS = {
    "offloaded_states": "offloaded optimizer states",
    "pinned_staging": "pinned staging",
    "checkpoint_staging": "checkpoint staging (async)",
    "reserved": "reserved (OS, data loading, runtime)",
}


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:8.2f}"


def _count(value: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3f}{unit}"
    return f"{value:.0f}"


def _bytes(value: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def describe_settings(plan) -> str:
    s = plan.settings
    experts = plan.params["experts_per_rank_per_layer"]
    seq = f"{s.seq_len} tokens"
    image = plan.activations.tokens // s.micro_batch - s.seq_len
    if image:
        seq += f" + {image} image patches"
    cf = "dropless" if plan.capacity_factor is None else f"capacity factor {plan.capacity_factor:g}"
    if not experts:
        cf = "no routing"
    precision = s.precision + (" (autocast, fp32 weights)" if s.autocast else "")
    layout = (
        f"ep_size {s.ep_size} ({experts} experts per layer per GPU, expert-DP {plan.expert_dp_size})"
        if experts
        else "no MoE layer (data parallel only)"
    )
    return (
        f"{layout}, "
        f"micro-batch {s.micro_batch} x {seq}, grad_accum {s.grad_accum}, {precision}, "
        f"offload {_offload(s)}, recompute {s.recompute}, "
        f"all-to-all {plan.all_to_all}{_chunks(plan)}, {cf}, "
        f"compute efficiency {s.compute_efficiency:g}"
    )


def _offload(s) -> str:
    """``on``, ``on (delayed update)`` or ``off``."""
    if not s.offload:
        return "off"
    return "on (delayed update)" if s.optim_overlap == "delayed" else "on"


def _offload_short(s) -> str:
    """The recommendation table's offload column: ``off``, ``on`` or ``delayed``."""
    return "delayed" if s.offload and s.optim_overlap == "delayed" else ("on" if s.offload else "off")


def _optimizer_term(plan) -> str:
    """``optimizer 5741.0 ms`` or, delayed, ``optimizer 412.3 ms exposed (host step 5741.0 ms behind
    the next step's device work, delayed update)``."""
    tm = plan.time
    if plan.settings.offload and plan.settings.optim_overlap == "delayed":
        return (
            f"optimizer {tm['optimizer_exposed_s'] * 1e3:.1f} ms exposed (host step "
            f"{tm['optimizer_s'] * 1e3:.1f} ms behind the next step's device work, delayed update)"
        )
    return f"optimizer {tm['optimizer_s'] * 1e3:.1f} ms"


def _chunks(plan) -> str:
    """`` in 4 chunks (auto)`` when the all-to-all is chunked (or chunks were asked for)."""
    chunks, asked = plan.time.get("a2a_chunks", 1), plan.settings.a2a_chunks
    if chunks == 1 and asked in (1, "auto"):
        return ""
    return f" in {chunks} chunks" + (" (auto)" if asked == "auto" else "")


def _all_to_all_term(tm: dict) -> str:
    """``all-to-all 8.6 ms``; chunked, the latency its chunks add (part of ``all_to_all_s``) and
    what they hide, both >= 0: ``all-to-all 8.6 ms + 0.1 ms latency of its 2 chunks - 1.5 ms hidden
    behind the experts``."""
    chunks, latency = tm.get("a2a_chunks", 1), tm.get("all_to_all_chunk_latency_s", 0.0)
    if chunks == 1:
        return f"all-to-all {tm['all_to_all_s'] * 1e3:.1f} ms"
    return (
        f"all-to-all {(tm['all_to_all_s'] - latency) * 1e3:.1f} ms + {latency * 1e3:.1f} ms latency of "
        f"its {chunks} chunks - {tm['all_to_all_hidden_s'] * 1e3:.1f} ms hidden behind the experts"
    )


def recompute_summary(plan) -> str:
    r = plan.recompute
    if not r.recomputed:
        return "nothing recomputed"
    whole = sum(1 for n in r.recomputed if n.count(".") == 1)
    parts: dict[str, int] = {}
    for name in r.recomputed:
        if name.count(".") == 2:
            parts[name.rsplit(".", 1)[1]] = parts.get(name.rsplit(".", 1)[1], 0) + 1
    pieces = ([f"{whole} whole layers"] if whole else []) + [
        f"{n} x {part}" for part, n in sorted(parts.items())
    ]
    return "recompute " + ", ".join(pieces)


def step_peak_lines(plan) -> list[str]:
    """The step peak's parts, indented under it, and the activations kept with the recompute plan."""
    step, r = plan.step_memory, plan.recompute
    return [
        f"    {'activations held at the peak':<44} {_gib(step.activations)}",
        f"    {'gradients allocated at the peak':<44} {_gib(step.gradients)}  "
        f"(of {plan.gradient_bytes / GiB:.2f})",
        f"    {'working memory':<44} {_gib(step.working)}",
        f"    {'activations kept by the forward':<44} {_gib(r.activation_bytes)}  (without recompute "
        f"{r.baseline_bytes / GiB:.2f}; {recompute_summary(plan)})",
    ]


_RESERVE_LABELS = {
    "cuda_context": "CUDA context, cuBLAS",
    "fragmentation": f"allocator fragmentation ({FRAGMENTATION:.0%} of the step's)",
    "given": "as given (--gpu-reserved-gib)",
}


def reserve_lines(plan) -> list[str]:
    """The reserve by term: the CUDA context, NCCL per communicator, fragmentation."""
    from moetrain.planner.reserve import figures_for

    lines, assumed = [], figures_for(plan.cluster.gpu.name).assumed
    for term, value in plan.reserve.items():
        label = (
            _RESERVE_LABELS.get(term) or f"NCCL, {term.removeprefix('nccl_').replace('_', ' ')} communicator"
        )
        note = ""
        if term.startswith("nccl_") and assumed:
            note, assumed = f"  ({assumed})", ""  # once, on the first NCCL line
        lines.append(f"    {label:<44} {_gib(value)}{note}")
    return lines


def checkpoint_line(plan) -> str:
    """Checkpoint size per rank and per run, and how it is written."""
    how = (
        "written in the background from the host copy above"
        if plan.settings.async_checkpoint
        else "written synchronously (no host copy)"
    )
    return (
        f"checkpoint: {_bytes(plan.checkpoint['rank_bytes'])} per GPU, "
        f"{_bytes(plan.checkpoint['run_bytes'])} per run (weights and optimizer states), {how}"
    )


def gpu_total_line(plan) -> str:
    """``total / usable`` with the verdict, the GiB to spare (negative: over) and how the usable
    memory follows from the capacity and the headroom."""
    verdict = "fits" if plan.gpu_total <= plan.gpu_usable else "DOES NOT FIT"
    spare = (plan.gpu_usable - plan.gpu_total) / GiB
    margin = f"{spare:.2f} GiB to spare" if spare >= 0 else f"over by {-spare:.2f} GiB"
    return (
        f"  {'total / usable':<46} {_gib(plan.gpu_total)} / {plan.gpu_usable / GiB:.2f}  {verdict} "
        f"({margin}; usable = {plan.gpu_capacity / GiB:.2f} GiB less "
        f"{plan.headroom_label} headroom)"
    )


def node_limit_lines(plan) -> list[str]:
    """With ``max_nodes_per_token``: the nodes a token's rows reach, the inter-node row bytes of a
    per-slot all-to-all (unchanged by the limit) and of node_dedup (which the limit reduces)."""
    nl = plan.node_limit
    if nl is None:
        return []
    m, k, n = nl["max_nodes_per_token"], nl["rows_per_token"], nl["ep_nodes"]
    unlimited = nl["nodes_reached_per_token_unlimited"]
    if nl["binds"]:
        reach = f"{nl['nodes_reached_per_token']:.2f}" if nl["exact"] else f"at most {m}"
        head = f"a token's {k} rows reach {reach} nodes ({unlimited:.2f} without the limit)"
    else:
        head = f"no effect (top_k {k}: a token's rows reach {unlimited:.2f} nodes, never more than {k})"
    used = nl["all_to_all"]
    per_slot = nl["per_slot_all_to_all"]
    share = 100 * nl["cross_node_row_share"]
    lines = [
        "",
        f"node-limited routing, max_nodes_per_token {m}, EP group over {n} node{'s' * (n > 1)}: {head}",
        "  inter-node all-to-all bytes per GPU per step:",
        f"    {per_slot} (one row per routed slot; {share:.1f}% of the rows cross nodes, limit or not): "
        f"{_bytes(nl['per_slot_inter_node_bytes'])}{', used' if used != 'node_dedup' else ''}",
    ]
    dedup = nl["node_dedup_inter_node_bytes"]
    if dedup is None:
        lines.append("    node_dedup (one copy per token and node reached): needs a regular node grid")
    else:
        lines.append(
            f"    node_dedup (one copy per token and node reached): {_bytes(dedup)} "
            f"({_bytes(nl['node_dedup_inter_node_bytes_unlimited'])} without the limit)"
            f"{', used' if used == 'node_dedup' else ''}"
        )
    return lines


def format_plan(plan) -> str:
    """Header, GPU memory, host memory, traffic and time tables, notes."""
    p = plan.params
    lines = [
        f"moetrain plan: {plan.model} on {plan.cluster.describe()}",
        f"settings: {describe_settings(plan)}",
        f"parameters: {_count(p['total'])} total = {_count(p['dense'])} dense + {_count(p['expert_total'])} "
        f"experts; per GPU {_count(p['per_rank'])} ({_count(p['dense'])} dense + "
        f"{_count(p['expert_per_rank'])} experts)",
        "",
        f"{'GPU memory per GPU':<48} {'GiB':>8}",
    ]
    for key in GPU_MEMORY_TERMS:
        label, value = _GPU_LABELS[key], plan.gpu_memory[key]
        extra = ""
        if key == "optimizer_states" and plan.settings.offload:
            extra = "  (offloaded to host)"
        if key == "step_peak":
            extra = f"  (at the {plan.step_memory.where})"
        lines.append(f"  {label:<46} {_gib(value)}{extra}")
        if key == "step_peak":
            lines += step_peak_lines(plan)
        if key == "reserved":
            lines += reserve_lines(plan)
    lines.append(gpu_total_line(plan))
    lines += ["", f"{'host memory per node':<48} {'GiB':>8}"]
    for key, label in _HOST_LABELS.items():
        lines.append(f"  {label:<46} {_gib(plan.host_memory[key])}")
    verdict = "fits" if plan.host_total <= plan.host_capacity else "DOES NOT FIT"
    lines.append(
        f"  {'total / capacity':<46} {_gib(plan.host_total)} / {plan.host_capacity / GiB:.2f}  {verdict}"
    )
    lines.append(checkpoint_line(plan))
    lines += [
        "",
        f"{'traffic per GPU per step':<28} {'calls':>7} {'intra-node':>12} {'inter-node':>12} "
        f"{'messages':>9} {'est. ms':>9}",
    ]
    for t in plan.traffic:
        name = t.name + (f" ({plan.all_to_all})" if t.name == "all_to_all" else "")
        lines.append(
            f"  {name:<26} {t.calls:>7} {_bytes(t.intra_bytes):>12} {_bytes(t.inter_bytes):>12} "
            f"{t.intra_messages + t.inter_messages:>9} {t.seconds * 1e3:>9.1f}"
        )
    alt = plan.all_to_all_alternative
    if alt is not None:
        name = alt.name.replace("all_to_all_", "all_to_all (") + ", not used)"
        lines.append(
            f"  {name:<26} {alt.calls:>7} {_bytes(alt.intra_bytes):>12} {_bytes(alt.inter_bytes):>12} "
            f"{alt.intra_messages + alt.inter_messages:>9} {alt.seconds * 1e3:>9.1f}"
        )
    lines += node_limit_lines(plan)
    tm = plan.time
    lines += [
        "",
        "time per step (only the chunked all-to-all overlaps; DDP's overlap with backward is not counted)",
        f"  compute {tm['compute_s'] * 1e3:.1f} ms + recompute {tm['recompute_s'] * 1e3:.1f} ms + "
        f"{_all_to_all_term(tm)} + gradient sync {tm['grad_sync_s'] * 1e3:.1f} ms + "
        f"{_optimizer_term(plan)} = {tm['step_s'] * 1e3:.1f} ms",
        f"  {tm['tokens_per_step']:,} tokens per step, {tm['tokens_per_s']:,.0f} tokens/s, "
        f"{tm['samples_per_s']:,.1f} samples/s, "
        f"model FLOPs utilization {100 * tm['model_flops_utilization']:.1f}%",
    ]
    if plan.pipeline is not None:
        lines += pipeline_lines(plan)
    if plan.overflow:
        lines.append(f"does not fit: {plan.overflow}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def format_recommendation(rec) -> str:
    """The best plan's table, the other fitting candidates, and why the rest were rejected."""
    lines = []
    if rec.best is None:
        lines.append("no configuration fits")
    else:
        lines += ["best configuration:", format_plan(rec.best), ""]
    lines.append(
        f"{'status':<13} {'ep':>5} {'offload':>7} {'micro':>6} {'accum':>6} {'recompute':<22} "
        f"{'GPU GiB':>8} {'tokens/s':>12}  reason"
    )
    for c in rec.candidates:
        s = c.settings
        plan = c.plan
        gib = f"{plan.gpu_total / GiB:8.2f}" if plan is not None else f"{'-':>8}"
        speed = f"{plan.tokens_per_s:12,.0f}" if plan is not None else f"{'-':>12}"
        recompute = recompute_summary(plan).replace("recompute ", "") if plan is not None else s.recompute
        lines.append(
            f"{c.status:<13} {s.ep_size:>5} {_offload_short(s):>7} {s.micro_batch:>6} "
            f"{s.grad_accum:>6} {recompute[:22]:<22} {gib} {speed}  {c.reason}"
        )
    return "\n".join(lines)


def pipeline_lines(plan) -> list[str]:
    """The pipeline ranks' memory, the bubble and the transfers (``pp_size > 1``)."""
    pipe, tm = plan.pipeline, plan.time
    lines = [
        f"pipeline: {pipe.stages} ranks x {pipe.virtual} stage(s), {pipe.schedule}, {pipe.microbatches} "
        f"micro-batches; bubble (p - 1) / (v m + p - 1) = {100 * pipe.bubble:.1f}% "
        f"({tm['pipeline_bubble_s'] * 1e3:.1f} ms of the compute), stage transfers "
        f"{tm['pipeline_p2p_s'] * 1e3:.1f} ms ({pipe.p2p_bytes / 2**20:.2f} MiB per micro-batch each way)",
        "  rank  layers      in flight  weights+grads+optimizer GiB  activations GiB  total GiB",
    ]
    for r in pipe.ranks:
        states = r.weights + r.gradients + r.optimizer_states + r.ddp_buckets
        lines.append(
            f"  {r.rank:>4}  {f'{r.layers[0]}-{r.layers[-1]}':<10}  {r.in_flight:>9}  "
            f"{states / 2**30:>27.2f}  {r.activations / 2**30:>15.2f}  {r.total / 2**30:>9.2f}"
        )
    sets = [f"grad_accum={pipe.microbatches}", f"parallel.pp_size={pipe.stages}"]
    sets += [f"parallel.pp_schedule={pipe.schedule}"]
    sets += [f"parallel.pp_virtual={pipe.virtual}"] if pipe.virtual > 1 else []
    sets += [f"parallel.pp_layers=[{','.join(map(str, pipe.boundaries))}]"]
    lines.append(
        "  this split (the planner's per-layer FLOPs) in a run: " + " ".join(f"--set {s}" for s in sets)
    )
    return lines
