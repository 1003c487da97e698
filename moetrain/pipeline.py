"""Pipeline stages (Whale's ``pipeline``): a model's layer stack cut into stages, run by a
``torch.distributed.pipelining`` schedule over the mesh's ``pp`` dimension.

The strategy marks the layer stack (an ``nn.ModuleList``, e.g. ``{"blocks": "pipeline"}``); with
``parallel.pp_size = p`` and ``pp_virtual = v`` it is cut into ``S = p * v`` stages of
consecutive layers (``pp_layers``: the first layer of each stage but the first; else the cut points
of the layers' ``scope.stage(i)`` marks, :func:`moetrain.scope.stage_boundaries`; otherwise
:func:`balance_layers` over each layer's active parameters). Rank ``r`` of a pipeline holds stages
``r, r + p, ...`` (one unless interleaved). The model must define the stage hook::

    model.pipeline_stage(layers: Sequence[int], first: bool, last: bool) -> None

which keeps only the given layers of its stack (by :func:`keep_layers`: parameter names unchanged),
its input modules when ``first`` and its output modules when ``last`` (the others become None),
after which ``forward`` maps the stage's input (the model's inputs on the first stage, else the
previous stage's output) to its output (the model's output on the last stage). Parameter names
staying those of the whole model, a checkpoint saved under ``pp = 2`` holds the same entries as one
saved under ``pp = 1`` and loads into either.

One optimizer step = one schedule ``step`` over the ``m = grad_accum`` micro-batches of this
rank's data stream (all stages of a pipeline draw the same stream; the first stage feeds the
inputs, the last the targets). The loss is ``loss_fn(output, target) * scale / m`` per
micro-batch (``scale_grads=False``) and the MoE aux losses ride on the same backward with the
scale the engine sets (``set_aux_loss_scale(model, scale / m)``), so the gradients are those of
the ``pp = 1`` run with ``grad_accum = m``. The bubble of GPipe and 1F1B is
``(p - 1) / (m + p - 1)`` of the step (:func:`bubble_fraction`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moetrain.layers.moe_layer import MoELayer
from moetrain.scope import stage_boundaries
from moetrain.tensor_split import tied_parameters

log = logging.getLogger(__name__)


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a pipeline step: ``(p - 1) / (v * m + p - 1)`` for ``p`` ranks,
    ``m`` micro-batches and ``v`` stages per rank (GPipe and 1F1B: ``v = 1``)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def stack_layers(stack) -> list[nn.Module]:
    """The layers of a stack, whole (``nn.ModuleList``) or kept by :func:`keep_layers`."""
    return list(stack.values()) if isinstance(stack, nn.ModuleDict) else list(stack)


def keep_layers(stack: nn.ModuleList | nn.ModuleDict, layers: Sequence[int]) -> nn.ModuleDict:
    """The ``layers`` of ``stack`` (whole, or already kept by this function) in a ``ModuleDict``
    keyed by their index: each keeps the name it had (``blocks.3.attn.q.weight`` stays that)."""
    if isinstance(stack, nn.ModuleDict):
        return nn.ModuleDict({str(i): stack[str(i)] for i in layers})
    return nn.ModuleDict({str(i): stack[i] for i in layers})


def active_parameters(layer: nn.Module) -> float:
    """Parameters a token passes through in ``layer``: an MoE layer's experts count ``k / E`` of
    their parameters (the compute per token, in multiply-adds)."""
    total = 0.0
    for module in layer.modules():
        if isinstance(module, MoELayer):
            share = module.config.top_k / module.config.num_experts
            total -= sum(p.numel() for p in module.experts.parameters()) * (1 - share)
    return total + sum(p.numel() for p in layer.parameters())


def _check_stage_count(stages: int, num_layers: int) -> None:
    if stages > num_layers:
        raise ValueError(
            f"parallel.pp_size * parallel.pp_virtual = {stages} stages must be <= model.num_layers = "
            f"{num_layers} (the layers of the pipelined stack, at least one per stage)"
        )


def balance_layers(costs: Sequence[float], stages: int) -> list[int]:
    """The first layer of each stage but the first, cutting ``costs`` (one per layer) into
    ``stages`` contiguous non-empty runs whose largest sum is smallest (dynamic programme, ties to
    the earlier cut)."""
    n = len(costs)
    _check_stage_count(stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][i]: first i layers in s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(stages, 1, -1):
        i = cut[s][i]
        bounds.append(i)
    return bounds[::-1]


def stage_layers(num_layers: int, stages: int, boundaries: Sequence[int]) -> list[range]:
    """Each stage's layer range from the first layer of every stage but the first."""
    _check_stage_count(stages, num_layers)
    edges = [0, *boundaries, num_layers]
    if len(edges) != stages + 1 or any(a >= b for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(
            f"parallel.pp_layers = {list(boundaries)} must be {stages - 1} increasing layer indices in "
            f"1..{num_layers - 1} (the first layer of each of the parallel.pp_size * parallel.pp_virtual = "
            f"{stages} stages but the first; model.num_layers = {num_layers})"
        )
    return [range(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def _check_hook(model: nn.Module) -> None:
    if not callable(getattr(model, "pipeline_stage", None)):
        raise ValueError(
            f"pp_size > 1: {type(model).__name__} has no pipeline_stage(layers, first, last) method, which "
            "keeps one stage's part of the model (see moetrain.pipeline)"
        )


def _chunk(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A shallow view of ``model`` holding one stage (the same parameter objects)."""
    chunk = copy.copy(model)
    for key, value in vars(model).items():  # its own submodule, parameter and hook tables
        if isinstance(value, dict):
            chunk.__dict__[key] = type(value)(value)
    chunk.pipeline_stage(list(layers), first, last)
    return chunk


def _check_tied(model: nn.Module, tied: list[list[str]], parallel) -> None:
    """After the cut: ValueError on every rank of the pipeline (one all-gather over ``pp_group``)
    when a parameter that several modules share (``tied``: the names of each, found before the
    cut) is now held under its names by more than one pipeline rank: each would train its own
    copy, with only its share of the gradient."""
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    mine = [[name for name in group if name in held] for group in tied]
    every: list = [None] * parallel.pp_size
    dist.all_gather_object(every, mine, group=parallel.pp_group)
    for i, group in enumerate(tied):
        ranks = [rank for rank, names in enumerate(every) if names[i]]
        if len(ranks) > 1:
            raise ValueError(
                f"parameters {', '.join(group)} are one tied tensor, which the stage cut puts on pipeline "
                f"ranks {ranks} (parallel.pp_size = {parallel.pp_size}), each training its own copy: untie "
                "them, or cut the stack so that one rank holds them (parallel.pp_layers), or set "
                "parallel.pp_size = 1"
            )


def split_stages(
    model: nn.Module, stack_name: str, parallel
) -> tuple[list[nn.Module], list[int], list[range]]:
    """Cuts ``model`` in place to this rank's stages: it keeps the union of their layers (and the
    input / output modules if it holds the first / last stage). Returns one module per stage this
    rank holds (``model`` itself when it holds one, else views sharing its parameters), their
    stage indices, and every stage's layer range. A tied parameter (e.g. a head sharing its
    embedding's matrix) whose names fall on different pipeline ranks is a ValueError."""
    _check_hook(model)
    config = parallel.config
    stages = parallel.pp_size * config.pp_virtual
    stack = model.get_submodule(stack_name)
    if not isinstance(stack, nn.ModuleList):
        raise ValueError(
            f"strategy: 'pipeline' applies to the layer stack (an nn.ModuleList), {stack_name!r} is a "
            f"{type(stack).__name__}"
        )
    layers = list(stack)
    boundaries = config.pp_layers
    marked = stage_boundaries(stack)
    if marked is not None and boundaries is None:
        if len(marked) + 1 != stages:
            raise ValueError(
                f"the scope.stage marks of {stack_name!r} cut it into {len(marked) + 1} stages, "
                f"pp_size * pp_virtual = {stages}: make them agree (or set parallel.pp_layers)"
            )
        boundaries = marked
        log.info("pipeline: %r cut at layers %s by its scope.stage marks", stack_name, marked)
    elif marked is not None and list(boundaries) != marked:
        log.info(
            "pipeline: parallel.pp_layers %s overrides the scope.stage cut points %s", boundaries, marked
        )
    if boundaries is None:
        boundaries = balance_layers([active_parameters(layer) for layer in layers], stages)
    ranges = stage_layers(len(layers), stages, boundaries)
    mine = list(range(parallel.pp_rank, stages, parallel.pp_size))
    union = [i for s in mine for i in ranges[s]]
    tied = tied_parameters(model)
    model.pipeline_stage(union, mine[0] == 0, mine[-1] == stages - 1)
    if tied:
        _check_tied(model, tied, parallel)
    if len(mine) == 1:
        return [model], mine, ranges
    chunks = [_chunk(model, ranges[s], s == 0, s == stages - 1) for s in mine]
    return chunks, mine, ranges


class _ScaledLoss:
    """The schedule's loss function: ``loss_fn(output, target) * scale``."""

    def __init__(self):
        self.loss_fn: Callable | None = None
        self.scale = 1.0

    def __call__(self, output, target):
        return self.loss_fn(output, target) * self.scale


class Pipeline:
    """This rank's stages and their schedule; :meth:`step` runs one optimizer step's forward and
    backward. ``chunks``: the stage modules (sharing ``model``'s parameters); ``stage_ids``: their
    global stage indices; ``ranges``: every stage's layers; ``moe_layers``: the names of every
    MoELayer of the whole model (the rows of the metrics summed over stages)."""

    def __init__(self, model, chunks, stage_ids, ranges, parallel, device, moe_layers=()):
        self.model, self.chunks, self.stage_ids, self.ranges = model, chunks, stage_ids, ranges
        self.moe_layers = list(moe_layers)
        self.parallel, self.device = parallel, torch.device(device)
        self.num_stages = len(ranges)
        self.holds_first = stage_ids[0] == 0
        self.holds_last = stage_ids[-1] == self.num_stages - 1
        self._loss = _ScaledLoss()
        self._schedule = None
        self._microbatches = None
        self._aux: list[torch.Tensor] = []
        self._probing: set[int] = set()
        self._input_keys: tuple[str, ...] | None = None  # during a step with dict inputs: their keys
        for chunk in chunks:
            chunk.register_forward_hook(self._record_aux)
        if self.holds_first:
            chunks[0].register_forward_pre_hook(self._keyword_inputs, with_kwargs=True)

    def _keyword_inputs(self, chunk, args, kwargs):
        """Before the first stage's forward: dict inputs, given to the schedule positionally in
        the order ``_input_keys`` (torch's schedules pass the step's keyword arguments to every
        stage of the rank, an interleaved rank's later stages too), back to keywords."""
        if self._input_keys is None:
            return None
        return (), {**dict(zip(self._input_keys, args, strict=True)), **kwargs}

    def _record_aux(self, chunk, args, output) -> None:
        """After each forward of a stage: its MoE aux losses. The first forward of a stage under a
        new schedule is torch's metadata inference (on the first micro-batch or on uninitialised
        tensors, before any real one): its aux losses are not counted and its routed counts are
        taken back from the routers (aux-free balancing sees only real micro-batches)."""
        layers = [m for m in chunk.modules() if isinstance(m, MoELayer) and m.last_stats is not None]
        if id(chunk) in self._probing:
            self._probing.discard(id(chunk))
            for layer in layers:
                if layer.router.load_E is not None:
                    layer.router.load_E -= layer.last_stats.routed_per_expert.to(layer.router.load_E)
            return
        if layers:
            self._aux.append(torch.stack([layer.last_stats.aux_loss for layer in layers]).float().sum())

    def _build(self, microbatches: int):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        group = self.parallel.pp_group
        stages = [
            PipelineStage(chunk, index, self.num_stages, self.device, group=group)
            for chunk, index in zip(self.chunks, self.stage_ids, strict=True)
        ]
        name = self.parallel.config.pp_schedule
        if name == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=self._loss, scale_grads=False)
        kind = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        return kind(stages[0], microbatches, loss_fn=self._loss, scale_grads=False)

    def step(self, batches: list, loss_fn: Callable, scale: float) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Forward and backward of the micro-batches ``batches`` (a list of ``(inputs, targets)``,
        inputs a tensor or a dict of keyword tensors, batch-major), each micro-batch's loss
        multiplied by ``scale`` before its backward. Returns the last stage's unscaled losses (empty
        elsewhere) and the sum of this rank's MoE aux losses over the micro-batches (a device
        scalar)."""
        count = len(batches)
        if self._schedule is None or self._microbatches != count:
            self._schedule, self._microbatches = self._build(count), count
            self._probing = {id(chunk) for chunk in self.chunks}
        self._loss.loss_fn, self._loss.scale = loss_fn, scale
        self._aux, losses = [], []
        args, target = (), None
        if self.holds_first:
            inputs = _concat([b[0] for b in batches])
            if isinstance(inputs, dict):
                self._input_keys, args = tuple(inputs), tuple(inputs.values())
            else:
                args = (inputs,)
        if self.holds_last:
            target = _concat([b[1] for b in batches])
        try:
            self._schedule.step(*args, target=target, losses=losses if self.holds_last else None)
        finally:
            self._input_keys = None
        aux = torch.stack(self._aux).sum() if self._aux else torch.zeros((), device=self.device)
        return [loss.detach().float() / scale for loss in losses], aux


def _concat(values: list):
    """Micro-batch inputs or targets joined along the batch dimension (tensors, or dicts of
    tensors)."""
    if isinstance(values[0], dict):
        return {key: torch.cat([v[key] for v in values]) for key in values[0]}
    return torch.cat(values)


__all__ = [
    "Pipeline",
    "active_parameters",
    "balance_layers",
    "bubble_fraction",
    "keep_layers",
    "split_stages",
    "stack_layers",
    "stage_layers",
]
