"""The optimizer and learning-rate schedule of a run (:class:`OptimConfig`) and its validation."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.options import option
from moetrain.validation import (
    require_choice,
    require_int,
    require_nonneg_float,
    require_number,
    require_numbers,
    require_positive_float,
)

OPTIMIZERS = ("adamw", "groupwise", "offload")
OPTIM_OVERLAPS = ("none", "delayed")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW settings and the schedule: linear warm-up over ``warmup_steps`` to ``lr``, then cosine
    decay that reaches ``min_lr_ratio * lr`` one step after the last (the last step's lr is a little
    above it: :func:`moetrain.engine.setup.lr_at`). ``name``: ``"adamw"`` (torch's), ``"groupwise"``
    (torch's AdamW stepped ``num_apply_groups`` groups at a time) or ``"offload"`` (fp32 masters and
    moments in host memory, C++ Adam, ``num_apply_groups`` groups). ``grad_clip`` 0: no clipping."""

    name: str = option(
        "adamw",
        (
            "'adamw' (torch's), 'groupwise' (AdamW stepped num_apply_groups groups "
            "at a time) or 'offload' (fp32 masters and moments in host memory, C++ "
            "Adam)"
        ),
    )
    lr: float = option(3e-3, "peak learning rate, reached after warmup_steps")
    betas: tuple[float, float] = option((0.9, 0.95), "Adam's (beta1, beta2), each in [0, 1)")
    eps: float = option(1e-8, "Adam's epsilon, > 0 (the update divides by sqrt(v) + eps)")
    weight_decay: float = option(
        0.01, ("decoupled weight decay of matrices (not of biases, norms, 1-D parameters)")
    )
    warmup_steps: int = option(
        10,
        (
            "linear warm-up steps to lr, then cosine decay that reaches min_lr_ratio * lr one step after "
            "the last (the last step's lr is a little above it)"
        ),
    )
    min_lr_ratio: float = option(
        0.1, "the cosine decay's end, as a fraction of lr, in [0, 1] (reached one step after the last)"
    )
    grad_clip: float = option(
        1.0, ("clip the global gradient norm (each expert counted once) to this; 0: no clipping")
    )
    num_apply_groups: int = option(
        4, ("parameter groups stepped one at a time by 'groupwise' and 'offload' (bounds temporary memory)")
    )
    overlap: str = option(
        "none",
        (
            "'none' or 'delayed' (name 'offload' only: the host Adam of step t runs during step t+1's "
            "forward and backward, which use weights one update old; ZeRO-Offload's delayed update)"
        ),
    )
    overlap_after_steps: int = option(0, "with overlap 'delayed': the first updates, run exactly")

    def __post_init__(self) -> None:
        require_choice("optim.name", self.name, OPTIMIZERS)
        require_nonneg_float("optim.lr", self.lr)
        betas = require_numbers("optim.betas", self.betas, count=2, low=0, high=1, high_open=True)
        object.__setattr__(self, "betas", betas)
        require_positive_float("optim.eps", self.eps)
        require_nonneg_float("optim.weight_decay", self.weight_decay)
        require_int("optim.warmup_steps", self.warmup_steps, 0)
        require_number("optim.min_lr_ratio", self.min_lr_ratio, low=0, high=1)
        require_nonneg_float("optim.grad_clip", self.grad_clip)
        require_int("optim.num_apply_groups", self.num_apply_groups, 1)
        require_choice("optim.overlap", self.overlap, OPTIM_OVERLAPS)
        if self.overlap == "delayed" and self.name != "offload":
            raise ValueError(f"optim.overlap 'delayed' needs optim.name 'offload', got {self.name!r}")
        require_int("optim.overlap_after_steps", self.overlap_after_steps, 0)
