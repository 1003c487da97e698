"""Automatic activation checkpointing ("recompute") under a memory budget.

:func:`auto_checkpoint` profiles one training step of a model, chooses which blocks to recompute in
the backward pass so that the activations saved for backward fit a byte budget at the least extra
forward time, and wraps those blocks with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Terms (one name each, everywhere):

- *candidate*: a module that may be recomputed. Default rule (:func:`default_candidates`): every
  child of an outermost ``nn.ModuleList`` (a *layer*), and each direct child of a layer that is a
  :class:`~moetrain.MoELayer` or an attention module (``nn.MultiheadAttention`` or a class whose
  name ends in ``Attention``). Candidates nest: a candidate inside another is its *sub-block*.
- *group*: a top-level candidate with all its sub-blocks. Within a group at most one of any
  candidate and its ancestors is recomputed, so a layer offers the *options*
  {none, attn, ffn, attn+ffn, whole layer}.
- *saved bytes*: the unique storages that autograd saves for backward during the forward
  (``saved_tensors_hooks``), storage ``nbytes``, parameters and buffers excluded.
- *kept bytes* of a recomputed block: what must survive until its backward, namely its inputs
  (the checkpoint boundary) plus, for every MoELayer inside it, the routing/all-to-all replay
  (``T*k*8 + (N_received + N_returned) * D * itemsize``, rows only under expert parallelism;
  see :func:`moe_replay_bytes`).

Memory model, for a set R of recomputed blocks (upper bound of the true union; exact when no
storage is shared between two groups)::

    activation_bytes(R) = outside + sum_g bytes(g, R)
    bytes(g, R) = |storages saved in g outside recomputed blocks  U  kept storages of R in g|

``outside`` is what is saved outside every candidate (embedding, final norm, head); storages
already counted there are free for the groups. Cost model: ``recompute_ms(R) = sum_{b in R}
forward_ms(b)``, the measured forward time of each block (median of ``timing_repeats`` forwards).

The choice is exact: a multiple-choice knapsack (one option per group, minimise time subject to
``activation_bytes <= budget``) solved by dynamic programming over the Pareto frontier of
(bytes, ms) pairs, which needs no discretisation of the byte axis (:func:`solve_recompute`).

MoE rule: a recomputed MoELayer must not re-route nor re-communicate, so every MoELayer inside a
recomputed block gets ``set_recompute_replay(True)``: its first forward records the routing decision
and the all-to-all outputs and the recompute replays them.

Several ranks (the engine's ``recompute_budget_mb``): each profiles its own batch, and every rank
plans on the element-wise maximum of all ranks' profiles (:func:`merge_profiles`), so that all
apply one plan that fits the budget on each of them.

Modules: ``results`` (the profile and plan dataclasses, :func:`merge_profiles`), ``candidates``
(what may be recomputed), ``recorders`` (the forward hooks that measure), ``profile`` (measuring a
model), ``solve`` (choosing under the budget), ``apply`` (wrapping modules, MoE replay on),
``auto`` (:func:`auto_checkpoint`).
"""

from moetrain.recompute.apply import (
    RecomputedForward,
    apply_recompute_plan,
    recomputed_modules,
    remove_recompute,
)
from moetrain.recompute.auto import auto_checkpoint
from moetrain.recompute.candidates import default_candidates
from moetrain.recompute.profile import measure_saved_bytes, profile_activations
from moetrain.recompute.recorders import StorageKey, moe_replay_bytes
from moetrain.recompute.recorders import (
    _MoEReplayRecorder as _MoEReplayRecorder,
)  # tests/distributed/test_node_dedup_dispatch.py
from moetrain.recompute.results import (
    ActivationProfile,
    BlockProfile,
    RecomputeOption,
    RecomputePlan,
    format_bytes,
    merge_profiles,
)
from moetrain.recompute.solve import plan_recompute, solve_recompute

__all__ = [
    "ActivationProfile",
    "BlockProfile",
    "RecomputeOption",
    "RecomputePlan",
    "RecomputedForward",
    "StorageKey",
    "apply_recompute_plan",
    "auto_checkpoint",
    "default_candidates",
    "format_bytes",
    "measure_saved_bytes",
    "merge_profiles",
    "moe_replay_bytes",
    "plan_recompute",
    "profile_activations",
    "recomputed_modules",
    "remove_recompute",
    "solve_recompute",
]
