"""The one call, :func:`auto_checkpoint`: profile a model, choose the blocks to recompute under a
byte budget, apply the plan."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from moetrain.recompute.apply import apply_recompute_plan
from moetrain.recompute.profile import profile_activations
from moetrain.recompute.results import RecomputePlan
from moetrain.recompute.solve import plan_recompute
from moetrain.validation import require_bool

log = logging.getLogger("moetrain.recompute")  # the package's logger, as before the split


def auto_checkpoint(
    model: nn.Module,
    example_batch,
    memory_budget_bytes: int,
    *,
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    candidates: Sequence[str] | None = None,
    verbose: bool = True,
    timing_repeats: int = 3,
) -> RecomputePlan:
    """Profiles ``model`` on ``example_batch``, picks the blocks to recompute so that the activations
    saved for backward fit ``memory_budget_bytes`` at the least expected recompute time, wraps them
    and returns the plan (logged when ``verbose``).

    ``example_batch``: a tensor (``model(batch)``) or tuple of arguments (``model(*batch)``).
    ``loss_fn(output) -> scalar`` (default ``output.float().pow(2).mean()``) drives the warm-up
    backward. ``candidates``: module names to choose from (default: :func:`default_candidates`).
    Raises ValueError, naming the minimum achievable bytes, when no choice fits the budget.
    """
    require_bool("verbose", verbose)
    profile = profile_activations(
        model, example_batch, loss_fn=loss_fn, candidates=candidates, timing_repeats=timing_repeats
    )
    plan = plan_recompute(profile, memory_budget_bytes, model)
    apply_recompute_plan(model, plan)
    if verbose:
        log.info("%s", plan.summary())
    return plan
