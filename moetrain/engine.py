"""The training loop: ``Trainer(TrainConfig).train()``.

One optimizer step = ``grad_accum`` micro-steps of ``data.micro_batch_size`` sequences per rank:

0. the model is built by its registry builder with no parallel layout, then the run's strategy
   (``parallel.strategy``, ``--strategy FILE``, else the model's default) is applied by
   :func:`moetrain.parallelize` over the mesh of :class:`~moetrain.parallel.ParallelContext`;
1. forward under autocast (bf16 / fp16) and ``loss / grad_accum`` backward (DDP or FSDP2 syncs
   replicated gradients on the last micro-step only; vocabulary-sharded logits go through
   ``loss_parallel()``); MoE aux losses are injected into the same backward with the matching
   scale (``set_aux_loss_scale``: ``loss_scale / grad_accum``);
2. expert gradients reduced over their expert-data-parallel group (and, under DDP, the split
   layers' shards over the dense group);
3. clipping by the true global norm (each expert once), optimizer step (AdamW, group-wise or
   CPU-offloaded), LR schedule: linear warm-up then cosine decay to ``min_lr_ratio * lr``.
   fp16: the norm is taken of the still-scaled gradients (clipping at ``grad_clip * scale``) and,
   being all-reduced, says on every rank at once whether any gradient anywhere overflowed: then
   every rank skips the step and lowers the scale together (an overflow in one rank's experts must
   not leave the other ranks stepping). Otherwise ``GradScaler.step`` unscales, inside the fused /
   C++ Adam step where the optimizer supports it.

``device``: ``"cuda"`` puts the model and batches on GPU ``LOCAL_RANK`` with NCCL, ``"cpu"`` runs
on gloo, ``"auto"`` picks cuda when torch sees a GPU.

Rank 0 shows a progress bar and writes ``out_dir/metrics.jsonl`` (and TensorBoard events when the
``tensorboard`` package is installed): loss, aux loss, learning rate, grad norm, tokens/s, and per
MoE layer the expert-load coefficient of variation and the dropped-token fraction. Checkpoints go
to ``out_dir/checkpoints`` every ``checkpoint_every`` steps, at the end, and when SIGTERM arrives
(SLURM pre-emption or time limit); a run resumes from the latest one (or the one ``resume_from``
names: resuming from an older step than the newest sets the newer ones aside, see
:meth:`Trainer.maybe_resume`). Set-up releases what it took (the ``out_dir`` lock first) on any
exception, and ``release()`` does after a failed run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.agreement import check_same_start
from moetrain.balance import balance_batch, calibrate_speeds
from moetrain.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    remove_debris,
    set_aside_newer,
    verify_checkpoint,
)
from moetrain.config import TrainConfig
from moetrain.cpus import cpus_per_rank, default_threads
from moetrain.failures import RunPosition
from moetrain.layers import (
    MoELayer,
    collect_moe_stats,
    discard_routed_counts,
    set_aux_loss_scale,
    update_score_biases,
)
from moetrain.layers.experts import local_tensor
from moetrain.metrics import MetricsLog, RunInfo, check_sinks
from moetrain.offload import GroupwiseApply, OffloadOptimizer
from moetrain.parallel import ParallelContext, check_sizes, init_distributed, read_launch_environment
from moetrain.parallelize import default_strategy, parallelize
from moetrain.phase_times import PhaseTimer
from moetrain.progress import ProgressBar
from moetrain.registry import DataShard, spec_for_config
from moetrain.run_dir import RunLock, check_out_dir, config_changes, record_config
from moetrain.scope import has_marks
from moetrain.watchdog import Watchdog

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
    warm-up, then ``min + (1 - min) * (1 + cos(pi * progress)) / 2`` with progress in [0, 1]."""
    optim = config.optim
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    span = max(1, config.steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Builds everything a run needs from a validated :class:`TrainConfig`, then ``train()``.

    ``position`` says where the run is (rank, step, phase), for :func:`moetrain.failures.describe_failure`.
    """

    def __init__(self, config: TrainConfig, position: RunPosition | None = None, on_out_dir_locked=None):
        """``on_out_dir_locked(rank)``: called once this run owns ``out_dir`` (the command line
        then starts the rank's log file there). When set-up fails at any stage (or is interrupted:
        any exception, ``KeyboardInterrupt`` included) what it had started is released before the
        exception propagates: the ``out_dir`` lock, the watchdog, the data loader, the checkpoint
        writer."""
        self.config = config
        self.position = position if position is not None else RunPosition()
        self.lock = self.watchdog = self.writer = self.batches = None
        try:
            self._set_up(config, on_out_dir_locked)
        except BaseException:
            self.release()
            raise

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
                self.launch.store, self.rank, self.parallel.world_size, self.position,
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
        self.model, self.batches, self.loss_fn = spec.builder(config, shard)
        if config.threads is None:
            self._choose_threads()
        self.position.model = self.model
        self.model.to(self.device)
        if config.param_dtype != "fp32":  # fp32 masters: built by the OffloadOptimizer below
            self.model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[config.param_dtype])
        self.loss_weight = 1.0  # hardware-aware balancing: W * n_r / N
        self.global_batch = config.data.micro_batch_size * self.parallel.data_count
        self.strategy = run_strategy(config, spec, self.model)
        self.trained = parallelize(self.model, self.parallel, self.strategy)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_at(step, config))
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
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
        self.consecutive_skips = 0
        self.stop_requested = False
        self.recompute_plan = None
        self.balance = None
        self._proxy_weights = None  # calibration under EP: the proxy FFN's weights, made on first use
        self._window: list[dict] = []  # per-step device values since the last logged step
        self.phases = PhaseTimer(self.device)  # forward / backward / grad sync / optimizer, per step
        self._last_checkpoint_time = time.monotonic()
        if config.balance.enabled:
            self.position.phase = "batch balancing"
            self._balance_batches()
        if config.recompute_budget_mb is not None:
            self.position.phase = "recompute planning"
            self._plan_recompute()
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
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (no_decay if param.dim() < 2 or "norm" in name else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if optim.name == "offload":
            return OffloadOptimizer(
                groups, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                num_apply_groups=optim.num_apply_groups,
                overlap=optim.overlap, overlap_after_steps=optim.overlap_after_steps,
            )  # fmt: skip
        # torch's multi-tensor kernels cannot mix DTensors (split layers) with plain tensors in one list
        kinds = {type(p).__name__ == "DTensor" for p in self.model.parameters()}
        adamw = torch.optim.AdamW(
            groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=len(kinds) == 1
        )
        return GroupwiseApply(adamw, optim.num_apply_groups) if optim.name == "groupwise" else adamw

    def _plan_recompute(self) -> None:
        """Profiles one micro-batch in the training precision and recomputes the cheapest set of
        blocks whose activations fit ``recompute_budget_mb`` (0: the least memory reachable)."""
        from moetrain.recompute import (
            apply_recompute_plan,
            plan_recompute,
            profile_activations,
            remove_recompute,
        )

        probe = self.batches.probe(self.batches.batch, self.config.seed * 31 + 7 + self.parallel.data_index)
        inputs, targets = to_device(probe, self.device)
        with self._autocast(), self.trained.loss_context():
            profile = profile_activations(self.model, inputs, loss_fn=lambda out: self.loss_fn(out, targets))
        budget = self.config.recompute_budget_mb * 2**20 or profile.min_activation_bytes
        plan = plan_recompute(profile, int(budget), self.model)
        names = [list(plan.recomputed)]
        if self.parallel.world_size > 1:  # every rank recomputes what rank 0 chose
            dist.broadcast_object_list(names, src=0)
        remove_recompute(self.model)
        apply_recompute_plan(self.model, names[0])
        self.recompute_plan = plan
        if self.is_main:
            log.info("%s", plan.summary())

    def _autocast(self):
        return torch.autocast(
            self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )

    def _balance_batches(self) -> None:
        """Splits the global micro-batch between the ranks by speed (given or calibrated)."""
        balance, world = self.config.balance, self.parallel.world_size
        for name in ("speeds", "memory_limits"):
            value = getattr(balance, name)
            if value is not None and len(value) != world:
                raise ValueError(f"balance.{name} has {len(value)} entries; the run has {world} ranks")
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

    # ------------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {
            "data": self.batches.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "config": asdict(self.config),
            "skipped_steps": self.skipped_steps,
        }

    def save(self) -> None:
        """Checkpoints the current step (in the background when ``async_checkpoint``)."""
        self.position.phase = "checkpoint save"
        self.writer.save(
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            extra_state=self._extra_state(),
        )
        self.saved_step = self.step
        self._last_checkpoint_time = time.monotonic()

    def maybe_resume(self) -> dict | None:
        """Loads the checkpoint ``resume_from`` names (``latest``, ``latest-valid`` or a step) when
        ``resume`` is on and one exists; returns the config changes since that checkpoint (None
        for a fresh start). Checkpoints newer than the one loaded are set aside (renamed, kept:
        :meth:`_set_aside_newer`) so that the run saves those steps again itself. The config given
        now takes effect: optimizer hyperparameters and the LR schedule follow it, not the
        checkpoint's (``config_history.jsonl`` keeps both)."""
        if not self.config.resume:
            return None
        self.position.phase = "resume"
        if self.is_main:
            for path in remove_debris(self.checkpoint_dir):
                log.info("checkpoint: removed %s (left by an interrupted save or prune)", path)
        # rank 0's listing decides for every rank (a shared filesystem may show ranks different views)
        listed = [s for s, _ in list_checkpoints(self.checkpoint_dir)] if self.is_main else None
        steps = self._from_rank_0(listed)
        step = self._resume_step(steps)
        if step is None:
            return None
        try:
            loaded = load_checkpoint(
                self.checkpoint_dir,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                parallel=self.parallel,
                step=step,
                extra_state_rank=self.parallel.data_leader,  # a tensor-parallel group reads one stream
            )
        except CheckpointError as error:
            raise CheckpointError(f"{error}{self._intact_hint(step, steps)}") from None
        self.step = self.saved_step = loaded["step"]
        self._set_aside_newer(steps)
        extra = loaded["extra_state"]
        if loaded["extra_state_rank"] == self.parallel.data_leader:
            self.batches.load_state_dict(extra["data"])
        else:  # a rank the saved run did not have: a fresh stream, distinct from the others
            self.batches.reseed(self.config.seed, self.parallel.data_index, self.step)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        changes = config_changes(extra.get("config") or {}, json.loads(json.dumps(asdict(self.config))))
        changes.pop("resume_from", None)
        self._apply_optimizer_config()
        if self.is_main:
            log.info("resumed from step %d (%s)", self.step, loaded["path"])
            if changes:
                listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
                log.info("config changed since step %d, the new values apply: %s", self.step, listed)
        return changes

    def _from_rank_0(self, value):
        """Rank 0's ``value`` on every rank (one broadcast; rank 0 has decided when it returns)."""
        if self.parallel.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _set_aside_newer(self, steps: list[int]) -> None:
        """After resuming from step S: rank 0 renames the checkpoints newer than S to
        ``step_XXXXXXXX.rejected-<UTC time>`` (:func:`moetrain.checkpoint.set_aside_newer`: kept,
        never loaded, out of "latest" and of ``keep_last``'s count), so that this run saves steps
        S+1... itself; every rank waits for rank 0's outcome (one broadcast), one log line."""
        if not any(s > self.step for s in steps):
            return
        outcome = None
        if self.is_main:
            try:
                outcome = [path.name for path in set_aside_newer(self.checkpoint_dir, self.step)]
            except OSError as error:
                outcome = (
                    f"checkpoints newer than the resumed step {self.step} in {self.checkpoint_dir} could not "
                    f"be set aside: {error.strerror or error} ({error.filename}); move them away by hand"
                )
        outcome = self._from_rank_0(outcome)
        if isinstance(outcome, str):
            raise CheckpointError(outcome)
        if self.is_main and outcome:
            newer = ", ".join(str(s) for s in steps if s > self.step)
            log.warning(
                "resumed from step %d: the newer checkpoints (steps %s) are set aside as %s.%s in %s (kept, "
                "never loaded); this run saves those steps again", self.step, newer,
                "step_XXXXXXXX", outcome[0].split(".", 1)[1], self.checkpoint_dir,
            )  # fmt: skip

    def _resume_step(self, steps: list[int]) -> int | None:
        """The step to resume from (None: start fresh), by ``resume_from``, among the complete
        checkpoints ``steps`` (oldest first)."""
        choice = self.config.resume_from
        if choice == "latest":
            return steps[-1] if steps else None
        if choice == "latest-valid":
            for step in reversed(steps):
                try:
                    verify_checkpoint(checkpoint_path(self.checkpoint_dir, step), parallel=self.parallel)
                    return step
                except CheckpointError as error:
                    if self.is_main:
                        log.warning("checkpoint step %d is damaged, trying an older one: %s", step, error)
            if steps:
                raise CheckpointError(
                    f"no intact checkpoint in {self.checkpoint_dir} (steps {steps} are damaged)"
                )
            return None
        if choice not in steps:
            raise ValueError(
                f"resume_from = {choice}: no complete checkpoint of that step in {self.checkpoint_dir} "
                f"(complete: {steps})"
            )
        return choice

    def _intact_hint(self, failed_step: int, steps: list[int]) -> str:
        """``"; step S is intact: ..."`` naming the newest older checkpoint of ``steps`` that verifies."""
        for step in reversed([s for s in steps if s < failed_step]):
            try:
                verify_checkpoint(checkpoint_path(self.checkpoint_dir, step), parallel=self.parallel)
            except CheckpointError:
                continue
            return (
                f"; step {step} is intact: resume from it with --resume-from {step} "
                "(or --resume-from latest-valid)"
            )
        return "; no older checkpoint is intact"

    def _apply_optimizer_config(self) -> None:
        """After a resume: the configured lr, betas, eps and weight decay replace the checkpoint's,
        and the LR schedule restarts from the configured lr at the resumed step."""
        optim = self.config.optim
        decays = (optim.weight_decay, 0.0)  # the two groups of _build_optimizer
        for group, weight_decay in zip(self.optimizer.param_groups, decays, strict=True):
            group.update(betas=optim.betas, eps=optim.eps, weight_decay=weight_decay, initial_lr=optim.lr)
        self.scheduler.base_lrs = [optim.lr] * len(self.optimizer.param_groups)
        factor = lr_at(self.scheduler.last_epoch, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = optim.lr * factor

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------------------------------
    def _loss_share(self, targets) -> float:
        """This rank's loss weight ``w_r`` for one micro-step: ``W * n_r / N`` in sequences, or, when
        balancing a loss that averages over a varying number of units (``loss_fn.loss_units``,
        e.g. M6's target tokens), ``W * u_r / U`` with the units counted over all ranks (one
        scalar all-reduce), so the gradient is that of the mean over every unit of the global batch."""
        count_units = getattr(self.loss_fn, "loss_units", None)
        if self.balance is None or count_units is None or self.parallel.world_size == 1:
            return self.loss_weight
        mine = float(count_units(targets))
        total = torch.tensor([mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return self.parallel.world_size * mine / max(float(total.item()), 1.0)

    def _aux_loss_now(self) -> torch.Tensor:
        """The sum of the MoE layers' aux losses of the last forward, on the device (no sync)."""
        layers = [m.last_stats.aux_loss for m in self._moe_layers if m.last_stats is not None]
        return torch.stack(layers).float().sum() if layers else torch.zeros((), device=self.device)

    @property
    def _moe_layers(self) -> list[MoELayer]:
        return [m for m in self.model.modules() if isinstance(m, MoELayer)]

    def _micro_step(self, last: bool, loss_scale: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Forward and backward of one micro-batch: (loss, aux loss) as detached device scalars,
        and this rank's loss weight."""
        self.position.phase = "data loading"
        inputs, targets = to_device(self.batches.next(), self.device)
        accum = self.config.grad_accum
        share = self._loss_share(targets)
        weight = share / accum
        set_aux_loss_scale(self.model, loss_scale * self.loss_weight / accum)
        context = contextlib.nullcontext() if last else self.trained.no_sync()
        with context:
            self.position.phase = "forward"
            with self.phases.phase("forward"), self._autocast():
                output = self.trained(**inputs) if isinstance(inputs, dict) else self.trained(inputs)
            with self.trained.loss_context(output):  # loss_parallel() for vocabulary-sharded logits
                with self.phases.phase("forward"):
                    loss = self.loss_fn(output, targets)
                    scaled = loss * weight
                self.position.phase = "backward"
                with self.phases.phase("backward"):
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return local_tensor(loss.detach()).float(), self._aux_loss_now(), share

    def _pipeline_step(self, loss_scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of the ``grad_accum`` micro-batches through the pipeline schedule
        (:mod:`moetrain.pipeline`): each micro-batch's loss and aux losses scaled by
        ``loss_scale / grad_accum`` as in :meth:`_micro_step`. Returns the losses (the last stage's;
        a zero elsewhere) and this rank's stages' aux loss per micro-batch (mean)."""
        accum = self.config.grad_accum
        self.position.phase = "data loading"
        batches = [to_device(self.batches.next(), self.device) for _ in range(accum)]
        set_aux_loss_scale(self.model, loss_scale / accum)
        if self.scaler is not None:  # the schedule scales the losses by get_scale() itself; this
            self.scaler.scale(torch.ones((), device=self.device))  # creates the scaler's state for step()
        self.position.phase = "pipeline forward and backward"
        with self.phases.phase("pipeline"), self._autocast():
            losses, aux = self.trained.pipeline.step(batches, self.loss_fn, loss_scale / accum)
        zero = torch.zeros((), device=self.device)
        return losses or [zero], [aux / accum]

    def _is_logging_step(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.config.steps

    def train_step(self) -> dict | None:
        """One optimizer step. Returns the step's metrics on a logging step (every ``log_every``
        steps and the last), None otherwise: metric values stay on the device in between, so that
        no step but a logging one waits for a metric to reach the host.

        A step whose global gradient norm is not finite (inf / NaN anywhere, known on every rank
        from the all-reduced norm) is skipped on every rank: weights, optimizer state and LR
        schedule stay as they were (fp16 also lowers the loss scale). ``max_consecutive_skips``
        skipped steps in a row stop the run; with fp16, a skip whose losses were finite on every
        rank while the loss scale is still above 1 is the scaler's calibration (the scaled
        backward overflowed) and does not count toward that limit; a non-finite loss always
        counts (no loss scale made it)."""
        config = self.config
        start = time.perf_counter()
        loss_scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        self.optimizer.zero_grad(set_to_none=True)
        losses, auxes = [], []
        if self.trained.pipeline is not None:
            losses, auxes = self._pipeline_step(loss_scale)
        else:
            for micro in range(config.grad_accum):
                loss, aux, share = self._micro_step(micro == config.grad_accum - 1, loss_scale)
                losses.append(loss * share)
                auxes.append(aux)
        self.position.phase = "gradient sync"
        with self.phases.phase("grad_sync"):
            self.trained.reduce_gradients()
            # With fp16 the gradients are still multiplied by loss_scale: clip at the scaled threshold.
            if config.optim.grad_clip > 0:
                scaled_norm = float(self.trained.clip_grad_norm_(config.optim.grad_clip * loss_scale))
            else:
                scaled_norm = float(self.trained.grad_norm())
        grad_norm = scaled_norm / loss_scale
        self.position.phase = "optimizer step"
        skipped = not math.isfinite(scaled_norm)
        if skipped:
            self._skip_step(loss_scale, losses)
        else:
            self.consecutive_skips = 0
            with self.phases.phase("optimizer"):
                if self.scaler is None:
                    self.optimizer.step()
                else:
                    self.scaler.step(self.optimizer)  # every rank's gradients are finite: none skips
                    self.scaler.update()
        lr = self.optimizer.param_groups[0]["lr"]
        if not skipped:  # a skipped step does not advance the schedule (as in Megatron-LM)
            self.scheduler.step()
            self._update_score_biases()
        self.step += 1
        pipeline = self.trained.pipeline
        self._window.append(
            {
                "loss": torch.stack(losses).mean(),
                "aux": torch.stack(auxes).mean(),
                "tokens": (
                    self.batches.tokens_per_batch * config.grad_accum
                    if pipeline is None or pipeline.holds_last
                    else 0
                ),
                "seconds": time.perf_counter() - start,
            }
        )
        if not self._is_logging_step(self.step):
            return None
        self.position.phase = "metrics"
        return self._logged_metrics(lr, grad_norm, loss_scale, skipped)

    def _update_score_biases(self) -> None:
        """Aux-loss-free balancing: once per optimizer step, from the routed counts of its
        ``grad_accum`` micro-steps summed over every rank (the routers are replicated on all)."""
        update_score_biases(self.model, group=self.parallel.stage_group)

    def _skip_step(self, loss_scale: float, losses: list[torch.Tensor]) -> None:
        """Drops the gradients and the step's routed counts (aux-free balancing); counts the skip
        (not an fp16 calibration skip: finite losses on every rank, loss scale above 1); stops the
        run after too many in a row. A delayed offloaded update still in flight (``optim.overlap:
        delayed``) is written now, as the skipped step's ``step()`` would have written it."""
        self.optimizer.zero_grad(set_to_none=True)
        self._apply_pending_update()
        discard_routed_counts(self.model)
        self.skipped_steps += 1
        calibrating = self.scaler is not None and loss_scale > 1.0 and self._losses_finite(losses)
        if self.scaler is not None:
            self._back_off_loss_scale()
        if not calibrating:
            self.consecutive_skips += 1
        limit = self.config.max_consecutive_skips
        if self.consecutive_skips >= limit:
            raise NonFiniteGradientsError(
                f"step {self.step + 1}: {self.consecutive_skips} consecutive steps had non-finite gradients "
                f"(inf or NaN; max_consecutive_skips = {limit}); the weights are those of step "
                f"{self.step + 1 - self.consecutive_skips}: check the data and the learning rate"
            )
        if self.is_main:
            log.warning(
                "step %d skipped: non-finite gradient norm%s", self.step + 1,
                f" (fp16 loss scale {loss_scale:g} lowered)" if self.scaler is not None else "",
            )  # fmt: skip

    def _apply_pending_update(self) -> None:
        """Writes the delayed offloaded update in flight, if any, into the parameters."""
        apply_pending = getattr(self.optimizer, "apply_pending", None)
        if callable(apply_pending):
            apply_pending()

    def _losses_finite(self, losses: list[torch.Tensor]) -> bool:
        """Whether this step's losses were finite on every rank (one all-reduce; every rank calls it
        on the same skipped step, so all of them count it alike)."""
        finite = torch.stack(losses).isfinite().all().to(torch.float32).reshape(1)
        if dist.is_initialized() and self.parallel.world_size > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def _back_off_loss_scale(self) -> None:
        """Lowers the fp16 scale exactly as ``GradScaler.update`` does after an overflow (scale *
        backoff_factor, growth count reset)."""
        state = self.scaler.state_dict()
        state.update(scale=state["scale"] * state["backoff_factor"], _growth_tracker=0)
        self.scaler.load_state_dict(state)

    def _logged_metrics(self, lr: float, grad_norm: float, loss_scale: float, skipped: bool) -> dict:
        """The metrics of a logging step: loss, aux loss and tokens/s over the steps since the last
        logging step (global means, one all-reduce), this step's lr and gradient norm, and this
        step's expert load."""
        window, self._window = self._window, []
        world = self.parallel.world_size
        local = torch.stack(
            [torch.stack([w["loss"] for w in window]).mean(), torch.stack([w["aux"] for w in window]).mean()]
        )
        tokens = sum(w["tokens"] for w in window)
        seconds = sum(w["seconds"] for w in window)
        values = torch.cat(
            [
                local.double().to(self.device),
                torch.tensor([float(tokens)], dtype=torch.float64, device=self.device),
            ]
        )
        if world > 1:
            dist.all_reduce(values)
        weighted_loss, aux, tokens = values.tolist()
        replicas = world // self.parallel.pp_size  # pipeline stages: loss on the last, aux summed over all
        metrics = {
            "step": self.step,
            "loss": weighted_loss / replicas,
            "aux_loss": aux / replicas,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "skipped_steps": self.skipped_steps,
        }
        if self.scaler is not None:
            metrics.update(loss_scale=loss_scale, skipped=skipped)
        metrics["time/step_s"] = seconds / max(len(window), 1)
        metrics.update(self.phases.window_means(len(window)))
        host_update_s = getattr(self.optimizer, "last_update_s", None)
        if host_update_s is not None:
            metrics["time/optimizer_host_s"] = host_update_s
        if self.device.type == "cuda":
            metrics.update(self._peak_memory())
        result = self.writer.last_result
        if result is not None and result.step > self.step - len(window):
            metrics["checkpoint_stall_s"] = result.blocking_s
        return {**metrics, **self._data_metrics(), **self._expert_metrics()}

    def _peak_memory(self) -> dict:
        """The largest allocated and reserved CUDA memory of any rank since the last logging step
        (one MAX all-reduce), then the peaks are reset."""
        peaks = torch.tensor(
            [torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)],
            dtype=torch.float64, device=self.device,
        )  # fmt: skip
        if self.parallel.world_size > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated, reserved = peaks.tolist()
        return {"memory/peak_allocated_bytes": int(allocated), "memory/peak_reserved_bytes": int(reserved)}

    def _expert_metrics(self) -> dict:
        """Per MoE layer: coefficient of variation of the tokens routed to each expert, summed
        over the data-parallel ranks, and the global dropped-token fraction."""
        pipeline = self.trained.pipeline
        if pipeline is not None:
            return self._pipeline_expert_metrics(pipeline)
        stats = collect_moe_stats(self.model).layers
        if not stats:
            return {}
        routed = torch.stack([s.routed_per_expert for s in stats]).double()
        kept = torch.stack([s.kept_per_expert for s in stats]).double()
        if self.parallel.world_size > 1:
            both = torch.stack([routed, kept])
            dist.all_reduce(both)
            routed, kept = both[0], both[1]
        cv = (routed.std(dim=1, unbiased=False) / routed.mean(dim=1).clamp_min(1e-12)).tolist()
        dropped = (1 - kept.sum(1) / routed.sum(1).clamp_min(1)).tolist()
        metrics = {"expert_load_cv": cv, "dropped_fraction": dropped}
        layers = [m for m in self.model.modules() if isinstance(m, MoELayer)]
        biases = [m.router.score_bias_E for m in layers if m.router.score_bias_E is not None]
        if biases:  # the spread of each layer's aux-free score biases (identical on every rank)
            metrics["score_bias_range"] = [float(b.max() - b.min()) for b in biases]
        return metrics

    def _pipeline_expert_metrics(self, pipeline) -> dict:
        """:meth:`_expert_metrics` over pipeline stages: each stage fills the rows of its layers in
        the whole model's ``[layers, E]`` tables of routed and kept counts, and of aux-free score
        bias ranges (column 0: the range, column 1: 1 where this rank holds the layer's bias),
        summed over every rank in one all-reduce (plus one scalar for the widest ``E``) at logging
        steps only; a layer's range is the sum over the ranks holding it divided by their number
        (its bias is the same on each)."""
        names = pipeline.moe_layers
        if not names:
            return {}
        mine = {name: m for name, m in self.model.named_modules() if isinstance(m, MoELayer)}
        experts = next(iter(mine.values())).config.num_experts if mine else 0
        width = torch.tensor([float(experts)], device=self.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)  # a stage may hold no MoE layer
        experts = int(width.item())
        counts = torch.zeros(3, len(names), max(experts, 2), dtype=torch.float64, device=self.device)
        for row, name in enumerate(names):
            layer = mine.get(name)
            if layer is not None and layer.last_stats is not None:
                counts[0, row, :experts] = layer.last_stats.routed_per_expert.double().to(self.device)
                counts[1, row, :experts] = layer.last_stats.kept_per_expert.double().to(self.device)
            bias = None if layer is None else layer.router.score_bias_E
            if bias is not None:
                counts[2, row, 0] = float(bias.max() - bias.min())
                counts[2, row, 1] = 1.0
        dist.all_reduce(counts)
        routed, kept = counts[0, :, :experts], counts[1, :, :experts]
        cv = (routed.std(dim=1, unbiased=False) / routed.mean(dim=1).clamp_min(1e-12)).tolist()
        dropped = (1 - kept.sum(1) / routed.sum(1).clamp_min(1)).tolist()
        metrics = {"expert_load_cv": cv, "dropped_fraction": dropped}
        holders = counts[2, :, 1]
        if bool((holders > 0).all()):
            metrics["score_bias_range"] = (counts[2, :, 0] / holders).tolist()
        return metrics

    def _data_metrics(self) -> dict:
        """Bad records the data pipeline skipped so far on this rank (datasets that count them)."""
        count = getattr(self.batches, "skipped_records", None)
        return {} if count is None else {"skipped_records": count}

    def _report_skipped_records(self, when: str) -> None:
        summary = getattr(self.batches, "skip_summary", None)
        if self.is_main and summary is not None and self.batches.skipped_records:
            log.info("data (%s, rank 0): %s", when, summary())

    # ------------------------------------------------------------------------------------------
    def train(self, until: int | None = None) -> list[dict]:
        """Runs to ``config.steps`` (resuming first when a checkpoint exists), or only to step
        ``until`` (then checkpoints, as if interrupted); returns the metrics of every logging step
        run here. Checkpoints every ``checkpoint_every`` steps and every ``checkpoint_every_minutes``,
        at the end, and when SIGTERM arrives (then stops)."""
        config = self.config
        last_step = config.steps if until is None else min(until, config.steps)
        changes = self.maybe_resume()
        if self.is_main:
            record_config(self.out_dir, json.loads(json.dumps(asdict(config))), self.step, changes)
        self._report_skipped_records("start")
        run = RunInfo(
            self.out_dir, self.step, json.loads(json.dumps(asdict(config))), self.rank,
            config.metrics.project or self.out_dir.resolve().name,
        )  # fmt: skip
        metrics_log = MetricsLog(config.metrics.sinks, run)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        bar = ProgressBar(config.steps, "train", log_every=1, initial=self.step) if self.is_main else None
        history = []
        self._last_checkpoint_time = time.monotonic()
        try:
            while self.step < last_step:
                self.position.step = self.step + 1
                metrics = self.train_step()
                if metrics is not None:
                    history.append(metrics)
                    metrics_log.log(self.step, metrics)
                    if bar is not None:
                        load = (
                            {"load cv": max(metrics["expert_load_cv"])} if "expert_load_cv" in metrics else {}
                        )
                        bar.update(
                            self.step,
                            loss=metrics["loss"],
                            aux=metrics["aux_loss"],
                            **{"tok/s": int(metrics["tokens_per_s"])},
                            **load,
                        )
                self.position.phase = "checkpoint"
                stop, due, failed = self._agree_flags(
                    self.stop_requested, self._checkpoint_due(), self.writer.failed()
                )
                if failed:
                    self.writer.wait()  # raises the background save's error, on every rank
                if stop or due:
                    self.save()
                if stop:
                    self.writer.wait()
                    self.preempted = True
                    if self.is_main:
                        log.info("SIGTERM: checkpoint saved at step %d, stopping", self.step)
                    break
            else:
                if self.step == config.steps:  # finished (not stopped at ``until``): every update in
                    self._apply_pending_update()  # the final weights; a checkpoint keeps one pending
                self.writer.wait()
                if self.saved_step != self.step:
                    self.save()
                self.writer.wait()
            last = {k: v for k, v in history[-1].items() if k != "step"} if history else {}
            metrics_log.summary({**last, "last_step": self.step, "preempted": self.preempted})
        finally:
            signal.signal(signal.SIGTERM, previous)
            if bar is not None:
                bar.close()
            metrics_log.finish()
        self.position.phase = "shutdown"
        self._report_skipped_records("end")
        return history

    def _checkpoint_due(self) -> bool:
        """``checkpoint_every`` steps or ``checkpoint_every_minutes`` since the last save."""
        config = self.config
        if config.checkpoint_every and self.step % config.checkpoint_every == 0:
            return True
        minutes = config.checkpoint_every_minutes
        return bool(minutes) and time.monotonic() - self._last_checkpoint_time >= 60 * minutes

    def _agree_flags(self, *flags: bool) -> list[bool]:
        """Each flag True on every rank when it is True on any rank (one small all-reduce), so
        that all ranks checkpoint and stop together."""
        if self.parallel.world_size == 1:
            return list(flags)
        tensor = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [bool(v) for v in tensor.tolist()]

    def close(self) -> None:
        """Waits for a checkpoint still being written, then :meth:`release`."""
        try:
            self.writer.close()
        finally:
            self.release()

    def _stop_optimizer_worker(self) -> None:
        """Ends the delayed offloaded update's host thread, if any (``OffloadOptimizer.close``
        writes a pending update first; a checkpoint already recorded it)."""
        stop = getattr(getattr(self, "optimizer", None), "close", None)
        if not callable(stop):
            return
        try:
            stop()
        except Exception as error:  # noqa: BLE001 - releasing after a failure: report, go on
            log.error("optimizer: the delayed update's host thread failed: %s", error)

    def release(self) -> None:
        """After a failure: lets a checkpoint still being written finish (it holds a good state; its
        collectives end within ``dist_timeout_s`` if another rank is gone), stops the data loader's
        workers (batches with a ``close()``) and the watchdog and releases ``out_dir``. The process
        groups can then be destroyed safely. Safe on a trainer whose set-up stopped part-way."""
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception as error:  # noqa: BLE001 - the run has already failed; this is secondary
            log.error("checkpoint in flight when the run failed: %s", error)
        close_batches = getattr(self.batches, "close", None)
        if callable(close_batches):
            close_batches()
        self._stop_optimizer_worker()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = self.position.watchdog = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class NonFiniteGradientsError(RuntimeError):
    """Too many consecutive optimizer steps had inf / NaN gradients (``max_consecutive_skips``)."""


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
    """Validates the parallel layout against the model before anything is built: one-line
    ValueErrors naming the numbers."""
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


def world_size_from_env() -> int:
    from moetrain.parallel import read_launch_environment

    return read_launch_environment(os.environ).world_size
