"""One training step: ``grad_accum`` micro-steps of forward and backward, the gradient sync, the
clipping by the global norm, then the optimizer step, or, when that norm is not finite, the skipped
step (fp16: the loss scale lowered on every rank together).

:class:`TrainingStep` is one of the parts :class:`moetrain.engine.Trainer` is made of; it holds the
step's methods and is not used alone. The step's metrics are made by :mod:`moetrain.engine.step_metrics`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist

from moetrain.comm.timing import recording_exchanges
from moetrain.engine.setup import to_device
from moetrain.layers import MoELayer, discard_routed_counts, set_aux_loss_scale, update_score_biases
from moetrain.layers.experts import local_tensor

log = logging.getLogger(__name__)


class NonFiniteGradientsError(RuntimeError):
    """Too many consecutive optimizer steps had inf / NaN gradients (``max_consecutive_skips``)."""


class TrainingStep:
    """The step part of :class:`moetrain.engine.Trainer`: :meth:`train_step` and its stages."""

    @property
    def _count_units(self):
        """``loss_fn.loss_units`` (the units a loss averages over, e.g. M6's target tokens), or None."""
        return getattr(self.loss_fn, "loss_units", None)

    def _share_per_unit(self, units: float) -> float:
        """``D * m / U``: ``U`` the units of the step's ``m = grad_accum`` micro-batches on all
        ``D = data_count`` data streams, from this stream's ``units`` (one scalar all-reduce over
        the dense group, whose ranks read the ``D`` streams)."""
        total = units
        if self.parallel.data_count > 1:
            summed = torch.tensor([units], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed, group=self.parallel.dense_group)
            total = float(summed.item())
        return self.parallel.data_count * self.config.grad_accum / max(total, 1.0)

    def _micro_batches(self):
        """This step's ``grad_accum`` micro-batches (on the device), each with its loss share ``s``:
        its micro-step's backward scales its loss by ``s / grad_accum``, and the logged loss is the
        mean of ``loss * s`` over the micro-steps and the data streams.

        A loss that is a plain mean (no ``loss_fn.loss_units``): ``s = loss_weight`` (1, or
        ``W * n_r / N`` in sequences under ``balance.*``), each micro-batch drawn as its micro-step
        starts. A loss averaging over a varying number of units ``u_i`` per micro-batch: all are
        drawn first and ``s_i = D * m * u_i / U`` (:meth:`_share_per_unit`), so that the gradient
        the ranks average over the ``D`` streams, ``(1 / D) * sum_i (s_i / m) * grad(loss_i) =
        sum_i u_i * grad(loss_i) / U``, is that of the mean over every unit of the step, whatever
        its split into micro-batches and ranks (balanced or not)."""
        accum = self.config.grad_accum
        if self._count_units is None:
            for _ in range(accum):
                self.position.phase = "data loading"
                yield to_device(self.batches.next(), self.device), self.loss_weight
            return
        self.position.phase = "data loading"
        batches = [self.batches.next() for _ in range(accum)]
        units = [float(self._count_units(targets)) for _, targets in batches]  # on the host: no device sync
        per_unit = self._share_per_unit(sum(units))
        for batch, u in zip(batches, units, strict=True):
            yield to_device(batch, self.device), u * per_unit

    def _aux_loss_now(self) -> torch.Tensor:
        """The sum of the MoE layers' aux losses of the last forward, on the device (no sync)."""
        layers = [m.last_stats.aux_loss for m in self._moe_layers if m.last_stats is not None]
        return torch.stack(layers).float().sum() if layers else torch.zeros((), device=self.device)

    @property
    def _moe_layers(self) -> list[MoELayer]:
        return [m for m in self.model.modules() if isinstance(m, MoELayer)]

    def _micro_step(
        self, batch, share: float, last: bool, loss_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch ``(inputs, targets)``, its loss scaled by
        ``share / grad_accum`` (:meth:`_micro_batches`): (loss, aux loss) as detached device scalars."""
        inputs, targets = batch
        accum = self.config.grad_accum
        weight = share / accum
        set_aux_loss_scale(self.model, loss_scale * self.loss_weight / accum)
        context = contextlib.nullcontext() if last else self.trained.no_sync()
        with context:
            self.position.phase = "forward"
            with self.phases.phase("forward"), self._autocast():
                output = self.trained(**inputs) if isinstance(inputs, dict) else self.trained(inputs)
            self._count_routing(self._moe_layers)
            with self.trained.loss_context(output):  # loss_parallel() for vocabulary-sharded logits
                with self.phases.phase("forward"):
                    loss = self.loss_fn(output, targets)
                    scaled = loss * weight
                self.position.phase = "backward"
                with self.phases.phase("backward"):
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return local_tensor(loss.detach()).float(), self._aux_loss_now()

    def _pipeline_step(self, loss_scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of the ``grad_accum`` micro-batches through the pipeline schedule
        (:mod:`moetrain.pipeline`): each micro-batch's loss and aux losses scaled by
        ``loss_scale / grad_accum`` as in :meth:`_micro_step`, a loss with ``loss_fn.loss_units``
        also by its share ``s_i = u_i * D * m / U`` (:meth:`_micro_batches`). Returns the losses
        times their shares (the last stage's; a zero elsewhere) and this rank's stages' aux loss per
        micro-batch (mean)."""
        accum = self.config.grad_accum
        self.position.phase = "data loading"
        batches = [self.batches.next() for _ in range(accum)]
        loss_fn, count_units = self.loss_fn, self._count_units
        if count_units is not None:
            per_unit = self._share_per_unit(sum(float(count_units(targets)) for _, targets in batches))

            def loss_fn(output, targets):  # the schedule's micro-batch: its share from its own targets
                return self.loss_fn(output, targets) * (float(count_units(targets)) * per_unit)

        batches = [to_device(batch, self.device) for batch in batches]
        set_aux_loss_scale(self.model, loss_scale / accum)
        if self.scaler is not None:  # the schedule scales the losses by get_scale() itself; this
            self.scaler.scale(torch.ones((), device=self.device))  # creates the scaler's state for step()
        self.position.phase = "pipeline forward and backward"
        with self.phases.phase("pipeline"), self._autocast():
            losses, aux = self.trained.pipeline.step(batches, loss_fn, loss_scale / accum)
        self._count_stage_routing()
        zero = torch.zeros((), device=self.device)
        return losses or [zero], [aux / accum]

    def train_step(self) -> dict | None:
        """One optimizer step. Returns the step's metrics on a logging step (every ``log_every``
        steps, the last, and a step that saves a checkpoint), None otherwise: metric values stay on
        the device in between, so that no step but a logging one waits for a metric to reach the
        host.

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
        self._step_counts, self._stage_forwards = {}, {}
        with recording_exchanges(self.phases):  # time/all_to_all_s: inside forward and backward
            if self.trained.pipeline is not None:
                losses, auxes = self._pipeline_step(loss_scale)
            else:
                for micro, (batch, share) in enumerate(self._micro_batches()):
                    loss, aux = self._micro_step(batch, share, micro == config.grad_accum - 1, loss_scale)
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
            self.last_update_step = self.step + 1
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
        # each data stream's tokens counted once: by tp rank 0 of its group, on the last pipeline stage
        counts_tokens = self.parallel.tp_rank == 0 and (pipeline is None or pipeline.holds_last)
        self._window.append(
            {
                "loss": torch.stack(losses).mean(),
                "aux": torch.stack(auxes).mean(),
                "skipped": skipped,
                "tokens": self.batches.tokens_per_batch * config.grad_accum if counts_tokens else 0,
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
            in_a_row = self.step + 1 - self.last_update_step  # this one included
            calibrations = in_a_row - self.consecutive_skips
            excused = (
                f", {calibrations} of them fp16 loss-scale calibration, not counted" if calibrations else ""
            )
            raise NonFiniteGradientsError(
                f"step {self.step + 1}: {in_a_row} consecutive steps had non-finite gradients "
                f"(inf or NaN; max_consecutive_skips = {limit}{excused}); the weights are those of step "
                f"{self.last_update_step}: check the data and the learning rate"
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
