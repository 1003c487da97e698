"""The parallel layout of a run (:class:`ParallelConfig`: expert, tensor, data and pipeline
parallelism, the all-to-all), the strategy mapping's validation and the pipeline schedule rules
the run and the planner share."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.moe import KERNEL_CHOICES
from moetrain.config.options import option
from moetrain.validation import is_int, require_bool, require_choice, require_int, require_positive_float

A2A_LINK_FIELDS = (
    "intra_node_latency",
    "inter_node_latency",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "flops_per_s",
)

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


# The planner's GPU presets (moetrain.planner.hardware.GPU_PRESETS; a test keeps the two equal): the
# machines `moetrain train` can describe to the planner for scope.auto() (``auto_gpu``).
AUTO_GPUS = ("v100-32gb", "a100-80gb", "h100-80gb", "p100-16gb")


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
    - ``a2a_links``: the constants ``a2a_chunks: auto`` chooses with (:mod:`moetrain.comm.chunk_cost`),
      a mapping of ``intra_node_latency`` and ``inter_node_latency`` (seconds per message),
      ``intra_node_bandwidth`` (bytes/s one rank sends inside its node), ``inter_node_bandwidth``
      (bytes/s one node sends to the others) and ``flops_per_s`` (what the experts reach), all > 0;
      None: on CPU ranks the fit of the emulated gloo cluster, on GPU ranks an error at the first
      chunk choice (no measured default there).
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
    a2a_links: dict | None = option(
        None,
        (
            "a2a_chunks 'auto': the links' intra_node_latency, inter_node_latency (s), "
            "intra_node_bandwidth, inter_node_bandwidth (bytes/s) and flops_per_s; None: CPU ranks' fit"
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
    auto_gpu: str | None = option(
        None,
        (
            "the GPU type scope.auto() modules are decided for when `moetrain train` parallelizes a model"
            " built under scopes (a planner preset: " + ", ".join(map(repr, AUTO_GPUS)) + "; the nodes and"
            " GPUs per node are the run's); None: scope.auto() is an error there"
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
        if self.a2a_links is not None:
            _require_links(self.a2a_links)
        require_int("tp_size", self.tp_size, 1)
        if self.auto_gpu is not None:
            require_choice("auto_gpu", self.auto_gpu, AUTO_GPUS)
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
        check_pipeline_needs_stages(self.pp_size, self.pp_schedule, self.pp_virtual, "pp_size")
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


def check_pipeline_needs_stages(stages: int, schedule: str, virtual: int, stages_key: str) -> None:
    """ValueError when what only a pipeline uses, ``virtual`` > 1 stages per rank or the
    ``interleaved_1f1b`` schedule, is asked for without one (``stages`` = 1), which would ignore it."""
    asked = [f"pp_schedule = {schedule!r}"] if schedule == "interleaved_1f1b" else []
    asked += [f"pp_virtual = {virtual}"] if virtual != 1 else []
    if stages == 1 and asked:
        raise ValueError(
            f"{' and '.join(asked)}: only used with pipeline stages, {stages_key} > 1 (got 1); without "
            "them leave pp_virtual = 1 and pp_schedule '1f1b' or 'gpipe'"
        )


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


def _require_links(links) -> None:
    """``a2a_links``: a mapping of exactly :data:`A2A_LINK_FIELDS` to positive numbers."""
    if not isinstance(links, dict) or set(links) != set(A2A_LINK_FIELDS):
        got = sorted(links) if isinstance(links, dict) else type(links).__name__
        raise ValueError(f"a2a_links must map exactly {', '.join(A2A_LINK_FIELDS)} to numbers, got {got}")
    for name in A2A_LINK_FIELDS:
        require_positive_float(f"a2a_links.{name}", links[name])
