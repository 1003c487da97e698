"""Choosing what to recompute: the exact multiple-choice knapsack over the groups' options
(:func:`solve_recompute`) and the cheapest plan under a byte budget (:func:`plan_recompute`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from moetrain.layers import MoELayer
from moetrain.recompute.candidates import _is_inside
from moetrain.recompute.results import ActivationProfile, RecomputeOption, RecomputePlan, format_bytes
from moetrain.validation import require_number


def solve_recompute(groups: Sequence[Sequence[RecomputeOption]], capacity_bytes: int) -> list[int] | None:
    """Exact multiple-choice knapsack: one option index per group minimising the total
    ``recompute_ms`` subject to ``sum activation_bytes <= capacity_bytes``; ``None`` if infeasible.

    Dynamic programming over groups keeping the Pareto frontier of partial choices (bytes strictly
    increasing, ms strictly decreasing; partial sums above the capacity dropped). A partial choice
    dominated by another (no fewer bytes and no less time) can never complete to a better plan, so
    the frontier's last point after the final group is optimal. Ties in time go to fewer bytes.
    """
    frontier: list[tuple[int, float]] = [(0, 0.0)]
    back: list[list[tuple[int, int]]] = []
    for options in groups:
        extended = [
            (nbytes + o.activation_bytes, ms + o.recompute_ms, i, j)
            for i, (nbytes, ms) in enumerate(frontier)
            for j, o in enumerate(options)
            if nbytes + o.activation_bytes <= capacity_bytes
        ]
        if not extended:
            return None
        extended.sort(key=lambda e: (e[0], e[1]))
        frontier, steps, best = [], [], math.inf
        for nbytes, ms, i, j in extended:
            if ms < best:
                best = ms
                frontier.append((nbytes, ms))
                steps.append((i, j))
        back.append(steps)
    choice: list[int] = []
    index = len(frontier) - 1
    for steps in reversed(back):
        index, option = steps[index]
        choice.append(option)
    return choice[::-1]


def plan_recompute(
    profile: ActivationProfile, memory_budget_bytes: int, model: nn.Module | None = None
) -> RecomputePlan:
    """The cheapest plan (least ``recompute_ms``) whose ``activation_bytes <= memory_budget_bytes``.

    Raises ValueError naming the minimum achievable activation memory when no plan fits.
    ``model`` (optional) only fills ``moe_replay`` with the MoELayers inside recomputed blocks.
    """
    require_number("memory_budget_bytes", memory_budget_bytes, low=0, note="(bytes)")
    budget = int(memory_budget_bytes)
    minimum = profile.min_activation_bytes
    if profile.baseline_bytes <= budget:
        choice = [0] * len(profile.groups)
    else:
        choice = solve_recompute(profile.groups, budget - profile.outside_bytes)
    if choice is None:
        raise ValueError(
            f"memory_budget_bytes = {budget} ({format_bytes(budget)}) is below the minimum achievable "
            f"activation memory {minimum} bytes ({format_bytes(minimum)}, every group recomputed as "
            f"cheaply as possible; without recompute: {format_bytes(profile.baseline_bytes)}, of which "
            f"{format_bytes(profile.outside_bytes)} outside every candidate); raise memory_budget_bytes "
            f"to at least {minimum} or add candidates"
        )
    chosen = [options[j] for options, j in zip(profile.groups, choice, strict=True)]
    recomputed = tuple(n for o in chosen for n in o.recomputed)
    if any(j for j in choice):
        activation = profile.outside_bytes + sum(o.activation_bytes for o in chosen)
    else:
        activation = profile.baseline_bytes
    moe_replay = ()
    if model is not None:
        modules = dict(model.named_modules())
        moe_replay = tuple(
            n
            for n, m in modules.items()
            if isinstance(m, MoELayer) and any(_is_inside(n, r) or n == r for r in recomputed)
        )
    return RecomputePlan(
        recomputed=recomputed,
        memory_budget_bytes=budget,
        activation_bytes=activation,
        baseline_bytes=profile.baseline_bytes,
        min_activation_bytes=minimum,
        recompute_ms=sum(o.recompute_ms for o in chosen),
        moe_replay=moe_replay,
        profile=profile,
    )
