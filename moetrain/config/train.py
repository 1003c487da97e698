"""One training run (:class:`TrainConfig`): the tree of sections, the run's own keys (steps,
precision, checkpoints, resume, device, ...) and the checks that span several sections."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.balance import BalanceConfig
from moetrain.config.data import DataConfig
from moetrain.config.metrics import MetricsConfig
from moetrain.config.optim import OptimConfig
from moetrain.config.options import option, short_repr
from moetrain.config.parallel import ParallelConfig, check_pipeline_microbatches
from moetrain.validation import (
    is_int,
    require_bool,
    require_choice,
    require_int,
    require_nonneg_float,
    require_number,
)

PRECISIONS = ("fp32", "bf16", "fp16")
RESUME_CHOICES = ("latest", "latest-valid")
# Upper bounds of numbers that would otherwise fail later, without naming their key. SEED_MAX: an
# int64 (checkpoints and other JSON readers); the seed formulas reduce modulo 2**64 or hash.
# THREADS_MAX: torch takes a C int. DIST_TIMEOUT_MAX_S: a year (a timedelta holds 1e9 days at most).
# RECOMPUTE_BUDGET_MAX_MB: 2**40 MiB = 2**60 bytes, within int64.
SEED_MAX = 2**63 - 1
THREADS_MAX = 4096
DIST_TIMEOUT_MAX_S = 365 * 24 * 3600
RECOMPUTE_BUDGET_MAX_MB = 2**40


DEVICES = ("auto", "cpu", "cuda")
EXPERTS_INIT = ("whole", "local")


@dataclass(frozen=True)
class TrainConfig:
    """One training run (``moetrain train --config FILE``). ``model`` is the config of the model
    named by its ``name`` key (``"moe_lm"``: :class:`moe_lm.LMConfig`); ``grad_accum``
    micro-steps per optimizer step; a checkpoint every ``checkpoint_every`` steps and every
    ``checkpoint_every_minutes`` of wall-clock time, whichever comes first (0 / None: only at the
    end and on SIGTERM), and one when the run finishes unless ``checkpoint_at_end`` is false;
    ``async_checkpoint``: write checkpoints in the background (the step waits only for the copy of
    the state into host memory); ``keep_last`` checkpoints kept;
    ``max_consecutive_skips``: steps in a row skipped for non-finite gradients after which the run
    stops; ``recompute_budget_mb``: activation-memory budget for automatic checkpointing (None:
    off; 0: recompute as much as possible); ``threads``: torch CPU threads per rank (None: chosen
    from the CPUs the rank may use and its data-loader workers, see :mod:`moetrain.cpus`);
    ``device``: ``"cuda"`` (GPU ``LOCAL_RANK``, NCCL), ``"cpu"`` (gloo) or ``"auto"`` (cuda when
    torch sees a GPU); ``experts_init``: ``"whole"`` (the model built whole on the host, then
    sharded) or ``"local"`` (built within :func:`moetrain.layers.experts_on_meta`: each rank
    allocates and initialises only its own experts, the same values); ``param_dtype``: the dtype
    the model's weights and gradients are stored in, ``"fp32"`` (``precision`` then means autocast)
    or the ``precision`` itself, with the fp32 master weights and Adam moments in the offloaded
    optimizer (``optim.name: offload``);
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
    seed: int = option(
        0, f"seed of the weights (identical on every rank) and of the data stream, in [0, {SEED_MAX}]"
    )
    out_dir: str = option(
        "runs/default",
        ("output directory: checkpoints/, logs/, metrics.jsonl, config.json, config_history.jsonl"),
    )
    log_every: int = option(
        10,
        (
            "a metrics line (and the metrics' host synchronisation) every this many steps, at the last and "
            "at every step that saves a checkpoint; the all-reduced gradient norm alone is read every step "
            "(the skip decision on inf/NaN)"
        ),
    )
    checkpoint_every: int = option(0, "a checkpoint every this many steps; 0: only at the end and on SIGTERM")
    checkpoint_at_end: bool = option(
        True,
        (
            "a checkpoint when the run finishes; false: none beyond checkpoint_every's (a benchmark or"
            " calibration run; SIGTERM still saves)"
        ),
    )
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
        "latest",
        (
            "which checkpoint: 'latest', 'latest-valid' (the newest that verifies) or a step; other than"
            " 'latest' needs resume: true"
        ),
    )
    recompute_budget_mb: float | None = option(
        None,
        (
            "activation memory budget (MiB, at most 2**40) for automatic recomputation; None: off;"
            " 0: the least memory reachable"
        ),
    )
    threads: int | None = option(
        None,
        (
            f"torch CPU threads per rank, 1 to {THREADS_MAX}; None: chosen from the rank's CPUs and its "
            "data-loader workers (logged)"
        ),
    )
    device: str = option(
        "auto",
        ("'cuda' (GPU LOCAL_RANK, NCCL), 'cpu' (gloo) or 'auto' (cuda when torch sees a GPU per local rank)"),
    )
    experts_init: str = option(
        "whole",
        (
            "'whole': every rank builds all experts on the host, then keeps its own (any model); 'local':"
            " experts built on meta, each rank allocates and initialises only its own, on its device, to"
            " the same values (a model too large for one host, M6-1T; the builder must not write expert"
            " weights)"
        ),
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
            "seconds (a year at most) any collective of any process group may wait for the other "
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
        _require_int_in("seed", self.seed, 0, SEED_MAX)
        if not isinstance(self.out_dir, str) or not self.out_dir or "\0" in self.out_dir:
            raise ValueError(
                f"out_dir must be a directory path (without NUL bytes), got {short_repr(self.out_dir)}"
            )
        require_int("log_every", self.log_every, 1)
        require_int("checkpoint_every", self.checkpoint_every, 0)
        if self.checkpoint_every_minutes is not None:
            require_nonneg_float("checkpoint_every_minutes", self.checkpoint_every_minutes)
        require_bool("async_checkpoint", self.async_checkpoint)
        require_bool("checkpoint_at_end", self.checkpoint_at_end)
        require_int("max_consecutive_skips", self.max_consecutive_skips, 1)
        require_int("keep_last", self.keep_last, 1)
        require_bool("resume", self.resume)
        if not (self.resume_from in RESUME_CHOICES or is_int(self.resume_from) and self.resume_from >= 0):
            raise ValueError(
                f"resume_from must be one of {', '.join(map(repr, RESUME_CHOICES))} or a step >= 0, got "
                f"{short_repr(self.resume_from)}"
            )
        if not self.resume and self.resume_from != "latest":
            raise ValueError(
                f"resume_from = {self.resume_from!r} needs resume: true (resume: false starts from scratch)"
            )
        require_number(
            "recompute_budget_mb", self.recompute_budget_mb, low=0, high=RECOMPUTE_BUDGET_MAX_MB,
            allow_none=True, note="(MiB)",
        )  # fmt: skip
        if self.threads is not None:
            _require_int_in("threads", self.threads, 1, THREADS_MAX)
        require_choice("device", self.device, DEVICES)
        require_choice("param_dtype", self.param_dtype, PRECISIONS)
        require_choice("experts_init", self.experts_init, EXPERTS_INIT)
        require_number(
            "dist_timeout_s",
            self.dist_timeout_s,
            low=1,
            high=DIST_TIMEOUT_MAX_S,
            note="(seconds, a year at most)",
        )
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


def _require_int_in(name: str, value, low: int, high: int) -> None:
    """An integer in ``[low, high]``."""
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {short_repr(value)}")
