"""The metrics of a logging step, as the engine makes them: loss, aux loss and tokens/s over the
steps since the last logging step (global means), learning rate, gradient norm, phase times, peak
CUDA memory, the data pipeline's skipped records, and per MoE layer the expert-load coefficient of
variation, the dropped-token fraction and the aux-free score-bias range (pipeline stages included).
Between logging steps the values stay on the device. Where they are written (``metrics.jsonl``,
TensorBoard, trackers) is :mod:`moetrain.metrics`.

:class:`StepMetrics` is one of the parts :class:`moetrain.engine.Trainer` is made of; it holds the
metrics methods and is not used alone.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moetrain.layers import MoELayer, collect_moe_stats

log = logging.getLogger(__name__)


class StepMetrics:
    """The metrics part of :class:`moetrain.engine.Trainer`: what a logging step reports."""

    _checkpoint_stall_s: float | None = None  # saves since the last logging step: seconds held

    def _is_logging_step(self, step: int) -> bool:
        """Every ``log_every`` steps, the last step (``steps``), and the step at which the run
        stops for SIGTERM (agreed by every rank: :meth:`TrainingLoop._step_flags`), so that the
        steps since the previous logging step are logged before the run stops."""
        if step % self.config.log_every == 0 or step == self.config.steps:
            return True
        stop, _, _ = self._step_flags()
        return stop

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
