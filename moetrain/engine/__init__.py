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
   CPU-offloaded), LR schedule: linear warm-up then cosine decay toward ``min_lr_ratio * lr``
   (reached one step after the last).
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

The package, one job a module:

- :mod:`~moetrain.engine.setup`: building a run (device, process groups, out_dir lock, model and
  strategy, optimizer and LR schedule, checkpoint writer, balancing, recompute plan);
- :mod:`~moetrain.engine.step`: one optimizer step (forward, backward, gradient sync, clipping,
  optimizer step or skipped step);
- :mod:`~moetrain.engine.step_metrics`: the metrics of a logging step;
- :mod:`~moetrain.engine.loop`: the training loop, checkpoints and resuming;
- :mod:`~moetrain.engine.trainer`: the :class:`Trainer` made of those four parts, and its life cycle.
"""

from moetrain.engine.setup import (
    check_fits,
    lr_at,
    resolve_device,
    run_strategy,
    to_device,
    world_size_from_env,
)
from moetrain.engine.step import NonFiniteGradientsError
from moetrain.engine.trainer import Trainer

__all__ = [
    "NonFiniteGradientsError",
    "Trainer",
    "check_fits",
    "lr_at",
    "resolve_device",
    "run_strategy",
    "to_device",
    "world_size_from_env",
]
