"""The options of one MoE layer (:class:`MoEConfig`: routing, capacity, losses, experts, kernels)
and their validation."""

from __future__ import annotations

from dataclasses import dataclass, fields

from moetrain.config.options import option
from moetrain.validation import require_bool, require_choice, require_int, require_nonneg_float

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")
KERNEL_CHOICES = ("auto", "custom", "torch")


@dataclass(frozen=True)
class MoEConfig:
    """Options of one :class:`moetrain.MoELayer` (see the README's table for each one's meaning).

    Capacity per expert, for ``T`` tokens on this rank: ``C = max(min_capacity, ceil(cf * T * k / E))``;
    ``capacity_factor`` (training) and ``eval_capacity_factor`` (eval) of ``None`` or ``0`` mean
    dropless: every routed slot is computed.

    ``kernels``: which implementation of the dispatch plan and the token permutation runs:
    ``"custom"`` (moetrain's C++/CUDA kernels), ``"torch"`` (their torch-native twins, any device)
    or ``"auto"`` (custom on the CPU; on a GPU custom only after each kernel matched its twin on a
    small input once per process, else the twin, with one warning). See ``docs/gpu.md``.
    """

    d_model: int = option(help="input and output size of the layer")
    d_ff: int = option(help="hidden size of each expert")
    num_experts: int = option(8, "number of experts E")
    top_k: int = option(2, "experts per token, 1 <= top_k <= num_experts")
    capacity_factor: float | None = option(
        1.25,
        (
            "training capacity per expert C = max(min_capacity, ceil(cf * T * top_k"
            " / E)) for T tokens; None or 0: dropless"
        ),
    )
    eval_capacity_factor: float | None = option(2.0, "the same in eval() mode")
    min_capacity: int = option(4, "lower bound of the capacity C")
    score_function: str = option("softmax", "'softmax' (per prototype group) or 'sigmoid'")
    normalize_gates: bool | None = option(None, "divide the chosen gates by their sum; None: when top_k > 1")
    router_jitter: float = option(
        0.0, ("training-time multiplicative noise U(1-eps, 1+eps) on the router input, in [0, 1)")
    )
    aux_loss_coef: float = option(1e-2, "weight of the load-balancing loss E * sum_e f_e * P_e")
    z_loss_coef: float = option(0.0, "weight of the router z-loss mean(logsumexp(logits)^2)")
    seq_aux_loss_coef: float = option(
        0.0, "weight of the sequence-level balance loss (the balance loss within each sequence, averaged)"
    )
    score_bias_rate: float = option(
        0.0,
        (
            "aux-loss-free balancing: a per-expert bias added to the scores for the choice only, moved by "
            "rate * sign(mean load - load) after each optimizer step; 0: off"
        ),
    )
    max_nodes_per_token: int | None = option(
        None,
        (
            "node-limited routing (DeepSeek-V3): each token's top_k experts lie on at most this many "
            "nodes of the expert-parallel group; None: no limit"
        ),
    )
    batch_prioritized_routing: bool = option(
        False,
        (
            "over capacity, drop the tokens with the lowest router score first "
            "(instead of the last by position)"
        ),
    )
    num_prototypes: int = option(
        1,
        (
            "expert prototyping (M6-T 'k top-1'): experts split into this many "
            "groups, each picks top_k / num_prototypes"
        ),
    )
    activation: str = option(
        "gelu", "'relu', 'gelu' (exact), 'gelu_tanh' (tanh approximation, GPT-2's) or 'swiglu'"
    )
    expert_bias: bool = option(
        False, "experts add a bias after each of their two matrices (upcycled FFNs that have biases)"
    )
    shared_expert_d_ff: int | None = option(
        None, ("hidden size of a dense expert every token also goes through; None: none")
    )
    kernels: str = option(
        "auto",
        (
            "dispatch-plan and permutation kernels: 'custom' (C++/CUDA), 'torch' "
            "(torch-native twins) or 'auto' (custom on CPU; on GPU after a once-"
            "per-process check against the twin)"
        ),
    )

    def __post_init__(self) -> None:
        require_int("d_model", self.d_model, 1)
        require_int("d_ff", self.d_ff, 1)
        require_int("num_experts", self.num_experts, 1)
        require_int("num_prototypes", self.num_prototypes, 1)
        require_int("top_k", self.top_k, 1)
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
        require_nonneg_float("capacity_factor", self.capacity_factor, allow_none=True)
        require_nonneg_float("eval_capacity_factor", self.eval_capacity_factor, allow_none=True)
        require_int("min_capacity", self.min_capacity, 0)
        require_choice("score_function", self.score_function, SCORE_FUNCTIONS)
        require_bool("normalize_gates", self.normalize_gates, allow_none=True)
        require_nonneg_float("router_jitter", self.router_jitter)
        if self.router_jitter >= 1:
            raise ValueError(
                "router_jitter must be in [0, 1) (inputs are scaled by U(1-eps, 1+eps)), "
                f"got {self.router_jitter!r}"
            )
        require_nonneg_float("aux_loss_coef", self.aux_loss_coef)
        require_nonneg_float("z_loss_coef", self.z_loss_coef)
        require_nonneg_float("seq_aux_loss_coef", self.seq_aux_loss_coef)
        require_nonneg_float("score_bias_rate", self.score_bias_rate)
        require_int("max_nodes_per_token", self.max_nodes_per_token, 1, allow_none=True)
        if (
            self.num_prototypes > 1
            and self.max_nodes_per_token is not None
            and self.max_nodes_per_token < self.top_k
        ):
            raise ValueError(
                f"max_nodes_per_token < top_k = {self.top_k} cannot be combined with num_prototypes = "
                f"{self.num_prototypes} (each prototype group picks its own experts): use num_prototypes 1 "
                f"or max_nodes_per_token >= top_k, got {self.max_nodes_per_token}"
            )
        require_bool("batch_prioritized_routing", self.batch_prioritized_routing)
        require_choice("activation", self.activation, ACTIVATIONS)
        require_bool("expert_bias", self.expert_bias)
        if self.shared_expert_d_ff is not None:
            require_int("shared_expert_d_ff", self.shared_expert_d_ff, 1)
        require_choice("kernels", self.kernels, KERNEL_CHOICES)

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
