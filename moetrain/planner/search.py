"""``recommend``: the fastest configuration that fits, and why every other one lost.

The search is exhaustive over (ep_size, offload and its overlap, micro_batch), each with the recompute mode(s)
given (default ``"auto"``: the cheapest recompute plan that fits the memory left on the GPU,
which is the best recompute budget for that configuration). "Fits" is against the usable memory,
the GPU's capacity less ``PlanSettings.memory_headroom`` (default 10%). With ``global_batch`` (sequences per
optimizer step) fixed, ``grad_accum = global_batch / (streams * micro_batch)`` follows from the
micro-batch, ``streams = world_size / (tp_size * pp_size)`` the data streams (a tensor-parallel group,
a pipeline, reads one), so every candidate trains on the same batch and tokens/s compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.plan import Plan, make_plan, resolve_seq_len
from moetrain.planner.settings import PlanSettings
from moetrain.validation import require_int

STATUSES = ("best", "fits", "slower", "does not fit", "invalid")


@dataclass
class Candidate:
    """One configuration tried: its settings, its plan (None when invalid), ``status`` (one of
    ``STATUSES``) and ``reason`` (what overflows and by how much, how much slower, or the error)."""

    settings: PlanSettings
    plan: Plan | None
    status: str
    reason: str

    def to_dict(self) -> dict:
        return {
            "settings": self.settings.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "plan": None if self.plan is None else self.plan.to_dict(),
        }


@dataclass
class Recommendation:
    """``best``: the fastest plan that fits (None if none does); ``winners``: the ``top`` fastest
    fitting candidates, best first; ``candidates``: every candidate, winners first, then the
    slower ones, then those that do not fit or are invalid."""

    best: Plan | None
    winners: list[Candidate] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def rejected(self) -> list[Candidate]:
        return [c for c in self.candidates if c.status not in ("best", "fits")]

    def to_dict(self, include_plans: bool = False) -> dict:
        """JSON-ready; the full plan of every candidate only with ``include_plans``."""

        def brief(c: Candidate) -> dict:
            out = c.to_dict()
            if not include_plans:
                out.pop("plan")
                if c.plan is not None:
                    out["gpu_total"] = c.plan.gpu_total
                    out["host_total"] = c.plan.host_total
                    out["tokens_per_s"] = c.plan.tokens_per_s
                    out["recomputed"] = list(c.plan.recompute.recomputed)
            return out

        return {
            "best": None if self.best is None else self.best.to_dict(),
            "winners": [brief(c) for c in self.winners],
            "candidates": [brief(c) for c in self.candidates],
        }

    def format_table(self) -> str:
        from moetrain.planner.report import format_recommendation

        return format_recommendation(self)


def valid_ep_sizes(model: ModelDescription, cluster: ClusterSpec) -> list[int]:
    """Every ep_size dividing both the world size and the expert count (1 for a dense model)."""
    if not model.arch.moe_layers:
        return [1]
    experts = model.arch.moe.num_experts
    return [d for d in range(1, cluster.world_size + 1) if cluster.world_size % d == 0 and experts % d == 0]


def recommend(
    model: ModelDescription,
    cluster: ClusterSpec,
    base: PlanSettings,
    *,
    ep_sizes: list[int] | None = None,
    offload: tuple[bool, ...] = (False, True),
    optim_overlaps: tuple[str, ...] = ("none",),
    micro_batches: list[int] | None = None,
    recompute: tuple[str, ...] = ("auto",),
    global_batch: int | None = None,
    top: int = 3,
) -> Recommendation:
    """Plans every combination of ``ep_sizes`` (default :func:`valid_ep_sizes`), ``offload`` (with
    offload, each of ``optim_overlaps``: ``"none"``, ``"delayed"``; without, ``"none"``),
    ``micro_batches`` (default 1, 2, 4, ... 64) and ``recompute`` modes on top of ``base``; returns
    the fastest that fit and the reason for each rejection. ``global_batch``: sequences per
    optimizer step, fixed (``grad_accum`` derived; micro-batches that do not divide it are
    invalid); None keeps ``base.grad_accum``. ``base.seq_len`` None: the model's maximum, as in
    every candidate's settings."""
    require_int("global_batch", global_batch, 1, allow_none=True, note="(sequences per step)")
    require_int("top", top, 1)
    base = resolve_seq_len(model, base)
    ep_sizes = valid_ep_sizes(model, cluster) if ep_sizes is None else list(ep_sizes)
    micro_batches = [2**i for i in range(7)] if micro_batches is None else list(micro_batches)
    streams = cluster.world_size // (base.tp_size * base.pp_size)  # data streams, as the plan counts them
    candidates: list[Candidate] = []
    layouts = [(off, overlap) for off in offload for overlap in (optim_overlaps if off else ("none",))]
    for ep in ep_sizes:
        for off, overlap in layouts:
            for micro in micro_batches:
                for mode in recompute:
                    changes = {
                        "ep_size": ep, "offload": off, "optim_overlap": overlap, "micro_batch": micro,
                        "recompute": mode,
                    }  # fmt: skip
                    if not off and base.precision != "fp32":  # the engine keeps low-precision weights
                        changes["autocast"] = True  # only with the offloaded optimizer's fp32 masters
                    if mode != "fraction":
                        changes["recompute_fraction"] = None
                    if mode != "budget":
                        changes["recompute_budget_bytes"] = None
                    if global_batch is not None:
                        if global_batch % (streams * micro):
                            settings = base.replace(**changes)
                            reason = (
                                f"global_batch {global_batch} is not a multiple of the data streams "
                                f"(world_size / (tp_size x pp_size)) x micro_batch = {streams * micro}"
                            )
                            candidates.append(Candidate(settings, None, "invalid", reason))
                            continue
                        changes["grad_accum"] = global_batch // (streams * micro)
                    try:
                        settings = base.replace(**changes)
                    except ValueError as error:
                        candidates.append(Candidate(base, None, "invalid", str(error)))
                        continue
                    try:
                        plan = make_plan(model, cluster, settings)
                    except ValueError as error:
                        candidates.append(Candidate(settings, None, "invalid", str(error)))
                        continue
                    if plan.fits:
                        candidates.append(Candidate(settings, plan, "fits", ""))
                    else:
                        candidates.append(Candidate(settings, plan, "does not fit", plan.overflow or ""))
    fitting = sorted((c for c in candidates if c.status == "fits"), key=lambda c: -c.plan.tokens_per_s)
    best = fitting[0].plan if fitting else None
    for rank, c in enumerate(fitting):
        if rank == 0:
            c.status, c.reason = "best", f"{c.plan.tokens_per_s:,.0f} tokens/s"
        elif rank < top:
            c.reason = f"{c.plan.tokens_per_s / best.tokens_per_s:.2f}x the best tokens/s"
        else:
            c.status = "slower"
            c.reason = (
                f"{c.plan.tokens_per_s / best.tokens_per_s:.2f}x the best tokens/s "
                f"({c.plan.tokens_per_s:,.0f} vs {best.tokens_per_s:,.0f})"
            )
    others = [c for c in candidates if c.status in ("does not fit", "invalid")]
    others.sort(
        key=lambda c: (
            c.status != "does not fit",
            c.settings.ep_size,
            c.settings.offload,
            c.settings.optim_overlap,
            c.settings.micro_batch,
        )
    )
    return Recommendation(best=best, winners=fitting[:top], candidates=fitting + others)
