"""Training settings the planner evaluates: parallel layout, batch, precision, offload, recompute."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from moetrain.config import (
    ALL_TO_ALL_ALGORITHMS,
    COMM_DTYPES,
    EP_LAYOUTS,
    EXPERTS_INIT,
    OPTIM_OVERLAPS,
    PP_SCHEDULES,
    check_pipeline_microbatches,
    check_pipeline_virtual,
    validate_strategy,
)
from moetrain.config.parallel import check_pipeline_needs_stages
from moetrain.validation import is_finite_number, require_bool, require_choice, require_int, require_number

PRECISIONS = ("fp32", "bf16", "fp16")
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of each precision
RECOMPUTE_MODES = ("none", "full", "fraction", "budget", "auto")
MODEL_CAPACITY = "model"
DEFAULT_MEMORY_HEADROOM = 0.10  # fraction of GPU memory a plan leaves free (see PlanSettings)


@dataclass(frozen=True)
class PlanSettings:
    """One training configuration on a cluster (every rank does the same).

    - ``ep_size``: expert-parallel group size (divides the world size and the expert count).
    - ``micro_batch``: sequences per rank per micro-step; ``seq_len`` text tokens each (models with
      images add their patches; None, the default: the model's maximum, ``max_seq_len`` /
      ``max_text_len``, filled in by :func:`~moetrain.planner.plan.make_plan`); ``target_len``:
      text tokens per sequence that get logits (M6's prefix-LM; None: all ``seq_len``, the
      captioning worst case; language models predict all);
      ``grad_accum`` micro-steps per optimizer step. Tokens per step = ``streams * micro_batch *
      seq_len * grad_accum``, ``streams = world_size / (tp_size * pp_size)`` data streams.
    - ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"``. With ``autocast=False`` (default) the
      model's weights and gradients are stored in that precision and the optimizer keeps fp32
      master weights and two fp32 moments (12 bytes/parameter; 8 for fp32, whose weights are
      the master), the layout :class:`moetrain.offload.OffloadOptimizer` uses. ``autocast=True``:
      fp32 weights, gradients and moments (4 + 4 + 8 bytes) with bf16/fp16 compute under
      ``torch.autocast``, which also keeps a low-precision copy of every weight it multiplies
      (2 bytes/parameter) for the backward.
    - ``offload``: optimizer states in host memory (``OffloadOptimizer``), stepped by the CPU in
      ``offload_apply_groups`` groups (pinned staging: two groups' gradients + weights).
      ``optim_overlap``: ``"none"`` (the host step between two GPU steps) or ``"delayed"`` (with
      ``offload`` only: the host step of step t runs during step t+1's forward and backward, which
      use weights one update old; host staging: every gradient and weight copy once, pinned).
    - ``experts_init``: how the engine builds the model (``TrainConfig.experts_init``): ``"whole"``
      (every rank builds every parameter on its host first, in fp32: a note when that exceeds its
      share of the node's host memory) or ``"local"`` (each rank allocates only its own experts).
    - ``recompute``: ``"none"``; ``"full"`` (every layer recomputed whole); ``"fraction"`` (the
      first ``ceil(recompute_fraction * layers)`` layers whole); ``"budget"`` (the cheapest
      per-layer choice of none / attn / ffn / attn+ffn / layer whose activations fit
      ``recompute_budget_bytes``, as :func:`moetrain.recompute.solve_recompute` picks); ``"auto"``:
      the budget is what the GPU has left after every other term (nothing recomputed if the
      activations already fit).
    - ``all_to_all``, ``ep_layout``, ``comm_dtype``, ``a2a_chunks``: as in
      :class:`moetrain.ParallelConfig` (``a2a_chunks="auto"``: the count with the least modelled
      time, :mod:`moetrain.planner.overlap`).
    - ``capacity_factor``: ``"model"`` (the model config's training value), a number, or ``None`` /
      ``0`` (dropless); ``min_capacity`` comes from the model config.
    - ``max_nodes_per_token``: node-limited routing, ``"model"`` (the model config's
      ``moe.max_nodes_per_token``), an integer >= 1 or ``None`` (no limit); the plan then reports
      what it changes (:mod:`moetrain.planner.node_limit`).
    - ``compute_efficiency``: fraction of the GPU's peak FLOP/s the model's matmuls reach (0, 1].
    - ``memory_headroom``: fraction of each GPU's memory the plan keeps free, in [0, 1) (default
      0.10). A plan fits only if its total is at most the usable memory, ``memory_bytes * (1 -
      memory_headroom)``, and ``"auto"`` recompute budgets against that. The margin covers what the
      model does not know: activations are validated to within 10%, the buffers, transient and
      reserved terms are estimates, and the driver shows less than the datasheet (~31.75 of a
      V100's 32 GiB).
    - ``async_checkpoint``: checkpoints are written in the background (the engine's default),
      from a host-memory copy (staging) of everything each rank saves: its weights and its
      optimizer states, already offloaded or not.
    - ``tp_size``, ``strategy``: tensor parallelism (as :class:`moetrain.ParallelConfig`): the
      units the strategy splits (:mod:`moetrain.planner.split`) hold ``1/tp_size`` of their
      weights, gradients and optimizer states per rank and cost their activation all-reduces in
      the tp group; a tp group reads one data stream (``world / tp_size`` streams).
    - ``pp_size``, ``pp_schedule``, ``pp_virtual``: pipeline stages (as :class:`moetrain.ParallelConfig`;
      the micro-batches are ``grad_accum``): memory is the largest pipeline rank's, with its
      activations in flight, and the step time has the bubble and the transfers between stages
      (:mod:`moetrain.planner.pipeline`); recompute is not planned with stages (``"auto"`` plans
      none), and ``tp_size`` must be 1.
    """

    ep_size: int = 1
    micro_batch: int = 1
    seq_len: int | None = None
    target_len: int | None = None
    grad_accum: int = 1
    precision: str = "bf16"
    autocast: bool = False
    offload: bool = False
    offload_apply_groups: int = 4
    optim_overlap: str = "none"
    experts_init: str = "whole"
    recompute: str = "auto"
    recompute_fraction: float | None = None
    recompute_budget_bytes: int | None = None
    all_to_all: str = "auto"
    ep_layout: str = "packed"
    comm_dtype: str | None = None
    a2a_chunks: int | str = 1
    capacity_factor: float | str | None = MODEL_CAPACITY
    max_nodes_per_token: int | str | None = MODEL_CAPACITY
    compute_efficiency: float = 0.4
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    async_checkpoint: bool = True
    tp_size: int = 1
    strategy: dict | None = None
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1

    def __post_init__(self) -> None:
        require_int("ep_size", self.ep_size, 1)
        require_int("tp_size", self.tp_size, 1)
        require_int("pp_size", self.pp_size, 1)
        require_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        require_int("pp_virtual", self.pp_virtual, 1)
        check_pipeline_needs_stages(self.pp_size, self.pp_schedule, self.pp_virtual, "pp_size (--pp-size)")
        if self.pp_size > 1:
            check_pipeline_virtual(self.pp_schedule, self.pp_virtual)
            if self.tp_size > 1:
                raise ValueError(f"pp_size = {self.pp_size} composes with ep and dp only: tp_size must be 1")
            if self.recompute not in ("none", "auto"):
                raise ValueError(
                    f"recompute must be 'none' or 'auto' with pp_size > 1 (not planned with stages), got "
                    f"{self.recompute!r}"
                )
            check_pipeline_microbatches(self.pp_schedule, self.pp_size, self.grad_accum, "pp_size")
        if self.strategy is not None:
            object.__setattr__(self, "strategy", validate_strategy("strategy", self.strategy))
        if self.tp_size > 1 and self.strategy is None:
            raise ValueError(f"tp_size = {self.tp_size} needs a strategy saying which layers are split")
        require_int("micro_batch", self.micro_batch, 1)
        if self.seq_len is not None:
            require_int("seq_len", self.seq_len, 1)
        require_int("grad_accum", self.grad_accum, 1)
        if self.target_len is not None:
            require_int("target_len", self.target_len, 1)
            if self.seq_len is not None and self.target_len > self.seq_len:
                raise ValueError(f"target_len must be <= seq_len = {self.seq_len}, got {self.target_len}")
        require_choice("precision", self.precision, PRECISIONS)
        require_bool("autocast", self.autocast)
        if self.autocast and self.precision == "fp32":
            raise ValueError("autocast must be False with precision 'fp32' (nothing to cast to)")
        require_bool("offload", self.offload)
        require_int("offload_apply_groups", self.offload_apply_groups, 1)
        require_choice("optim_overlap", self.optim_overlap, OPTIM_OVERLAPS)
        require_choice("experts_init", self.experts_init, EXPERTS_INIT)
        if self.optim_overlap == "delayed" and not self.offload:
            raise ValueError("optim_overlap 'delayed' needs offload (the host optimizer is what it overlaps)")
        require_choice("recompute", self.recompute, RECOMPUTE_MODES)
        if self.recompute == "fraction":
            fraction = self.recompute_fraction
            require_number("recompute_fraction", fraction, low=0, high=1, note="when recompute = 'fraction'")
        elif self.recompute_fraction is not None:
            raise ValueError(
                f"recompute_fraction is only used with recompute = 'fraction' (got recompute = "
                f"{self.recompute!r}); leave it None"
            )
        if self.recompute == "budget":
            require_int("recompute_budget_bytes", self.recompute_budget_bytes, 0)
        elif self.recompute_budget_bytes is not None:
            raise ValueError(
                f"recompute_budget_bytes is only used with recompute = 'budget' (got recompute = "
                f"{self.recompute!r}); leave it None"
            )
        require_choice("all_to_all", self.all_to_all, ALL_TO_ALL_ALGORITHMS)
        require_choice("ep_layout", self.ep_layout, EP_LAYOUTS)
        require_choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        if self.a2a_chunks != "auto":
            require_int("a2a_chunks", self.a2a_chunks, 1, note="or 'auto'")
        if self.all_to_all == "node_dedup" and self.a2a_chunks not in (1, "auto"):
            raise ValueError(
                f"a2a_chunks = {self.a2a_chunks!r} chunks the flat and hierarchical all-to-all only; with "
                "all_to_all = 'node_dedup' use 1 or 'auto' (which is 1 there)"
            )
        cf = self.capacity_factor
        if not (cf is None or cf == MODEL_CAPACITY or (is_finite_number(cf) and cf >= 0)):
            raise ValueError(
                f"capacity_factor must be 'model', a finite number >= 0, or None (dropless), got {cf!r}"
            )
        if self.max_nodes_per_token not in (None, MODEL_CAPACITY):
            require_int(
                "max_nodes_per_token", self.max_nodes_per_token, 1, note="or 'model'", allow_none=True
            )
        require_number("compute_efficiency", self.compute_efficiency, low=0, high=1, low_open=True)
        require_number(
            "memory_headroom", self.memory_headroom, low=0, high=1, high_open=True,
            note="(fraction of GPU memory kept free)",
        )  # fmt: skip

    @property
    def tokens_per_micro_batch(self) -> int:
        """Text tokens one rank processes per micro-step: ``micro_batch * seq_len`` (ValueError while
        ``seq_len`` is None, the model's maximum: :func:`~moetrain.planner.plan.make_plan` knows it)."""
        if self.seq_len is None:
            raise ValueError("seq_len is None (the model's maximum): resolve it with a model first")
        return self.micro_batch * self.seq_len

    def usable_memory(self, memory_bytes: int) -> int:
        """Bytes of a GPU with ``memory_bytes`` a plan may fill: ``memory_bytes * (1 -
        memory_headroom)``, rounded down."""
        return math.floor(memory_bytes * (1 - self.memory_headroom))

    def replace(self, **changes) -> PlanSettings:
        """A copy with ``changes`` (field names checked: ValueError naming the allowed ones)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown settings field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
