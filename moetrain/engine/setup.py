"""Set-up of a run: everything a :class:`~moetrain.engine.Trainer` needs before its first step.

From a validated :class:`TrainConfig`: the device and the process groups, the start-up checks and
the ``out_dir`` lock, the model (built by its registry builder with no parallel layout, then
parallelized by the run's strategy), the optimizer and its LR schedule (:func:`lr_at`), the loss
scaler and the checkpoint writer, then batch balancing and the recompute plan when configured.
:func:`check_fits` validates the parallel layout against the model before anything is built.

:class:`RunSetUp` is one of the parts :class:`moetrain.engine.Trainer` is made of; it holds the
set-up methods and is not used alone.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.agreement import check_same_start
from moetrain.balance import balance_batch, calibrate_speeds
from moetrain.checkpoint import CheckpointWriter
from moetrain.config import TrainConfig
from moetrain.cpus import cpus_per_rank, default_threads
from moetrain.layers import experts_on_meta
from moetrain.layers.experts import GroupedExperts
from moetrain.metrics import check_sinks
from moetrain.offload import GroupwiseApply, OffloadOptimizer
from moetrain.parallel import ParallelContext, check_sizes, init_distributed, read_launch_environment
from moetrain.parallelize import default_strategy, parallelize, to_device_but_meta
from moetrain.phase_times import PhaseTimer
from moetrain.registry import DataShard, spec_for_config
from moetrain.run_dir import RunLock, check_out_dir
from moetrain.scope import has_marks
from moetrain.watchdog import Watchdog

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the config's names
log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int, local_world_size: int) -> torch.device:
    """The config's ``device`` for the process with ``local_rank`` of ``local_world_size`` on its
    node: ``"cuda"`` is GPU ``local_rank`` (NCCL needs one GPU per rank); ``"auto"`` is cuda when
    torch sees a GPU for every local rank, else cpu."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        name = "cuda" if gpus >= local_world_size else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if gpus < local_world_size:
        raise ValueError(
            f"device = 'cuda' needs one GPU per rank: {local_world_size} ranks on this node, torch sees "
            f"{gpus} GPU(s); use device: cpu (or auto)"
        )
    return torch.device("cuda", local_rank)


def to_device(value, device: torch.device):
    """Tensors inside ``value`` (a tensor, or dicts / lists / tuples of them) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): ``(step + 1) / warmup`` during
    warm-up, then ``min + (1 - min) * (1 + cos(pi * progress)) / 2`` with ``progress = (step -
    warmup) / (steps - warmup)`` capped at 1. The last step (``step = steps - 1``) is at progress
    ``1 - 1 / (steps - warmup)``: ``min`` is reached one step after it."""
    optim = config.optim
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    span = max(1, config.steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def run_strategy(config: TrainConfig, spec, model) -> dict[str, str] | None:
    """The strategy a run applies: the config's ``parallel.strategy`` (or ``--strategy``), else the
    model's registered default (its ``strategy`` hook), else None for a model built under
    :mod:`moetrain.scope` (``parallelize`` resolves its marks for the run's mesh: ``split`` marks
    become ``split`` only where ``tp_size`` > 1), else :func:`default_strategy`."""
    if config.parallel.strategy is not None:
        return dict(config.parallel.strategy)
    if spec.strategy is not None:
        return spec.strategy(config)
    return None if has_marks(model) else default_strategy(model)


def check_fits(config: TrainConfig, world_size: int) -> None:
    """Validates the parallel layout against the model, the balancing lists against the ranks and
    the config against the model's ``check`` hook (:mod:`moetrain.registry`) before anything is
    built or written: one-line ValueErrors naming the numbers."""
    ep, tp = config.parallel.ep_size, config.parallel.tp_size
    try:
        check_sizes(world_size, ep, tp, config.parallel.pp_size)
    except ValueError as error:
        raise ValueError(f"parallel.{error}") from None
    moe = getattr(config.model, "moe", None)
    has_moe_layers = moe is not None and getattr(config.model, "num_moe_layers", 1) > 0
    if has_moe_layers and moe.num_experts % ep:
        raise ValueError(
            f"model.moe.num_experts = {moe.num_experts} must be divisible by parallel.ep_size = {ep}"
        )
    check_balance_lengths(config.balance, world_size)
    check = spec_for_config(config.model).check
    if check is not None:
        check(config)


def check_balance_lengths(balance, world_size: int) -> None:
    """``balance.speeds`` / ``balance.memory_limits``, when given, have one entry per rank."""
    for name in ("speeds", "memory_limits"):
        value = getattr(balance, name)
        if balance.enabled and value is not None and len(value) != world_size:
            raise ValueError(f"balance.{name} has {len(value)} entries; the run has {world_size} ranks")


def world_size_from_env() -> int:
    from moetrain.parallel import read_launch_environment

    return read_launch_environment(os.environ).world_size


class RunSetUp:
    """The set-up part of :class:`moetrain.engine.Trainer`: ``_set_up`` builds the run's state
    (``self.model``, ``self.trained``, ``self.optimizer``, ``self.batches``, ...), the other methods
    are its stages."""

    def _set_up(self, config: TrainConfig, on_out_dir_locked) -> None:
        check_out_dir(config.out_dir, config.resume)
        check_sinks(config.metrics.sinks)  # a tracker's missing package: one line on every rank, now
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        launch = read_launch_environment()
        self.device = resolve_device(config.device, launch.local_rank, launch.local_world_size)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.position.phase = "process-group set-up"
        self.launch = init_distributed(
            backend="nccl" if self.device.type == "cuda" else "gloo", timeout_s=config.dist_timeout_s
        )
        self.position.rank = dist.get_rank() if dist.is_initialized() else 0
        self.position.phase = "start-up checks"
        check_same_start(asdict(config), dist.get_world_size() if dist.is_initialized() else 1)
        self.parallel = ParallelContext(
            config.parallel, timeout_s=config.dist_timeout_s, device_type=self.device.type
        )
        self.rank = self.parallel.rank
        self.is_main = self.rank == 0
        self.out_dir = Path(config.out_dir)
        self.lock = self._lock_out_dir()
        if on_out_dir_locked is not None:
            on_out_dir_locked(self.rank)
        if self.launch.store is not None:
            stall_s = max(2.0, config.dist_timeout_s / 2)
            self.watchdog = Watchdog(
                Watchdog.connection_to(self.launch.store), self.rank, self.parallel.world_size, self.position,
                interval_s=min(10.0, stall_s / 4), stall_s=stall_s,
                store_served_by=None if self.launch.agent_store else 0,
            ).start()  # fmt: skip
            self.position.watchdog = self.watchdog
        self.position.phase = "model set-up"
        torch.manual_seed(config.seed)  # identical on every rank: dense replicas start equal
        random.seed(config.seed)
        spec = spec_for_config(config.model)
        p = self.parallel
        shard = DataShard(p.data_index, p.data_count, p.rank, p.world_size, p.dense_group)
        # experts_init local: the experts on meta, this rank's own allocated after sharding
        with experts_on_meta(config.experts_init == "local"):
            self.model, self.batches, self.loss_fn = spec.builder(config, shard)
        if config.threads is None:
            self._choose_threads()
        self.position.model = self.model
        to_device_but_meta(self.model, self.device)
        param_dtype = DTYPES[config.param_dtype]  # bf16 / fp16: the OffloadOptimizer keeps fp32 masters
        built = sorted({str(p.dtype) for p in self.model.parameters() if p.is_floating_point()})
        if built != [str(param_dtype)]:
            if self.is_main:
                log.info("model built with %s weights, cast to param_dtype %s", ", ".join(built), param_dtype)
            self.model.to(param_dtype)
        self.loss_weight = 1.0  # hardware-aware balancing: W * n_r / N
        self.global_batch = config.data.micro_batch_size * self.parallel.data_count
        self.strategy = run_strategy(config, spec, self.model)
        self.trained = parallelize(self.model, self.parallel, self.strategy, auto=self.auto)
        self.trained.materialize(self.device)  # experts_init local: this rank's experts (else a no-op)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_at(step, config))
        self.autocast_dtype = DTYPES[config.precision] if config.precision != "fp32" else None
        self.device_type = self.device.type
        self.scaler = torch.amp.GradScaler(self.device_type) if config.precision == "fp16" else None
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.writer = CheckpointWriter(
            self.checkpoint_dir,
            parallel=self.parallel,
            keep_last=config.keep_last,
            asynchronous=config.async_checkpoint,
            timeout_s=config.dist_timeout_s,
        )
        self.step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint this run loaded or saved
        self.preempted = False  # stopped by SIGTERM after checkpointing
        self.skipped_steps = 0  # optimizer steps skipped for non-finite gradients, this run
        self.consecutive_skips = 0  # skips in a row that count toward max_consecutive_skips
        self.last_update_step = 0  # the last step whose optimizer update was applied (0: none)
        self.stop_requested = False
        self.recompute_plan = None
        self.balance = None
        self._proxy_weights = None  # calibration under EP: the proxy FFN's weights, made on first use
        self._window: list[dict] = []  # per-step device values since the last logged step
        self._step_counts, self._stage_forwards = {}, {}  # this step's routing counts (StepMetrics)
        if self.trained.pipeline is not None:
            self._watch_stage_routing(self.trained.pipeline)
        self.phases = PhaseTimer(self.device)  # forward / backward / grad sync / optimizer, per step
        self._last_checkpoint_time = time.monotonic()
        if config.balance.enabled:
            self.position.phase = "batch balancing"
            self._balance_batches()
        if config.recompute_budget_mb is not None:
            self.position.phase = "recompute planning"
            self._plan_recompute()
            if self.device.type == "cuda":  # the profile's whole-model forward held more than a step will
                torch.cuda.empty_cache()
        self.position.phase = "set-up"

    def _choose_threads(self) -> None:
        """``threads: null``: torch threads from this rank's share of the CPUs and its data-loader
        workers (``batches.num_workers``, 0 where the model has none); one log line."""
        cpus = cpus_per_rank(self.parallel.world_size)
        workers = getattr(self.batches, "num_workers", 0)
        threads = default_threads(cpus, workers)
        torch.set_num_threads(threads)
        log.info(
            "rank %d: torch threads %d (CPUs for this rank: %d, data-loader workers: %d; set threads: N to "
            "override)", self.rank, threads, cpus, workers,
        )  # fmt: skip

    def _lock_out_dir(self) -> RunLock | None:
        """Rank 0 takes ``out_dir``'s lock; every rank raises when it could not."""
        lock, error = None, None
        if self.is_main:
            try:
                lock = RunLock(self.out_dir)
                lock.acquire()
            except (ValueError, OSError) as caught:
                error = (
                    caught
                    if isinstance(caught, ValueError)
                    else ValueError(f"out_dir {self.out_dir}: {caught}")
                )
        if self.parallel.world_size > 1:
            errors = [None] * self.parallel.world_size
            dist.all_gather_object(errors, None if error is None else str(error))
            if error is None and errors[0] is not None:
                raise ValueError(errors[0])
        if error is not None:
            raise error
        return lock

    # ------------------------------------------------------------------------------------------
    def _build_optimizer(self) -> torch.optim.Optimizer:
        optim = self.config.optim
        groups = weight_decay_groups(self.model, optim.weight_decay)
        if optim.name == "offload":
            return OffloadOptimizer(
                groups, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                num_apply_groups=optim.num_apply_groups,
                overlap=optim.overlap, overlap_after_steps=optim.overlap_after_steps,
            )  # fmt: skip
        adamw = torch.optim.AdamW(
            groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, **adamw_implementation(self.model)
        )
        return GroupwiseApply(adamw, optim.num_apply_groups) if optim.name == "groupwise" else adamw

    def _plan_recompute(self) -> None:
        """Profiles one micro-batch in the training precision and recomputes the cheapest set of
        blocks whose activations fit ``recompute_budget_mb`` (0: the least memory reachable).

        The batch is the data's ``probe`` (the largest shape it can produce, where the batches
        object says so). With several ranks (expert parallelism: ranks route different rows), every
        rank plans on the element-wise maximum of all ranks' profiles (:func:`merge_profiles`):
        all apply one plan, which fits the budget on each rank, or all raise the same error."""
        from moetrain.recompute import (
            apply_recompute_plan,
            merge_profiles,
            plan_recompute,
            profile_activations,
            remove_recompute,
        )

        probe = self.batches.probe(self.batches.batch, self.config.seed * 31 + 7 + self.parallel.data_index)
        inputs, targets = to_device(probe, self.device)
        with self._autocast(), self.trained.loss_context():
            profile = profile_activations(self.model, inputs, loss_fn=lambda out: self.loss_fn(out, targets))
        world = self.parallel.world_size
        if world > 1:
            profiles = [None] * world
            dist.all_gather_object(profiles, profile)
            profile = merge_profiles(profiles)
        budget_mb = self.config.recompute_budget_mb
        budget = int(budget_mb * 2**20) if budget_mb else profile.min_activation_bytes
        try:
            plan = plan_recompute(profile, budget, self.model)
        except ValueError:
            least = _mib_at_least(profile.min_activation_bytes)
            over = f", the largest over the {world} ranks" if world > 1 else ""
            raise ValueError(
                f"recompute_budget_mb = {budget_mb} is below the least activation memory recompute can "
                f"reach, {least} MiB{over} ({profile.baseline_bytes / 2**20:.3f} MiB without recompute); "
                f"set recompute_budget_mb to at least {least}, or to 0 for the least memory reachable"
            ) from None
        remove_recompute(self.model)
        apply_recompute_plan(self.model, plan)
        self.recompute_plan = plan
        if self.is_main:
            ranks = f"recompute plan of the {world} ranks (each block at its largest over them)\n"
            log.info("%s%s", ranks if world > 1 else "", plan.summary())

    def _autocast(self):
        return torch.autocast(
            self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )

    def _balance_batches(self) -> None:
        """Splits the global micro-batch between the ranks by speed (given or calibrated)."""
        balance = self.config.balance
        check_balance_lengths(balance, self.parallel.world_size)  # the command line: in check_fits
        if balance.calibrate:
            micro = self.config.data.micro_batch_size
            sizes = (micro, 2 * micro, 4 * micro)
            speeds = [
                s.samples_per_s for s in calibrate_speeds(self._timed_pass, sizes=sizes, repeats=5, warmup=2)
            ]
        else:
            speeds = list(balance.speeds)
        self.balance = balance_batch(self.global_batch, speeds, balance.memory_limits)
        self.batches.batch = self.balance.micro_batches[self.rank]
        self.loss_weight = self.balance.loss_weights[self.rank]
        if self.is_main:
            log.info(
                "balanced micro-batches %s (speeds %s), predicted speed-up %.2fx",
                list(self.balance.micro_batches), speeds, self.balance.speedup,
            )  # fmt: skip

    def _timed_pass(self, sequences: int) -> None:
        """One forward+backward on ``sequences`` sequences, for speed calibration (grads dropped).

        With expert parallelism the model's pass waits for the other EP ranks at every all-to-all,
        so each rank would time the slowest one; the rank then times a communication-free proxy
        instead: an FFN of the model's shape (``d_model -> d_ff -> d_model``) over the tokens of
        ``sequences`` sequences (relative speeds are what balancing needs)."""
        if self.parallel.ep_size > 1:
            self._timed_proxy(sequences)
        else:
            probe = self.batches.probe(sequences, self.config.seed * 31 + 11 + self.rank)
            inputs, targets = to_device(probe, self.device)
            output = self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)
            self.loss_fn(output, targets).backward()
            self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the timer must see the work done

    def _timed_proxy(self, sequences: int) -> None:
        model = self.config.model
        d_model, d_ff = model.d_model, model.moe.d_ff
        if self._proxy_weights is None:
            generator = torch.Generator().manual_seed(0)
            self._proxy_weights = [
                (torch.randn(*shape, generator=generator) / shape[0] ** 0.5).to(self.device).requires_grad_()
                for shape in ((d_model, d_ff), (d_ff, d_model))
            ]
        w1, w2 = self._proxy_weights
        x = torch.randn(sequences * self.config.data.seq_len, d_model, device=self.device)
        with self._autocast():
            y = F.gelu(x @ w1) @ w2
        y.float().square().mean().backward()
        w1.grad = w2.grad = None


def _mib_at_least(num_bytes: int) -> str:
    """``num_bytes`` in MiB with 3 decimals, rounded up: ``int(float(result) * 2**20) >= num_bytes``."""
    mib = math.ceil(num_bytes / 2**20 * 1000) / 1000
    while int(float(f"{mib:.3f}") * 2**20) < num_bytes:
        mib += 0.001
    return f"{mib:.3f}"


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The optimizer's two param groups: ``weight_decay`` for matrices, 0 for biases, norms and
    other 1-D parameters. Each expert's parameters are judged by their own shape: the experts'
    stacked biases (``b1_EF``, ``b2_ED``: 2-D, one row per expert) are biases. A norm is a parameter
    of a norm layer (a class named ``...Norm`` or ``...Norm1d/2d/3d``: LayerNorm, RMSNorm, GroupNorm,
    BatchNorm2d...), whatever its name and shape."""
    stacked = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(False)}
    norms = {id(p) for m in model.modules() if _is_norm_layer(m) for p in m.parameters(False)}
    decay, no_decay = [], []
    for param in model.parameters():
        per_item_dims = param.dim() - (id(param) in stacked)
        (no_decay if per_item_dims < 2 or id(param) in norms else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _is_norm_layer(module: torch.nn.Module) -> bool:
    return re.fullmatch(r".*Norm([123]d)?", type(module).__name__) is not None


def adamw_implementation(model: torch.nn.Module) -> dict[str, bool]:
    """``torch.optim.AdamW``'s implementation for ``model``'s parameters: ``fused`` (no temporaries;
    3.7x faster than ``foreach`` on the CPU in ``benchmarks/cpu_adam.py``, 50M parameters) when they
    are plain floating-point CPU tensors; else ``foreach`` when they are all of one
    kind (plain tensors, or DTensors of split or sharded layers), neither when DTensors and plain
    tensors are mixed (torch's multi-tensor kernels take one kind per list). CUDA keeps ``foreach``:
    the planner's optimizer-step peak (its ``sqrt(exp_avg_sq)`` temporary) was measured with it
    (docs/planner.md); ``fused`` there waits for a GPU measurement of its speed and peak."""
    params = list(model.parameters())
    dtensors = {type(p).__name__ == "DTensor" for p in params}
    if dtensors == {False} and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": len(dtensors) == 1}
