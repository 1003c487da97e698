"""Configuration dataclasses, validated on construction.

Every invalid value raises ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ACTIVATIONS = ("relu", "gelu", "swiglu")


def _require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _require_nonneg_float(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        allowed = "a finite number >= 0" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _require_bool(name: str, value, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise ValueError(f"{name} must be True or False{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Options of one :class:`moetrain.MoELayer` (see the README's table for each one's meaning).

    Capacity per expert, for ``T`` tokens on this rank: ``C = max(min_capacity, ceil(cf * T * k / E))``;
    ``capacity_factor`` (training) and ``eval_capacity_factor`` (eval) of ``None`` or ``0`` mean
    dropless: every routed slot is computed.
    """

    d_model: int
    d_ff: int
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25
    eval_capacity_factor: float | None = 2.0
    min_capacity: int = 4
    score_function: str = "softmax"
    normalize_gates: bool | None = None
    router_jitter: float = 0.0
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 0.0
    batch_prioritized_routing: bool = False
    num_prototypes: int = 1
    activation: str = "gelu"
    shared_expert_d_ff: int | None = None

    def __post_init__(self) -> None:
        _require_int("d_model", self.d_model, 1)
        _require_int("d_ff", self.d_ff, 1)
        _require_int("num_experts", self.num_experts, 1)
        _require_int("num_prototypes", self.num_prototypes, 1)
        _require_int("top_k", self.top_k, 1)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k must satisfy 1 <= top_k <= num_experts = {self.num_experts}, got {self.top_k}"
            )
        if self.num_experts % self.num_prototypes:
            raise ValueError(
                f"num_prototypes must divide num_experts = {self.num_experts} (experts are split into "
                f"equal groups), got {self.num_prototypes}"
            )
        if self.top_k % self.num_prototypes:
            raise ValueError(
                f"top_k must be a multiple of num_prototypes = {self.num_prototypes} (each group picks "
                f"top_k / num_prototypes experts; k top-1 is top_k == num_prototypes), got {self.top_k}"
            )
        _require_nonneg_float("capacity_factor", self.capacity_factor, allow_none=True)
        _require_nonneg_float("eval_capacity_factor", self.eval_capacity_factor, allow_none=True)
        _require_int("min_capacity", self.min_capacity, 0)
        _require_choice("score_function", self.score_function, SCORE_FUNCTIONS)
        _require_bool("normalize_gates", self.normalize_gates, allow_none=True)
        _require_nonneg_float("router_jitter", self.router_jitter)
        if self.router_jitter >= 1:
            raise ValueError(
                "router_jitter must be in [0, 1) (inputs are scaled by U(1-eps, 1+eps)), "
                f"got {self.router_jitter!r}"
            )
        _require_nonneg_float("aux_loss_coef", self.aux_loss_coef)
        _require_nonneg_float("z_loss_coef", self.z_loss_coef)
        _require_bool("batch_prioritized_routing", self.batch_prioritized_routing)
        _require_choice("activation", self.activation, ACTIVATIONS)
        if self.shared_expert_d_ff is not None:
            _require_int("shared_expert_d_ff", self.shared_expert_d_ff, 1)

    @property
    def experts_per_prototype(self) -> int:
        return self.num_experts // self.num_prototypes

    @property
    def top_k_per_prototype(self) -> int:
        return self.top_k // self.num_prototypes

    @property
    def gates_normalized(self) -> bool:
        """``normalize_gates``, where ``None`` (auto) means: normalise when ``top_k > 1``."""
        return self.top_k > 1 if self.normalize_gates is None else self.normalize_gates

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


EP_LAYOUTS = ("packed", "spread")
ALL_TO_ALL_ALGORITHMS = ("auto", "flat", "hierarchical")
COMM_DTYPES = (None, "bf16", "fp16")


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are arranged for expert parallelism.

    - ``ep_size``: ranks that share one token exchange and split the experts between them;
      must divide the world size (and ``num_experts``).
    - ``ep_layout``: ``"packed"`` puts an expert-parallel group on consecutive ranks (inside a node
      first); ``"spread"`` takes one rank every ``world_size / ep_size`` (across nodes).
    - ``all_to_all``: ``"flat"``, ``"hierarchical"`` (2-D: intra-node, then inter-node among the
      same local rank) or ``"auto"`` (hierarchical when a group spans > 1 node with > 1 rank each).
    - ``comm_dtype``: ``None`` (send the payload as it is), ``"bf16"``, or ``"fp16"`` (with a
      per-row power-of-two scale so nothing overflows); gradients travel in the same precision.
    - ``local_world_size``: ranks per node; ``None`` reads ``LOCAL_WORLD_SIZE`` (torchrun) or
      ``SLURM_NTASKS_PER_NODE``; tests set it to emulate several nodes on one machine.
    """

    ep_size: int = 1
    ep_layout: str = "packed"
    all_to_all: str = "auto"
    comm_dtype: str | None = None
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        _require_int("ep_size", self.ep_size, 1)
        _require_choice("ep_layout", self.ep_layout, EP_LAYOUTS)
        _require_choice("all_to_all", self.all_to_all, ALL_TO_ALL_ALGORITHMS)
        _require_choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        if self.local_world_size is not None:
            _require_int("local_world_size", self.local_world_size, 1)
