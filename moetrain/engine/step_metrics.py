"""The metrics of a logging step, as the engine makes them: loss, aux loss and tokens/s over the
steps since the last logging step (global means; loss and aux loss over the steps not skipped),
learning rate, gradient norm, phase times, peak CUDA memory, the data pipeline's skipped records,
and per MoE layer the expert-load coefficient of variation and the dropped-token fraction of the
step's ``grad_accum`` micro-batches, and the aux-free score-bias range (pipeline stages included).
Between logging steps the values stay on the device. Where they are written (``metrics.jsonl``,
TensorBoard, trackers) is :mod:`moetrain.metrics`.

:class:`StepMetrics` is one of the parts :class:`moetrain.engine.Trainer` is made of; it holds the
metrics methods and is not used alone.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moetrain.layers import MoELayer

log = logging.getLogger(__name__)


class StepMetrics:
    """The metrics part of :class:`moetrain.engine.Trainer`: what a logging step reports."""

    _checkpoint_stall_s: float | None = None  # saves since the last logging step: seconds held
    _last_step: int | None = None  # while :meth:`TrainingLoop.train` runs: the step it runs to
    # this step's routed and kept slots per expert: MoE layers -> [layers, 2, E] float64 sums
    _step_counts: dict[tuple[MoELayer, ...], torch.Tensor]
    # pipeline stages, during a step: a stage's MoE layers -> [layers, 2, E] of each of its forwards
    _stage_forwards: dict[tuple[MoELayer, ...], list[torch.Tensor]]

    def _is_logging_step(self, step: int) -> bool:
        """Every ``log_every`` steps, the last step (``steps``, or ``until``), and every step that
        saves a checkpoint: one due (``checkpoint_every``, ``checkpoint_every_minutes``) or the
        step at which the run stops for SIGTERM (agreed by every rank:
        :meth:`TrainingLoop._step_flags`). The window since the previous logging step is held in
        memory only, so a run resumed from a checkpoint writes the lines an uninterrupted run
        writes."""
        if step % self.config.log_every == 0 or step in (self.config.steps, self._last_step):
            return True
        stop, due, *_ = self._step_flags()
        return stop or due

    def _record_checkpoint_stall(self) -> None:
        """After ``writer.save()`` returned: adds the seconds it held the step (the writer's
        ``last_blocking``: staging when asynchronous, the whole save otherwise) to the next logging
        step's ``checkpoint_stall_s``. A save comes after its step's metrics, so it is reported on
        the next logging step, once; several saves between two logging steps are summed."""
        blocking = self.writer.last_blocking
        if blocking is not None:
            self._checkpoint_stall_s = (self._checkpoint_stall_s or 0.0) + blocking[1]

    def _logged_metrics(self, lr: float, grad_norm: float, loss_scale: float, skipped: bool) -> dict:
        """The metrics of a logging step: loss, aux loss and tokens/s over the steps since the last
        logging step (global means, one all-reduce), this step's lr and gradient norm, and this
        step's expert load. Loss and aux loss are over the steps that were not skipped (the same
        steps on every rank: a step is skipped on all or none), so that one inf or NaN loss does
        not hide the others; over the skipped ones when all were (an fp16 calibration skip has a
        finite loss; an inf or NaN one is written as null)."""
        window, self._window = self._window, []
        world = self.parallel.world_size
        averaged = [w for w in window if not w["skipped"]] or window
        local = torch.stack(
            [
                torch.stack([w["loss"] for w in averaged]).mean(),
                torch.stack([w["aux"] for w in averaged]).mean(),
            ]
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
        if self._checkpoint_stall_s is not None:
            metrics["checkpoint_stall_s"], self._checkpoint_stall_s = self._checkpoint_stall_s, None
        return {**metrics, **self._data_metrics(), **self._expert_metrics()}

    def _peak_memory(self) -> dict:
        """The largest allocated and reserved CUDA memory of any rank since the last logging step,
        overall and per phase (:meth:`PhaseTimer.window_peaks`; one MAX all-reduce)."""
        peaks = self.phases.window_peaks()
        values = torch.tensor(list(peaks.values()), dtype=torch.float64, device=self.device)
        if self.parallel.world_size > 1:  # every rank has the same keys, in the same order
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        overall = ("memory/peak_allocated_bytes", "memory/peak_reserved_bytes")
        reduced = zip(peaks, values.tolist(), strict=True)
        return {key: int(value) for key, value in reduced if value or key in overall}  # phases that ran

    @staticmethod
    def _routing_counts(layers) -> tuple[tuple[MoELayer, ...], torch.Tensor | None]:
        """The MoE ``layers`` that have run and the routed and kept slots per expert of their last
        forward, ``[layers, 2, E]`` float64 on the device (one stack, no sync); None when none ran."""
        ran = tuple(m for m in layers if m.last_stats is not None)
        if not ran:
            return ran, None
        slots = [c for m in ran for c in (m.last_stats.routed_per_expert, m.last_stats.kept_per_expert)]
        return ran, torch.stack(slots).double().view(len(ran), 2, -1)

    def _count_routing(self, layers) -> None:
        """Adds the routed and kept slots of ``layers``' last forward (one micro-batch) to this
        step's sums ``_step_counts`` (one add on the device, no sync)."""
        ran, counts = self._routing_counts(layers)
        if counts is not None:
            total = self._step_counts.get(ran)
            self._step_counts[ran] = counts if total is None else total + counts

    def _watch_stage_routing(self, pipeline) -> None:
        """Pipeline stages: the schedule runs the micro-batches inside one call, so a forward hook
        on each stage keeps the routing counts of its MoE layers after each forward (a recompute
        during backward runs inside a stage, not through its hook); :meth:`_count_stage_routing`
        sums them once the schedule returns."""

        def keep(chunk, args, output):
            ran, counts = self._routing_counts(m for m in chunk.modules() if isinstance(m, MoELayer))
            if counts is not None:
                self._stage_forwards.setdefault(ran, []).append(counts)

        for chunk in pipeline.chunks:
            chunk.register_forward_hook(keep)

    def _count_stage_routing(self) -> None:
        """After the schedule's step: each stage's last ``grad_accum`` forwards are the step's
        micro-batches (the first forward of a stage under a new schedule is torch's shape probe,
        :meth:`moetrain.pipeline.Pipeline._record_aux`); their counts become this step's sums."""
        forwards, self._stage_forwards = self._stage_forwards, {}
        for ran, counts in forwards.items():
            self._step_counts[ran] = torch.stack(counts[-self.config.grad_accum :]).sum(0)

    def _layer_counts(self) -> dict[MoELayer, torch.Tensor]:
        """This step's routed and kept slots per MoE layer (the layers this rank ran), ``[2, E]``
        float64 each: summed over the step's micro-batches."""
        return {m: c for ran, counts in self._step_counts.items() for m, c in zip(ran, counts, strict=True)}

    def _expert_metrics(self) -> dict:
        """Per MoE layer: coefficient of variation of the tokens routed to each expert and the
        dropped-token fraction, over this step's ``grad_accum`` micro-batches summed over all ranks."""
        pipeline = self.trained.pipeline
        if pipeline is not None:
            return self._pipeline_expert_metrics(pipeline)
        counts = list(self._layer_counts().values())
        if not counts:
            return {}
        routed = torch.stack([c[0] for c in counts])
        kept = torch.stack([c[1] for c in counts])
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
        the whole model's ``[layers, E]`` tables of routed and kept counts (this step's sums), and
        of aux-free score bias ranges (column 0: the range, column 1: 1 where this rank holds the
        layer's bias), summed over every rank in one all-reduce (plus one scalar for the widest
        ``E``) at logging steps only; a layer's range is the sum over the ranks holding it divided
        by their number (its bias is the same on each)."""
        names = pipeline.moe_layers
        if not names:
            return {}
        mine = {name: m for name, m in self.model.named_modules() if isinstance(m, MoELayer)}
        experts = next(iter(mine.values())).config.num_experts if mine else 0
        width = torch.tensor([float(experts)], device=self.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)  # a stage may hold no MoE layer
        experts = int(width.item())
        counts = torch.zeros(3, len(names), max(experts, 2), dtype=torch.float64, device=self.device)
        step_counts = self._layer_counts()
        for row, name in enumerate(names):
            layer = mine.get(name)
            if layer in step_counts:
                counts[:2, row, :experts] = step_counts[layer].to(self.device)
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
