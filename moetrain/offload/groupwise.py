"""``GroupwiseApply``: any per-parameter torch optimizer stepped a few parameters at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moetrain.offload.optimizer import OffloadOptimizer
from moetrain.validation import require_int


class GroupwiseApply(torch.optim.Optimizer):
    """Runs ``optimizer.step()`` once per group of parameters, bounding its temporaries to a group.

    The parameters that have a gradient, in param-group order, are cut into at most ``num_groups``
    contiguous groups of about equal bytes (a parameter goes to group
    ``floor(G * (bytes before it + half its bytes) / total bytes)``). For each group, the gradients
    of all other parameters are hidden (``.grad = None``) while the wrapped optimizer steps, then
    restored, so a foreach / fused optimizer allocates its intermediate lists (for
    ``torch.optim.AdamW(foreach=True)`` about one copy of the parameters) for one group at a time.
    Each parameter is stepped exactly once, so for optimizers whose update of a parameter depends
    only on that parameter (all of ``torch.optim`` except LBFGS) the result is the same as one
    ``optimizer.step()``; step hooks of the wrapped optimizer run once per group.

    ``param_groups``, ``state``, ``defaults``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and
    ``add_param_group`` are the wrapped optimizer's, so LR schedulers and checkpoints work on either.
    With ``torch.amp.GradScaler`` it behaves as the wrapped optimizer (a fused one receives the
    scaler's ``grad_scale`` / ``found_inf`` for every group).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, num_groups: int) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, (torch.optim.LBFGS, OffloadOptimizer, GroupwiseApply)):
            raise ValueError(
                "optimizer must be a per-parameter torch optimizer (not LBFGS, OffloadOptimizer, which "
                f"has num_apply_groups, or GroupwiseApply), got {type(optimizer).__name__}"
            )
        require_int("num_groups", num_groups, 1)
        self.optimizer = optimizer
        self.num_groups = num_groups
        # torch.optim.Optimizer.__init__ would build its own param_groups and state; __setstate__
        # (the unpickling path) only creates the hook registries, which is all this wrapper needs.
        torch.optim.Optimizer.__setstate__(self, {})

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "num_groups": self.num_groups}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optimizer = state["optimizer"]
        self.num_groups = state["num_groups"]
        torch.optim.Optimizer.__setstate__(self, {})

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def __repr__(self) -> str:
        return f"GroupwiseApply(num_groups={self.num_groups}, optimizer={self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def apply_groups(self) -> list[list[torch.Tensor]]:
        """The groups the next ``step()`` will use (params with a gradient, about equal bytes), the
        non-empty ones in order: at most one per parameter, whatever ``num_groups`` is."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        sizes = [p.numel() * p.element_size() for p in params]
        total = sum(sizes)
        groups: dict[int, list[torch.Tensor]] = {}  # k -> group k; k never decreases along params
        before = 0
        for param, size in zip(params, sizes, strict=True):
            k = min(self.num_groups - 1, (2 * before + size) * self.num_groups // (2 * total)) if total else 0
            groups.setdefault(k, []).append(param)
            before += size
        return list(groups.values())

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Steps the wrapped optimizer group by group; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.apply_groups()
        everyone = [p for group in groups for p in group]
        # GradScaler sets these on this wrapper for a fused optimizer; the wrapped one reads them.
        scaling = {key: self.__dict__[key] for key in ("grad_scale", "found_inf") if key in self.__dict__}
        for key, value in scaling.items():
            setattr(self.optimizer, key, value)
        try:
            for group in groups:
                members = {id(p) for p in group}
                hidden = [(p, p.grad) for p in everyone if id(p) not in members]
                for p, _ in hidden:
                    p.grad = None
                try:
                    self.optimizer.step()
                finally:
                    for p, grad in hidden:
                        p.grad = grad
        finally:
            for key in scaling:
                delattr(self.optimizer, key)
        return loss
