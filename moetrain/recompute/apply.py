"""Applying a plan: wraps each recomputed block's forward in ``checkpoint(use_reentrant=False)``
(:class:`RecomputedForward`) and turns on routing replay for the MoELayers inside it; and undoes it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.layers import MoELayer
from moetrain.recompute.candidates import _is_inside
from moetrain.recompute.results import RecomputePlan


def _moe_layers_in(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


class RecomputedForward:
    """Installed as ``module.forward`` (an instance attribute, so parameter names, state_dict keys,
    ``named_modules`` and ``isinstance`` are unchanged): runs the original forward under
    ``checkpoint(use_reentrant=False)`` when grad is enabled, plainly otherwise. RNG state is
    preserved, so dropout and router jitter draw the same numbers in the recompute."""

    def __init__(self, forward: Callable, previous: Callable | None, moe_layers: list[MoELayer]):
        self.forward = forward
        self.previous = previous  # the instance-level forward this replaced, if any
        self.moe_layers = moe_layers

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def recomputed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` currently wrapped for recompute."""
    return [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), RecomputedForward)]


def apply_recompute_plan(model: nn.Module, plan: RecomputePlan | Sequence[str]) -> list[str]:
    """Wraps each block of ``plan`` (or a list of names) for recompute and turns on routing replay
    (``set_recompute_replay(True)``) for every MoELayer inside one. Returns the MoELayer names."""
    names = list(plan.recomputed) if isinstance(plan, RecomputePlan) else list(plan)
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"plan must name submodules of the model, got {unknown}")
    already = recomputed_modules(model)
    if already:
        raise ValueError(f"model already recomputes {already}; call remove_recompute(model) first")
    for a in names:
        for b in names:
            if a != b and _is_inside(b, a):
                raise ValueError(f"plan must not nest recomputed blocks, got {a!r} and its sub-block {b!r}")
    replayed = []
    for name in names:
        module = modules[name]
        layers = _moe_layers_in(module)
        for layer in layers:
            layer.set_recompute_replay(True)
        replayed += [n for n, m in modules.items() if isinstance(m, MoELayer) and m in layers]
        module.forward = RecomputedForward(module.forward, module.__dict__.get("forward"), layers)
    return replayed


def remove_recompute(model: nn.Module) -> list[str]:
    """Undoes :func:`apply_recompute_plan`: restores each wrapped forward and turns routing replay
    off. Returns the names that were wrapped."""
    names = recomputed_modules(model)
    for name in names:
        module = model.get_submodule(name)
        wrapper = module.__dict__["forward"]
        for layer in wrapper.moe_layers:
            layer.set_recompute_replay(False)
        if wrapper.previous is None:
            del module.forward
        else:
            module.forward = wrapper.previous
    return names
