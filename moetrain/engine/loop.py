"""The training loop: steps to ``config.steps`` (or ``until``), logging each logging step's
metrics and the progress bar, checkpointing every ``checkpoint_every`` steps or minutes, at the end
and when SIGTERM arrives (then stopping, every rank together); resuming from a checkpoint first
(``resume_from``: ``latest``, ``latest-valid`` or a step; newer checkpoints are set aside).

:class:`TrainingLoop` is one of the parts :class:`moetrain.engine.Trainer` is made of; it holds the
loop's methods and is not used alone.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from moetrain.checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    remove_debris,
    set_aside_newer,
    verify_checkpoint,
)
from moetrain.config import config_as_dict
from moetrain.engine.setup import lr_at
from moetrain.metrics import MetricsLog, RunInfo
from moetrain.progress import ProgressBar
from moetrain.run_dir import config_changes, record_config

log = logging.getLogger(__name__)


class TrainingLoop:
    """The loop part of :class:`moetrain.engine.Trainer`: :meth:`train`, checkpoints and resuming."""

    _agreed_flags: tuple[int, list[bool]] | None = None  # (step, :meth:`_step_flags`) once agreed

    def train(self, until: int | None = None) -> list[dict]:
        """Runs to ``config.steps`` (resuming first when a checkpoint exists), or only to step
        ``until`` (then checkpoints, as if interrupted); returns the metrics of every logging step
        run here. Checkpoints every ``checkpoint_every`` steps and every ``checkpoint_every_minutes``,
        at the end (at ``config.steps`` only with ``checkpoint_at_end``; always at ``until``), and
        when SIGTERM arrives (then stops). The summary goes to the sinks only when a step was
        trained here."""
        config = self.config
        last_step = config.steps if until is None else min(until, config.steps)
        changes = self.maybe_resume()
        if self.is_main:
            if changes is not None and self.step >= last_step:  # a finished run resubmitted: exits 0
                bound = f"steps = {config.steps}" if last_step == config.steps else f"until = {last_step}"
                log.warning(
                    "resumed at step %d, which is at or past %s: nothing to train; "
                    "raise steps or use another out_dir",
                    self.step,
                    bound,
                )
            record_config(self.out_dir, config_as_dict(config), self.step, changes)
        self._report_skipped_records("start")
        run = RunInfo(
            self.out_dir, self.step, json.loads(json.dumps(asdict(config))), self.rank,
            config.metrics.project or self.out_dir.resolve().name,
        )  # fmt: skip
        metrics_log = MetricsLog(config.metrics.sinks, run)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        bar = ProgressBar(config.steps, "train", log_every=1, initial=self.step) if self.is_main else None
        history, resumed_step = [], self.step
        self._last_checkpoint_time = time.monotonic()
        self._agreed_flags = None
        self._last_step = last_step  # saves a checkpoint: a logging step
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
                stop, due, failed, lost = self._step_flags()
                if lost:
                    self._stop_if_lock_lost()  # raises: another run owns out_dir
                if failed:
                    self.writer.wait()  # raises the background save's error, on every rank
                if stop or due:
                    if self.step == config.steps:  # the run's last checkpoint holds every update
                        self._apply_pending_update()
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
                if self.saved_step != self.step and (config.checkpoint_at_end or self.step != config.steps):
                    self.save()
                self.writer.wait()
            if self.step > resumed_step:  # nothing trained (a finished run resubmitted): the summary stays
                last = {k: v for k, v in history[-1].items() if k != "step"} if history else {}
                metrics_log.summary({**last, "last_step": self.step, "preempted": self.preempted})
        finally:
            self._last_step = None
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

    def _step_flags(self) -> list[bool]:
        """``[stop, due, failed, lost]`` after the current step: SIGTERM arrived, a checkpoint is due
        (:meth:`_checkpoint_due`), the background save failed, the lock's last look found ``out_dir``
        taken by another run (:meth:`RunLock.lost`, no file read); each the same on every rank
        (:meth:`_agree_flags`). Agreed once per step, by whichever asks first: the metrics, to log
        a step that saves a checkpoint (:meth:`_is_logging_step`), or the loop, after the step."""
        agreed = self._agreed_flags
        if agreed is None or agreed[0] != self.step:
            self.position.phase = "checkpoint"
            lost = self.lock is not None and self.lock.lost(look=False) is not None
            flags = self._agree_flags(self.stop_requested, self._checkpoint_due(), self.writer.failed(), lost)
            agreed = self._agreed_flags = (self.step, flags)
        return agreed[1]

    def _stop_if_lock_lost(self) -> None:
        """Raises ``RuntimeError`` on every rank (one small all-reduce) when rank 0 finds, reading the
        lock now, that another run has taken ``out_dir`` (this one was suspended past the lock's
        staleness) or the lock was deleted: writing on would mix two runs' checkpoints."""
        lost = self.lock.lost() if self.lock is not None else None
        if self._agree_flags(lost is not None)[0]:
            raise RuntimeError(
                (lost or f"out_dir {self.out_dir} was taken over by another run (rank 0 found its lock lost)")
                + f"; stopped at step {self.step} without writing a checkpoint"
            )

    def _agree_flags(self, *flags: bool) -> list[bool]:
        """Each flag True on every rank when it is True on any rank (one small all-reduce), so
        that all ranks checkpoint and stop together."""
        if self.parallel.world_size == 1:
            return list(flags)
        tensor = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [bool(v) for v in tensor.tolist()]

    # ------------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {
            "data": self.batches.state_dict(),
            "data_index": self.parallel.data_index,  # the stream that state belongs to
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "config": asdict(self.config),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,  # a streak goes on across a resume
            "last_update_step": self.last_update_step,
        }

    def save(self) -> None:
        """Checkpoints the current step (in the background when ``async_checkpoint``), unless another
        run has taken ``out_dir`` (:meth:`_stop_if_lock_lost`)."""
        self.position.phase = "checkpoint save"
        self._stop_if_lock_lost()
        self.writer.save(
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            extra_state=self._extra_state(),
        )
        self._record_checkpoint_stall()
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
                extra_state_rank=self.parallel.data_leader,  # one stream per tp group and pipeline
            )
        except CheckpointError as error:
            raise CheckpointError(f"{error}{self._intact_hint(step, steps)}") from None
        self.step = self.saved_step = loaded["step"]
        self._set_aside_newer(steps)
        extra = loaded["extra_state"]
        stream = self.parallel.data_index
        saved_stream = extra.get("data_index", stream)  # older checkpoints did not record it
        if loaded["extra_state_rank"] == self.parallel.data_leader and saved_stream == stream:
            self.batches.load_state_dict(extra["data"])
        else:  # a leader the saved run did not have, or whose saved rank read another stream (tp_size
            # or pp_size changed): a fresh stream, distinct from the others, the same on every stage
            self.batches.reseed(self.config.seed, stream, self.step)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.consecutive_skips = int(extra.get("consecutive_skips", 0))
        # older checkpoints did not record it: as if every skip since the last update counted
        self.last_update_step = int(extra.get("last_update_step", self.step - self.consecutive_skips))
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
