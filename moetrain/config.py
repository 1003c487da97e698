"""Configuration dataclasses, validated on construction.

Every invalid value raises ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from moetrain.validation import (  # noqa: F401 - re-exported: models validate with the same helpers
    is_int,
    require_bool,
    require_choice,
    require_fraction,
    require_int,
    require_nonneg_float,
    require_numbers,
    require_positive_float,
)


def option(default=MISSING, help: str = ""):  # noqa: A002 - the name the reference shows
    """A config field with its one-line meaning (``moetrain train --help`` lists every key from these)."""
    return field(default=default, metadata={"help": help})


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


EP_LAYOUTS = ("packed", "spread")
ALL_TO_ALL_ALGORITHMS = ("auto", "flat", "hierarchical", "node_dedup")
COMM_DTYPES = (None, "bf16", "fp16")


STRATEGY_KINDS = ("replica", "expert", "split", "split.row", "split.head", "pipeline")
REPLICA_MODES = ("ddp", "fsdp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def validate_strategy(name: str, strategy) -> dict[str, str]:
    """A strategy: a mapping of module-name patterns (``fnmatch``) to one of ``STRATEGY_KINDS``, in
    the order given (the first matching pattern wins); returned as a new dict."""
    if not isinstance(strategy, dict) or not strategy:
        raise ValueError(
            f"{name} must be a non-empty mapping of module-name patterns to one of "
            f"{', '.join(map(repr, STRATEGY_KINDS))}, got {strategy!r}"
        )
    for pattern, kind in strategy.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{name}: patterns must be non-empty strings, got {pattern!r}")
        if kind not in STRATEGY_KINDS:
            raise ValueError(
                f"{name}[{pattern!r}] must be one of {', '.join(map(repr, STRATEGY_KINDS))}, got {kind!r}"
            )
    return dict(strategy)


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are arranged: a mesh of ``dp x ep x tp`` ranks (see :mod:`moetrain.parallel`);
    the data-parallel degree ``dp = world / (ep_size * tp_size)`` follows from the world size.

    - ``ep_size``: ranks that share one token exchange and split the experts between them;
      must divide the world size (and ``num_experts``).
    - ``tp_size``: ranks that split the layers a strategy marks ``split`` (tensor parallelism);
      they see the same data. Innermost in the rank grid (consecutive ranks: one node).
    - ``replica``: how replicated parameters are kept in sync: ``"ddp"`` (every rank holds them,
      gradients all-reduced) or ``"fsdp"`` (FSDP2 ``fully_shard``: parameters, gradients and
      optimizer states sharded over the data-parallel ranks, gathered per unit when used).
    - ``fsdp_cpu_offload``: with ``replica: fsdp``, FSDP2's CPU offload policy (parameters,
      gradients and optimizer steps in host memory; pinned on a GPU run).
    - ``strategy``: module-name patterns -> ``replica`` / ``expert`` / ``split`` /
      ``split.row`` / ``split.head`` (see :func:`moetrain.parallelize`); None: the model's default.
    - ``ep_layout``: ``"packed"`` puts an expert-parallel group on consecutive ranks (inside a node
      first); ``"spread"`` takes one rank every ``world_size / ep_size`` (across nodes).
    - ``all_to_all``: ``"flat"``, ``"hierarchical"`` (2-D: intra-node, then inter-node among the
      same local rank), ``"node_dedup"`` (each token crosses once to each node its experts are on,
      then fans out inside the node: :mod:`moetrain.layers.node_dispatch`; pays with node-limited
      routing) or ``"auto"`` (hierarchical when a group spans > 1 node with > 1 rank each; never
      node_dedup).
    - ``comm_dtype``: ``None`` (send the payload as it is), ``"bf16"``, or ``"fp16"`` (with a
      per-row power-of-two scale so nothing overflows); gradients travel in the same precision.
    - ``local_world_size``: ranks per node; ``None`` reads ``LOCAL_WORLD_SIZE`` (torchrun) or
      ``SLURM_NTASKS_PER_NODE``; tests set it to emulate several nodes on one machine.
    - ``kernels``: the implementation of the all-to-all's chunk transpose and fp16 packing,
      ``"auto"``, ``"custom"`` or ``"torch"`` (as :class:`MoEConfig`'s ``kernels``).
    - ``a2a_chunks``: each MoE layer splits its exchange into this many chunks and overlaps chunk
      i + 1's all-to-all with chunk i's experts, forward and backward (1: no chunks, the plain
      exchange -> experts -> exchange; results are bit-identical either way on the CPU). ``"auto"``:
      the count the planner's alpha-beta model finds fastest for each layer call (agreed by the EP
      group). The node-deduplicating exchange (``all_to_all: node_dedup``) is not chunked:
      ``"auto"`` is 1 there, other counts are refused. See ``docs/expert_parallel.md``.
    - ``pp_size``: pipeline stages (outermost mesh dimension, ``world = pp x dp x ep x tp``); the
      layer stack the strategy marks ``pipeline`` is cut into ``pp_size`` (x ``pp_virtual``)
      stages (see :mod:`moetrain.pipeline`); 1: no pipeline.
    - ``pp_schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"`` (needs ``pp_virtual > 1``).
    - ``pp_virtual``: stages per rank (interleaved 1F1B: rank r holds stages r, r + pp, ...).
    - ``pp_layers``: the first layer of every stage but the first (``pp_size * pp_virtual - 1``
      increasing boundaries, e.g. ``[3]`` puts layers 0-2 on stage 0); None: balanced by each
      layer's active parameters.
    """

    ep_size: int = option(
        1,
        ("ranks that share one token exchange and split the experts; divides the world size and num_experts"),
    )
    ep_layout: str = option(
        "packed",
        (
            "'packed' (an expert-parallel group on consecutive ranks) or 'spread' "
            "(one rank every world/ep_size)"
        ),
    )
    all_to_all: str = option(
        "auto",
        (
            "'flat', 'hierarchical' (2-D: intra-node, then inter-node), 'node_dedup' (a token "
            "crosses once per node it reaches, then fans out inside it) or 'auto' "
            "(hierarchical when a group spans > 1 node with > 1 rank each)"
        ),
    )
    comm_dtype: str | None = option(
        None, ("all-to-all payload: None (as is), 'bf16' or 'fp16' (per-row power-of-two scale)")
    )
    local_world_size: int | None = option(
        None, ("ranks per node; None: from the launcher (LOCAL_WORLD_SIZE, SLURM); set it to emulate nodes")
    )
    kernels: str = option("auto", ("all-to-all layout kernels: 'auto', 'custom' or 'torch' (as moe.kernels)"))
    a2a_chunks: int | str = option(
        1,
        (
            "chunks each MoE layer's all-to-all is split into, overlapped with the experts: an "
            "integer >= 1 (1: no overlap) or 'auto' (the planner's model picks per layer call)"
        ),
    )
    tp_size: int = option(
        1, "ranks that split the 'split' layers of the strategy (tensor parallelism); they share their data"
    )
    replica: str = option(
        "ddp", "replicated parameters: 'ddp' (all-reduced gradients) or 'fsdp' (FSDP2 fully_shard)"
    )
    fsdp_cpu_offload: bool = option(
        False, "with replica 'fsdp': FSDP2's CPU offload policy (weights, gradients, optimizer on the host)"
    )
    strategy: dict | None = option(
        None,
        (
            "module-name patterns -> 'replica', 'expert', 'split', 'split.row' or 'split.head' (first"
            " match wins); None: the model's default strategy"
        ),
    )
    pp_size: int = option(1, "pipeline stages (outermost mesh dimension: world = pp x dp x ep x tp); 1: none")
    pp_schedule: str = option("1f1b", "pipeline schedule: 'gpipe', '1f1b' or 'interleaved_1f1b'")
    pp_virtual: int = option(1, "pipeline stages per rank (> 1 only with pp_schedule 'interleaved_1f1b')")
    pp_layers: tuple[int, ...] | None = option(
        None,
        (
            "first layer of each pipeline stage but the first (pp_size * pp_virtual - 1 increasing ints);"
            " None: balanced by active parameters"
        ),
    )

    def __post_init__(self) -> None:
        require_int("ep_size", self.ep_size, 1)
        if self.a2a_chunks != "auto":
            require_int("a2a_chunks", self.a2a_chunks, 1, note="or 'auto'")
        require_int("tp_size", self.tp_size, 1)
        require_choice("replica", self.replica, REPLICA_MODES)
        require_bool("fsdp_cpu_offload", self.fsdp_cpu_offload)
        if self.fsdp_cpu_offload and self.replica != "fsdp":
            raise ValueError(
                f"fsdp_cpu_offload needs replica = 'fsdp' (it is FSDP2's offload policy), got replica = "
                f"{self.replica!r}"
            )
        if self.strategy is not None:
            object.__setattr__(self, "strategy", validate_strategy("strategy", self.strategy))
        require_choice("ep_layout", self.ep_layout, EP_LAYOUTS)
        require_choice("all_to_all", self.all_to_all, ALL_TO_ALL_ALGORITHMS)
        if self.all_to_all == "node_dedup" and self.a2a_chunks not in (1, "auto"):
            raise ValueError(
                f"a2a_chunks = {self.a2a_chunks!r} chunks the flat and hierarchical all-to-all only; with "
                "all_to_all = 'node_dedup' use 1 or 'auto' (which is 1 there)"
            )
        require_choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        if self.local_world_size is not None:
            require_int("local_world_size", self.local_world_size, 1)
        require_choice("kernels", self.kernels, KERNEL_CHOICES)
        require_int("pp_size", self.pp_size, 1)
        require_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        require_int("pp_virtual", self.pp_virtual, 1)
        if self.pp_size > 1:
            check_pipeline_virtual(self.pp_schedule, self.pp_virtual)
        if self.pp_layers is not None:
            layers = self.pp_layers
            stages = self.pp_size * self.pp_virtual
            valid = isinstance(layers, (list, tuple)) and all(is_int(b) and b >= 1 for b in layers)
            if not valid or len(layers) != stages - 1 or list(layers) != sorted(set(layers)):
                raise ValueError(
                    f"pp_layers must be {stages - 1} increasing layer indices >= 1 (the first layer of each "
                    f"stage but the first, pp_size * pp_virtual = {stages} stages), got {layers!r}"
                )
            object.__setattr__(self, "pp_layers", tuple(layers))
        if self.pp_size > 1 and (self.tp_size > 1 or self.replica != "ddp"):
            raise ValueError(
                f"pp_size > 1 composes with ep and dp replicas (replica 'ddp', tp_size 1); got tp_size = "
                f"{self.tp_size}, replica = {self.replica!r}"
            )


PRECISIONS = ("fp32", "bf16", "fp16")
RESUME_CHOICES = ("latest", "latest-valid")


DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("adamw", "groupwise", "offload")
OPTIM_OVERLAPS = ("none", "delayed")


@dataclass(frozen=True)
class DataConfig:
    """``source``: ``"embedded"`` (the model's built-in data: the text corpus in ``moetrain/data``
    for ``moe_lm``, the generated image-caption dataset for ``m6_moe``), a path (a UTF-8 text file
    for ``moe_lm``, a JSON-lines image-text manifest for ``m6_moe``) or, for ``m6_moe``, a list of
    manifest paths and glob patterns (kept as a tuple); ``micro_batch_size`` sequences of up to
    ``seq_len`` tokens per rank and micro-step; ``num_workers``: data-loader worker processes per
    rank for models that load in workers (``m6_moe``), an integer >= 0 (0: load in the training
    process) or ``"auto"`` (from the CPUs each rank may use, see :mod:`moetrain.cpus`)."""

    source: str | tuple[str, ...] = option(
        "embedded",
        (
            "'embedded' (the model's built-in data), a file (text for moe_lm, a "
            "JSON-lines manifest for m6_moe) or, for m6_moe, a list of manifests / "
            "glob patterns"
        ),
    )
    micro_batch_size: int = option(8, "sequences per rank and micro-step")
    seq_len: int = option(64, ("tokens per sequence (m6_moe: the longest prefix and the longest target)"))
    num_workers: int | str = option(
        "auto",
        ("data-loader worker processes per rank (m6_moe): an integer >= 0 or 'auto' (from the rank's CPUs)"),
    )

    def __post_init__(self) -> None:
        source = self.source
        if isinstance(source, (list, tuple)):
            if not source or not all(isinstance(s, str) and s and s != "embedded" for s in source):
                raise ValueError(
                    f"data.source must be 'embedded', a file path or a non-empty list of file paths / glob "
                    f"patterns, got {source!r}"
                )
            object.__setattr__(self, "source", tuple(source))
        elif not isinstance(source, str) or not source:
            raise ValueError(f"data.source must be 'embedded' or a file path, got {source!r}")
        require_int("data.micro_batch_size", self.micro_batch_size, 1)
        require_int("data.seq_len", self.seq_len, 1)
        if self.num_workers != "auto":
            try:
                require_int("data.num_workers", self.num_workers, 0)
            except ValueError:
                raise ValueError(
                    f"data.num_workers must be 'auto' or an integer >= 0, got {self.num_workers!r}"
                ) from None


@dataclass(frozen=True)
class OptimConfig:
    """AdamW settings and the schedule: linear warm-up over ``warmup_steps`` to ``lr``, then cosine
    decay to ``min_lr_ratio * lr`` at the last step. ``name``: ``"adamw"`` (torch's), ``"groupwise"``
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
    eps: float = option(1e-8, "Adam's epsilon")
    weight_decay: float = option(
        0.01, ("decoupled weight decay of matrices (not of biases, norms, 1-D parameters)")
    )
    warmup_steps: int = option(
        10, ("linear warm-up steps to lr, then cosine decay to min_lr_ratio * lr at the last step")
    )
    min_lr_ratio: float = option(0.1, "final learning rate / lr, in [0, 1]")
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
        require_nonneg_float("optim.eps", self.eps)
        require_nonneg_float("optim.weight_decay", self.weight_decay)
        require_int("optim.warmup_steps", self.warmup_steps, 0)
        require_nonneg_float("optim.min_lr_ratio", self.min_lr_ratio)
        if self.min_lr_ratio > 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        require_nonneg_float("optim.grad_clip", self.grad_clip)
        require_int("optim.num_apply_groups", self.num_apply_groups, 1)
        require_choice("optim.overlap", self.overlap, OPTIM_OVERLAPS)
        if self.overlap == "delayed" and self.name != "offload":
            raise ValueError(f"optim.overlap 'delayed' needs optim.name 'offload', got {self.name!r}")
        require_int("optim.overlap_after_steps", self.overlap_after_steps, 0)


@dataclass(frozen=True)
class BalanceConfig:
    """Hardware-aware batch balancing (Whale): the global micro-batch ``data.micro_batch_size *
    world`` is split between the ranks in proportion to ``speeds`` (one per rank, any unit),
    within ``memory_limits`` (most sequences per rank), and each rank weights its loss so the
    gradient equals that of the uniform split. ``calibrate``: measure the speeds at start-up (a few
    timed forward+backward passes) instead of giving them. Off when neither is set."""

    speeds: tuple[float, ...] | None = option(
        None,
        (
            "hardware-aware batch balancing: one relative speed per rank; the "
            "global micro-batch is split in proportion"
        ),
    )
    memory_limits: tuple[int, ...] | None = option(None, "most sequences each rank can hold, one per rank")
    calibrate: bool = option(False, "measure the ranks' speeds at start-up instead of giving them")

    def __post_init__(self) -> None:
        for name in ("speeds", "memory_limits"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (list, tuple)) or not value:
                    raise ValueError(f"balance.{name} must be a list with one entry per rank, got {value!r}")
                object.__setattr__(self, name, tuple(value))
        for index, speed in enumerate(self.speeds or ()):
            require_positive_float(f"balance.speeds[{index}]", speed)
        for index, limit in enumerate(self.memory_limits or ()):
            require_int(f"balance.memory_limits[{index}]", limit, 1)
        require_bool("balance.calibrate", self.calibrate)
        if self.calibrate and self.speeds is not None:
            raise ValueError("balance: give either speeds or calibrate: true, not both")

    @property
    def enabled(self) -> bool:
        return self.calibrate or self.speeds is not None


METRIC_SINKS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class MetricsConfig:
    """Where the metrics of logging steps go (:mod:`moetrain.metrics`): ``sinks``, any of
    ``METRIC_SINKS`` in any order: ``jsonl`` (``out_dir/metrics.jsonl``), ``tensorboard``
    (``out_dir/tensorboard``; skipped with one log line when the package is not installed),
    ``wandb`` and ``mlflow`` (their packages imported only when chosen; a missing one stops the
    run before training with one line). ``project``: the Weights & Biases project / MLflow
    experiment (None: the name of ``out_dir``'s directory)."""

    sinks: tuple[str, ...] = option(
        ("jsonl", "tensorboard"), "where metrics go: any of jsonl, tensorboard, wandb, mlflow"
    )
    project: str | None = option(None, "Weights & Biases project / MLflow experiment; None: out_dir's name")

    def __post_init__(self) -> None:
        if isinstance(self.sinks, str) or not isinstance(self.sinks, (list, tuple)):
            raise ValueError(f"metrics.sinks must be a list of sink names, got {self.sinks!r}")
        object.__setattr__(self, "sinks", tuple(self.sinks))
        for sink in self.sinks:
            require_choice("metrics.sinks", sink, METRIC_SINKS)
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"metrics.sinks names a sink twice: {list(self.sinks)}")
        if self.project is not None and (not isinstance(self.project, str) or not self.project):
            raise ValueError(f"metrics.project must be a name or null, got {self.project!r}")


@dataclass(frozen=True)
class TrainConfig:
    """One training run (``moetrain train --config FILE``). ``model`` is the config of the model
    named by its ``name`` key (``"moe_lm"``: :class:`moetrain.lm.LMConfig`); ``grad_accum``
    micro-steps per optimizer step; a checkpoint every ``checkpoint_every`` steps and every
    ``checkpoint_every_minutes`` of wall-clock time, whichever comes first (0 / None: only at the
    end and on SIGTERM); ``async_checkpoint``: write checkpoints in the background (the step waits
    only for the copy of the state into host memory); ``keep_last`` checkpoints kept;
    ``max_consecutive_skips``: steps in a row skipped for non-finite gradients after which the run
    stops; ``recompute_budget_mb``: activation-memory budget for automatic checkpointing (None:
    off; 0: recompute as much as possible); ``threads``: torch CPU threads per rank (None: chosen
    from the CPUs the rank may use and its data-loader workers, see :mod:`moetrain.cpus`);
    ``device``: ``"cuda"`` (GPU ``LOCAL_RANK``, NCCL), ``"cpu"`` (gloo) or ``"auto"`` (cuda when
    torch sees a GPU); ``param_dtype``: the dtype the model's weights and gradients are stored in,
    ``"fp32"`` (``precision`` then means autocast) or the ``precision`` itself, with the fp32 master
    weights and Adam moments in the offloaded optimizer (``optim.name: offload``);
    ``imports``: modules imported before the model section is read (a user model registering
    itself; the config file's directory is searched first); ``dist_timeout_s``: how long any
    collective of any process group may wait for the other ranks before the run fails (seconds; it
    must cover the longest collective and a checkpoint's save)."""

    model: object = option(
        help=(
            "the model: 'name' of a registered model, optionally 'preset', then its"
            " own keys (listed below per model)"
        )
    )
    imports: tuple[str, ...] = option(
        (),
        (
            "modules imported before the model is read (user models that register "
            "themselves; looked up beside the config file first)"
        ),
    )
    parallel: ParallelConfig = option(ParallelConfig(), "expert-parallel layout")
    data: DataConfig = option(DataConfig(), "input data")
    optim: OptimConfig = option(OptimConfig(), "optimizer and learning-rate schedule")
    balance: BalanceConfig = option(
        BalanceConfig(),
        ("hardware-aware batch balancing for mixed clusters (off unless speeds or calibrate)"),
    )
    metrics: MetricsConfig = option(MetricsConfig(), "where the metrics of logging steps go")
    steps: int = option(100, "optimizer steps of the run")
    grad_accum: int = option(1, "micro-steps per optimizer step")
    precision: str = option(
        "fp32", ("compute precision: 'fp32', 'bf16' (autocast) or 'fp16' (autocast + loss scaling)")
    )
    seed: int = option(0, "seed of the weights (identical on every rank) and of the data stream")
    out_dir: str = option(
        "runs/default",
        ("output directory: checkpoints/, logs/, metrics.jsonl, config.json, config_history.jsonl"),
    )
    log_every: int = option(
        10,
        (
            "a metrics line (and the metrics' host synchronisation) every this many steps, and at the last; "
            "the all-reduced gradient norm alone is read every step (the skip decision on inf/NaN)"
        ),
    )
    checkpoint_every: int = option(0, "a checkpoint every this many steps; 0: only at the end and on SIGTERM")
    checkpoint_every_minutes: float | None = option(
        None, ("a checkpoint once this much wall-clock time passed since the last one; None: off")
    )
    async_checkpoint: bool = option(
        True, ("write checkpoints in the background (the step waits only for the copy into host memory)")
    )
    keep_last: int = option(3, "complete checkpoints kept")
    resume: bool = option(
        True, ("resume from out_dir's checkpoints when there are any; false refuses an out_dir that has some")
    )
    resume_from: str | int = option(
        "latest", ("which checkpoint: 'latest', 'latest-valid' (the newest that verifies) or a step")
    )
    recompute_budget_mb: float | None = option(
        None,
        (
            "activation memory budget (MiB) for automatic recomputation; None: off;"
            " 0: the least memory reachable"
        ),
    )
    threads: int | None = option(
        None,
        (
            "torch CPU threads per rank; None: chosen from the rank's CPUs and its "
            "data-loader workers (logged)"
        ),
    )
    device: str = option(
        "auto",
        ("'cuda' (GPU LOCAL_RANK, NCCL), 'cpu' (gloo) or 'auto' (cuda when torch sees a GPU per local rank)"),
    )
    param_dtype: str = option(
        "fp32",
        (
            "dtype the weights and gradients are stored in: 'fp32', or the "
            "precision itself with fp32 masters in the offloaded optimizer"
        ),
    )
    dist_timeout_s: float = option(
        600.0,
        (
            "seconds any collective of any process group may wait for the other "
            "ranks; covers the longest collective and a checkpoint save"
        ),
    )
    max_consecutive_skips: int = option(
        10, ("steps in a row skipped for non-finite gradients after which the run stops")
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "imports", tuple(self.imports))
        require_int("steps", self.steps, 1)
        require_int("grad_accum", self.grad_accum, 1)
        require_choice("precision", self.precision, PRECISIONS)
        require_int("seed", self.seed, 0)
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ValueError(f"out_dir must be a directory path, got {self.out_dir!r}")
        require_int("log_every", self.log_every, 1)
        require_int("checkpoint_every", self.checkpoint_every, 0)
        if self.checkpoint_every_minutes is not None:
            require_nonneg_float("checkpoint_every_minutes", self.checkpoint_every_minutes)
        require_bool("async_checkpoint", self.async_checkpoint)
        require_int("max_consecutive_skips", self.max_consecutive_skips, 1)
        require_int("keep_last", self.keep_last, 1)
        require_bool("resume", self.resume)
        if not (self.resume_from in RESUME_CHOICES or is_int(self.resume_from) and self.resume_from >= 0):
            raise ValueError(
                f"resume_from must be one of {', '.join(map(repr, RESUME_CHOICES))} or a step >= 0, got "
                f"{self.resume_from!r}"
            )
        if self.recompute_budget_mb is not None:
            require_nonneg_float("recompute_budget_mb", self.recompute_budget_mb)
        if self.threads is not None:
            require_int("threads", self.threads, 1)
        require_choice("device", self.device, DEVICES)
        require_choice("param_dtype", self.param_dtype, PRECISIONS)
        require_nonneg_float("dist_timeout_s", self.dist_timeout_s)
        if self.dist_timeout_s < 1:
            raise ValueError(f"dist_timeout_s must be a number of seconds >= 1, got {self.dist_timeout_s!r}")
        if self.param_dtype != "fp32" and self.param_dtype != self.precision:
            raise ValueError(
                f"param_dtype = {self.param_dtype!r} needs precision = {self.param_dtype!r} (the weights' "
                f"dtype is the compute dtype), got precision = {self.precision!r}"
            )
        parallel = self.parallel
        sharded = parallel.tp_size > 1 or parallel.replica == "fsdp"
        what = "parallel.tp_size > 1" if parallel.tp_size > 1 else "parallel.replica = 'fsdp'"
        if sharded and self.optim.name == "offload":
            raise ValueError(
                f"optim.name = 'offload' steps plain tensors, and {what} makes DTensor parameters: use "
                "optim.name 'adamw' (with replica 'fsdp', parallel.fsdp_cpu_offload keeps the optimizer in "
                "host memory)"
            )
        if sharded and self.precision == "fp16":
            raise ValueError(
                f"precision = 'fp16' (loss scaling) is not supported with {what}: use precision 'bf16'"
            )
        if parallel.tp_size > 1 and self.balance.enabled:
            raise ValueError(
                "balance splits the batch between ranks by speed, but with parallel.tp_size > 1 the ranks of "
                "a tensor-parallel group must read the same batch: turn balance off or use tp_size 1"
            )
        if parallel.pp_size > 1:
            self._check_pipeline()
        if self.param_dtype != "fp32" and self.optim.name != "offload":
            raise ValueError(
                f"param_dtype = {self.param_dtype!r} keeps the model's weights in {self.param_dtype}; their "
                f"fp32 master copy lives in the offloaded optimizer, so optim.name must be 'offload', got "
                f"{self.optim.name!r}"
            )

    def _check_pipeline(self) -> None:
        """pp_size > 1: the micro-batches are the pipeline's (one schedule step per optimizer step)."""
        parallel = self.parallel
        check_pipeline_microbatches(
            parallel.pp_schedule, parallel.pp_size, self.grad_accum, "parallel.pp_size"
        )
        if self.balance.enabled or self.recompute_budget_mb is not None:
            what = "balance" if self.balance.enabled else "recompute_budget_mb"
            raise ValueError(f"{what} is not supported with parallel.pp_size > 1: turn it off")


def check_pipeline_virtual(schedule: str, virtual: int) -> None:
    """ValueError unless ``virtual`` (stages per pipeline rank) is > 1 exactly under
    ``interleaved_1f1b``."""
    if (schedule == "interleaved_1f1b") != (virtual > 1):
        raise ValueError(
            f"pp_virtual must be > 1 exactly when pp_schedule = 'interleaved_1f1b', got pp_virtual = "
            f"{virtual} with pp_schedule = {schedule!r}"
        )


def check_pipeline_microbatches(schedule: str, stages: int, microbatches: int, stages_key: str) -> None:
    """ValueError unless torch's ``schedule`` runs ``microbatches`` (the run's ``grad_accum``) over
    ``stages`` pipeline ranks: 1F1B and interleaved 1F1B need ``m >= p``; interleaved 1F1B runs whole
    rounds of ``max(1, m // p)`` micro-batches, so ``m`` must be a multiple of that."""
    if schedule != "gpipe" and microbatches < stages:
        raise ValueError(
            f"grad_accum = {microbatches} (the pipeline's micro-batches) must be >= {stages_key} = {stages} "
            f"under pp_schedule {schedule!r}"
        )
    rounds = max(1, microbatches // stages)
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        raise ValueError(
            f"grad_accum = {microbatches} must be a multiple of grad_accum // {stages_key} = {rounds} under "
            "pp_schedule 'interleaved_1f1b' (torch's interleaved schedule runs whole rounds of micro-batches)"
        )


def model_config_classes() -> dict[str, type]:
    """Model name (the ``model.name`` key of a training config) -> its config dataclass, for every
    model in the registry (:mod:`moetrain.registry`)."""
    from moetrain.registry import registered_models

    return {name: spec.config_class for name, spec in registered_models().items()}


def config_from_dict(cls: type, data, path: str = ""):
    """Builds dataclass ``cls`` from nested dicts (YAML/JSON), recursing into dataclass fields.

    Unknown keys and invalid values raise ``ValueError`` naming the key path (``optim.lr``) and
    what is allowed. ``MoEConfig`` under a model inherits the model's ``d_model`` when not given.
    """
    import typing
    from dataclasses import is_dataclass

    where = path or "config"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    if cls is TrainConfig:
        import_model_modules(data.get("imports", ()), _join(path, "imports"))
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"unknown key '{_join(path, unknown[0])}'; allowed keys there: {', '.join(sorted(names))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if cls is TrainConfig and key == "model":
            kwargs[key] = _model_config_from_dict(value, _join(path, key))
        elif isinstance(hint, type) and is_dataclass(hint):
            if hint is MoEConfig and isinstance(value, dict) and "d_model" not in value:
                parent_d_model = data.get("d_model", _field_default(cls, "d_model"))
                if parent_d_model is not None:
                    value = {**value, "d_model": parent_d_model}
            kwargs[key] = config_from_dict(hint, value, _join(path, key))
        else:
            kwargs[key] = value
    if cls is TrainConfig and "model" not in kwargs:
        raise ValueError(f"missing key '{_join(path, 'model')}' (a mapping with a 'name')")
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ValueError(f"{where}: {error}") from None
    except ValueError as error:
        raise ValueError(_prefixed(path, str(error))) from None


def _prefixed(path: str, message: str) -> str:
    """``message`` with the key path in front, without repeating the part it already names:
    ("model.tasks", "tasks.x must ...") -> "model.tasks.x must ..."."""
    parts = path.split(".") if path else []
    for start in range(len(parts)):
        named = ".".join(parts[start:])
        if message.startswith(named) and message[len(named) : len(named) + 1] in (".", " ", ":", "["):
            return ".".join([*parts[:start], message])
    return _join(path, message)


def _model_config_from_dict(data, path: str):
    classes = model_config_classes()
    if not isinstance(data, dict) or data.get("name") not in classes:
        name = data.get("name") if isinstance(data, dict) else data
        raise ValueError(f"{path}.name must be one of {', '.join(map(repr, classes))}, got {name!r}")
    cls = classes[data["name"]]
    body = {k: v for k, v in data.items() if k not in ("name", "preset")}
    if "preset" in data:
        body = _merge(preset_as_dict(cls, data["preset"], f"{path}.preset"), body)
    return config_from_dict(cls, body, path)


def import_model_modules(modules, where: str = "imports") -> None:
    """Imports the modules a config names under ``imports`` (user models that register themselves
    with :func:`moetrain.registry.register_model` when imported), before its model is parsed."""
    import importlib

    if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
        raise ValueError(f"{where} must be a list of module names, got {modules!r}")
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} must be a list of module names, got {modules!r}")
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ValueError(
                f"{where}: cannot import {name!r} ({error}); the module must be installed, on PYTHONPATH, or "
                "next to the config file"
            ) from None


def preset_names(cls: type) -> tuple[str, ...]:
    """The presets a model config class offers (``cls.preset_names()``; none when it has none)."""
    names = getattr(cls, "preset_names", None)
    return tuple(names()) if callable(names) else ()


def preset_as_dict(cls: type, name, where: str = "preset") -> dict:
    """Preset ``name`` of model config ``cls`` as the nested dict a config file would hold (what a
    file's own keys are merged over). Derived values (an MoE config's ``d_model``) are left out,
    so that they follow the file's own ``d_model``."""
    from dataclasses import asdict

    allowed = preset_names(cls)
    if name not in allowed:
        choices = ", ".join(map(repr, allowed)) if allowed else "none (this model has no presets)"
        raise ValueError(f"{where} must be one of {choices}, got {name!r}")
    preset = asdict(cls.preset(name))
    for value in preset.values():
        if isinstance(value, dict) and "d_model" in value and "d_ff" in value:
            value.pop("d_model")  # an MoEConfig: inherits the model's d_model
    return preset


def _merge(base: dict, override: dict) -> dict:
    """``override`` over ``base``, recursing into mappings present in both."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _field_default(cls: type, name: str):
    for f in fields(cls):
        if f.name == name:
            return None if f.default is MISSING else f.default
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
