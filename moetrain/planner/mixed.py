"""Expected speed-up of hardware-aware batch balancing on a cluster of mixed GPU types.

For every GPU type the planner gives (from the same formulas as :func:`make_plan`, for the whole
mixed world): forward FLOPs per sequence split into the part that follows the rank's own batch
(``f_own``: attention, router, dense FFNs, embeddings, head, and the experts when ``ep_size = 1``)
and, under expert parallelism, the expert FFN rows a rank computes for the whole EP group
(``f_expert`` per sequence of the *average* rank: with balanced routing every rank's experts see
``k * mean tokens`` rows however its own batch is sized); and the most sequences it fits
(``memory_limit``: the largest micro-batch for which the plan fits that GPU, within its usable
memory: capacity less ``settings.memory_headroom``).

Rank r then needs ``3 * (n_r * f_own + (N / W) * f_expert) / (peak_r * compute_efficiency)`` seconds
of compute per micro-step; :func:`moetrain.balance.balance_batch` minimises the largest, with the
expert part as each rank's fixed overhead. The step time adds the time every rank waits for
together (all-to-all less what its chunks hide behind the experts, gradient sync, optimizer step:
the slowest type's, from its plan at the uniform micro-batch). Caveat: memory limits assume EP
peers run the same micro-batch (received rows depend on the others' batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moetrain.balance import BatchAssignment, balance_batch
from moetrain.planner.activations import activation_model, ffn_flops
from moetrain.planner.hardware import cluster_preset
from moetrain.planner.model import ModelDescription
from moetrain.planner.plan import make_plan, workload
from moetrain.planner.settings import PlanSettings


@dataclass(frozen=True)
class GPUGroupRate:
    """One GPU type of the mixed cluster: ``ranks`` of it, seconds of compute per own sequence,
    fixed expert seconds per micro-step, and the most sequences that fit."""

    gpu: str
    ranks: int
    seconds_per_sequence: float
    expert_seconds: float
    memory_limit: int


@dataclass(frozen=True)
class MixedClusterPlan:
    """Balanced vs uniform micro-batches on a mixed cluster. Step times in seconds per micro-step;
    ``speedup = uniform_step_s / balanced_step_s`` (inf if uniform batches do not fit)."""

    global_batch: int
    groups: tuple[GPUGroupRate, ...]
    assignment: BatchAssignment
    common_s: float
    balanced_step_s: float
    uniform_step_s: float

    @property
    def speedup(self) -> float:
        return self.uniform_step_s / self.balanced_step_s

    def micro_batches_by_gpu(self) -> dict[str, list[int]]:
        out, start = {}, 0
        for group in self.groups:
            out.setdefault(group.gpu, []).extend(self.assignment.micro_batches[start : start + group.ranks])
            start += group.ranks
        return out

    def to_dict(self) -> dict:
        return {
            "global_batch": self.global_batch,
            "groups": [g.__dict__ for g in self.groups],
            "assignment": self.assignment.to_dict(),
            "common_s": self.common_s,
            "balanced_step_s": self.balanced_step_s,
            "uniform_step_s": self.uniform_step_s,
            "speedup": self.speedup,
        }

    def format_table(self) -> str:
        lines = [
            f"hardware-aware batch balancing, global batch {self.global_batch} sequences",
            f"{'GPU':<12} {'ranks':>6} {'ms/seq':>9} {'expert ms':>10} {'mem limit':>10} {'balanced n':>12} "
            f"{'uniform n':>10}",
        ]
        uniform = self.global_batch // sum(g.ranks for g in self.groups)
        by_gpu = self.micro_batches_by_gpu()
        for g in self.groups:
            sizes = sorted(set(by_gpu[g.gpu]))
            shown = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
            lines.append(
                f"{g.gpu:<12} {g.ranks:>6} {g.seconds_per_sequence * 1e3:>9.2f} "
                f"{g.expert_seconds * 1e3:>10.2f} {g.memory_limit:>10} {shown:>12} {uniform:>10}"
            )
        lines.append(
            f"step: balanced {self.balanced_step_s * 1e3:.1f} ms vs uniform "
            f"{self.uniform_step_s * 1e3:.1f} ms (common {self.common_s * 1e3:.1f} ms): "
            f"speed-up {self.speedup:.2f}x"
        )
        return "\n".join(lines)


def _largest_fitting_batch(model, cluster, settings: PlanSettings, upper: int) -> int:
    """Largest micro-batch in [1, upper] whose plan fits (0 if none): the plans' memory grows with
    the micro-batch, so a doubling then bisection search finds it."""

    def fits(m: int) -> bool:
        return make_plan(model, cluster, settings.replace(micro_batch=m, grad_accum=1)).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= upper and fits(high):
        low, high = high, high * 2
    high = min(high, upper + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def plan_mixed_cluster(
    model: ModelDescription,
    parts: Sequence[tuple[str, int]],
    settings: PlanSettings,
    global_batch: int,
    gpus_per_node: int = 8,
    **cluster_overrides,
) -> MixedClusterPlan:
    """``parts``: ``(GPU preset, nodes)`` pairs, e.g. ``[("v100-32gb", 4), ("p100-16gb", 4)]``;
    ``global_batch``: sequences per micro-step over all ranks. ``settings.micro_batch`` is ignored
    (the balancing chooses it). Returns balanced vs uniform step times (module docstring)."""
    if not parts:
        raise ValueError("parts must list (GPU preset, nodes) pairs, got none")
    nodes = sum(n for _, n in parts)
    world = nodes * gpus_per_node
    groups, speeds, overheads, limits = [], [], [], []
    common = 0.0
    uniform = max(1, global_batch // world)
    arch = model.arch
    for gpu, count in parts:
        cluster = cluster_preset(gpu, nodes, gpus_per_node=gpus_per_node, **cluster_overrides)
        flops_per_s = cluster.gpu.flops_for(settings.precision) * settings.compute_efficiency
        one = activation_model(arch, workload(model, settings.replace(micro_batch=1)))
        expert_flops = 0.0
        if settings.ep_size > 1:
            for layer in one.layers:
                if layer.is_moe:
                    rows = layer.balanced_rows.received
                    expert_flops += ffn_flops(rows, arch.d_model, arch.moe.d_ff, arch.moe.activation)
        per_sequence = 3 * (one.forward_flops - expert_flops) / flops_per_s
        expert_s = 3 * expert_flops * (global_batch / world) / flops_per_s
        limit = _largest_fitting_batch(model, cluster, settings, global_batch)
        if limit == 0:
            raise ValueError(f"not even one sequence per GPU fits on {gpu} with these settings")
        ranks = count * gpus_per_node
        groups.append(GPUGroupRate(gpu, ranks, per_sequence, expert_s, limit))
        speeds += [1.0 / per_sequence] * ranks
        overheads += [expert_s] * ranks
        limits += [limit] * ranks
        plan = make_plan(model, cluster, settings.replace(micro_batch=min(uniform, limit), grad_accum=1))
        t = plan.time
        exposed_a2a = t["all_to_all_s"] - t["all_to_all_hidden_s"]  # with a2a_chunks, less what hides
        waiting = exposed_a2a + t["grad_sync_s"] + t["optimizer_exposed_s"]
        common = max(common, waiting)
    assignment = balance_batch(global_batch, speeds, limits, overheads)
    return MixedClusterPlan(
        global_batch=global_batch,
        groups=tuple(groups),
        assignment=assignment,
        common_s=common,
        balanced_step_s=assignment.step_time + common,
        uniform_step_s=assignment.uniform_step_time + common,
    )
