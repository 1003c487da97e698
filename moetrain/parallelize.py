"""``parallelize(model, mesh, strategy)``: Whale's parallel strategies applied to a plainly built model.

The model is written once, with no knowledge of the parallel layout (built on the CPU, a GPU or
``meta``); a *strategy* then says what to do with its parts. It maps module-name patterns
(``fnmatch`` on the names of ``model.named_modules()``: ``*`` also crosses dots) to a kind, in the
order given; each module takes the kind of the FIRST pattern that matches its name:

- ``replica``: data parallel (the default of every parameter no pattern claims): DDP, or with
  ``parallel.replica: fsdp`` FSDP2 ``fully_shard`` units (each outermost module a ``replica``
  pattern matches is one unit, the root another);
- ``expert``: expert parallelism of an :class:`~moetrain.MoELayer` (:func:`shard_experts`: this
  rank keeps ``E / ep_size`` experts, tokens travel by the flat or hierarchical all-to-all);
- ``split``: tensor parallelism over the mesh's ``tp`` ranks (``torch.distributed.tensor.parallel``):
  an ``nn.Linear`` by columns (its output stays sharded on the last dimension, as the next
  ``split.row`` layer wants it), an ``nn.Embedding`` by vocabulary rows (output all-reduced), a
  :class:`~moetrain.layers.experts.DenseFFN` whole (first matrix by columns, second by rows:
  Megatron's MLP, one all-reduce);
- ``split.row``: an ``nn.Linear`` by rows (input sharded on the last dimension, output all-reduced);
- ``split.head``: an output ``nn.Linear`` by columns whose output stays a vocabulary-sharded
  ``DTensor``: the loss is computed inside :meth:`Parallelized.loss_context`
  (``torch.distributed.tensor.parallel.loss_parallel()``), which never gathers the logits;
- ``pipeline``: the layer stack (an ``nn.ModuleList``) cut into ``pp_size`` stages over the mesh's
  ``pp`` dimension (:mod:`moetrain.pipeline`; nothing happens with ``pp_size`` 1): each rank keeps
  its stage's part of the model and :attr:`Parallelized.pipeline` runs the schedule.

The strategy can also be written in the model, as Whale does: :mod:`moetrain.scope` marks the modules
built under ``scope.split()``, ``scope.replica()``, ``scope.auto()``, ... and ``parallelize(model,
mesh)`` with no strategy applies :func:`~moetrain.scope.strategy_from_scopes` (exact module names);
a strategy given explicitly is applied as is (compose both with :func:`moetrain.scope.compose`).

Gradients (``Parallelized.reduce_gradients``, after the last micro-step's backward): replicated
parameters are averaged over the dense group (``dp * ep`` ranks) by DDP/FSDP; expert gradients are
summed over the expert-data-parallel group and divided by ``dp * ep`` (the data streams: tp ranks
share theirs); split parameters' local shards are averaged over the dense group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import REPLICA_MODES, STRATEGY_KINDS, validate_strategy
from moetrain.grad_sync import (
    DDP_COMM_HOOKS,
    GradReducer,
    clip_grad_norm_,
    global_grad_norm,
    is_dtensor,
    wrap_data_parallel,
)
from moetrain.layers.experts import DenseFFN
from moetrain.layers.moe_layer import MoELayer, shard_experts
from moetrain.parallel import ParallelContext
from moetrain.scope import has_marks, strategy_from_scopes
from moetrain.tensor_split import (
    SPLIT_KINDS,
    check_split,
    retie_parameters,
    split_dense_ffn,
    split_styles,
    tied_parameters,
)
from moetrain.validation import require_bool

log = logging.getLogger(__name__)

SPLITTABLE = {
    "split": (nn.Linear, nn.Embedding, DenseFFN),
    "split.row": (nn.Linear,),
    "split.head": (nn.Linear,),
}


@dataclass(frozen=True)
class Assignment:
    """Module ``name`` (``module``) takes ``kind`` from ``pattern``."""

    name: str
    module: nn.Module
    kind: str
    pattern: str


def resolve_strategy(
    model: nn.Module, strategy: dict[str, str], *, allow_unmatched: bool = False
) -> list[Assignment]:
    """The modules each pattern claims (first match wins, in the strategy's order), checked: a
    pattern matching no module, or only modules earlier patterns took (unless ``allow_unmatched``:
    a pipeline stage, checked whole before), or a kind on a module it cannot apply to, is a
    ValueError naming the pattern and the module (or the earlier pattern)."""
    strategy = validate_strategy("strategy", strategy)
    modules = [(name, module) for name, module in model.named_modules() if name]
    matched = dict.fromkeys(strategy, 0)
    assignments = []
    for name, module in modules:
        for pattern, kind in strategy.items():
            if fnmatchcase(name, pattern):
                matched[pattern] += 1
                assignments.append(Assignment(name, module, kind, pattern))
                break
    taken_by = {a.name: a.pattern for a in assignments}
    for pattern, count in matched.items():
        if count or allow_unmatched:
            continue
        shadows = list(dict.fromkeys(taken_by[name] for name, _ in modules if fnmatchcase(name, pattern)))
        if shadows:
            raise ValueError(
                f"strategy pattern {pattern!r} matches only modules that the earlier pattern"
                f"{'s' if len(shadows) > 1 else ''} {', '.join(map(repr, shadows))} already took (the first "
                f"match wins): put {pattern!r} first or remove it"
            )
        shown = ", ".join(name for name, _ in modules[:8]) + (", ..." if len(modules) > 8 else "")
        raise ValueError(
            f"strategy pattern {pattern!r} matches no module of {type(model).__name__} (modules: {shown})"
        )
    for a in assignments:
        if a.kind == "expert" and not isinstance(a.module, MoELayer):
            raise ValueError(
                f"strategy {a.pattern!r}: 'expert' applies to MoELayers, module {a.name!r} is a "
                f"{type(a.module).__name__}"
            )
        if a.kind == "pipeline" and not isinstance(a.module, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"strategy {a.pattern!r}: 'pipeline' applies to a layer stack (nn.ModuleList), module "
                f"{a.name!r} is a {type(a.module).__name__}"
            )
        if a.kind in SPLITTABLE and not isinstance(a.module, SPLITTABLE[a.kind]):
            allowed = " / ".join(t.__name__ for t in SPLITTABLE[a.kind])
            raise ValueError(
                f"strategy {a.pattern!r}: {a.kind!r} applies to {allowed}, module {a.name!r} is a "
                f"{type(a.module).__name__}"
            )
    return assignments


def default_strategy(model: nn.Module) -> dict[str, str]:
    """The strategy of a registered model without a ``strategy`` hook: the marks of a model built
    under :mod:`moetrain.scope` (:func:`~moetrain.scope.strategy_from_scopes` without a mesh: split
    marks stay, idle with ``tp_size`` 1); otherwise every MoELayer ``expert`` (by name), everything
    else replicated."""
    if has_marks(model):
        marked = strategy_from_scopes(model)
        if marked:
            return marked
    return _plain_default(model)


def _plain_default(model: nn.Module) -> dict[str, str]:
    names = [name for name, module in model.named_modules() if isinstance(module, MoELayer)]
    return {name or "*": "expert" for name in names} or {"*": "replica"}


class Parallelized:
    """What :func:`parallelize` returns: the model to call and how to train it.

    - ``model``: the parallelized model (its state dict holds DTensors for split or FSDP
      parameters and this rank's experts); ``module``: what to call (the DDP wrapper or the model);
    - :meth:`no_sync`: gradient accumulation without synchronisation (all micro-steps but the last);
    - :meth:`reduce_gradients`: after the last backward, the expert and split gradients' reduction;
    - :meth:`grad_norm` / :meth:`clip_grad_norm_`: the true global norm (each element once);
    - :meth:`loss_context`: ``loss_parallel()`` around loss and backward when the output is a
      sharded DTensor (``split.head``);
    - ``assignments``: which module took which kind; ``parallel``: the :class:`ParallelContext`;
    - ``pipeline``: with ``pp_size > 1``, the :class:`~moetrain.pipeline.Pipeline` whose ``step``
      replaces forward and backward (``model`` then holds this rank's stages only).
    """

    def __init__(self, model, module, parallel, assignments, replica, reducers, wrap=None, pipeline=None):
        self.model, self.module, self.parallel = model, module, parallel
        self.assignments, self.replica, self._reducers = assignments, replica, reducers
        self._wrap = wrap  # DDP waits for real parameters (a model parallelized on meta)
        self.pipeline = pipeline  # moetrain.pipeline.Pipeline with pp_size > 1, else None

    def materialize(self, device) -> Parallelized:
        """Allocates a model parallelized on ``meta`` on ``device`` and initialises it
        (:func:`materialize`), then wraps it in DDP (``replica: ddp``). Returns ``self``."""
        materialize(self.model, device)
        if self._wrap is not None:
            self.module, self._wrap = self._wrap(), None
        return self

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """A context in which backward accumulates gradients without synchronising them."""
        if self.replica == "fsdp" and hasattr(self.model, "set_requires_gradient_sync"):
            return _fsdp_no_sync(self.model)
        no_sync = getattr(self.module, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        """Expert gradients: sum over the expert-data-parallel group / (dp * ep); split parameters
        under DDP: average over the dense group. Call once per optimizer step, after the last
        backward (DDP / FSDP synchronised the rest during it)."""
        for reducer in self._reducers:
            reducer.reduce()

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self.model, self.parallel)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.model, max_norm, self.parallel)

    def loss_context(self, output=None):
        """``loss_parallel()`` when the strategy splits a head over tp > 1 ranks or ``output`` is a
        DTensor, else a null context. Enter it around the loss and its backward."""
        head_split = self.parallel.tp_size > 1 and any(a.kind == "split.head" for a in self.assignments)
        if head_split or is_dtensor(output):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for a in self.assignments:
            counts[a.kind] = counts.get(a.kind, 0) + 1
        kinds = (
            ", ".join(f"{kind} {counts[kind]}" for kind in STRATEGY_KINDS if kind in counts) or "replica only"
        )
        p = self.parallel
        stages = f"pp {p.pp_size} x " if p.pp_size > 1 else ""
        return (
            f"parallelize: {stages}dp {p.dp_size} x ep {p.ep_size} x tp {p.tp_size}, replica {self.replica}; "
            f"modules: {kinds}"
        )


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _dense_mesh(parallel: ParallelContext):
    """The mesh FSDP shards replicated parameters over: HSDP over ``("dp", "ep")`` (replicated over
    dp, sharded over ep) when both are > 1, else the one of them that is."""
    if parallel.dp_size > 1 and parallel.ep_size > 1:
        return parallel.submesh("dp", "ep")
    return parallel.submesh("ep" if parallel.ep_size > 1 else "dp")


def _apply_fsdp(model, parallel, assignments, experts, cpu_offload: bool) -> list[GradReducer]:
    """FSDP2 units: each sharded layer's experts over the expert-data-parallel ranks (gradients
    summed, divided by dp * ep), each outermost ``replica`` module and the root over the dense mesh.
    With dp = 1 the experts' units are on one rank: FSDP2 (torch 2.13) divides such a unit's
    gradients by its divide factor twice in fp64 and fp16, so they divide nothing and the
    returned reducer divides them by ``dp * ep`` after the backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, register_fsdp_forward_method

    # pinned host memory needs an accelerator; a CPU run (tests, gloo) offloads to pageable memory
    pinned = torch.accelerator.is_available()
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=pinned)} if cpu_offload else {}
    sum_only = dist.get_backend(parallel.dense_group) == "gloo"  # gloo has no PREMUL_SUM
    units = []  # (unit, its mesh's size)
    divided_later = []
    for module in {id(layer.experts): layer.experts for layer in experts}.values():  # shared ones once
        unit = fully_shard(module, mesh=parallel.submesh("dp"), **options)
        register_fsdp_forward_method(unit, "forward_rows")  # the chunked exchange's expert pass
        if parallel.dp_size > 1:
            unit.set_gradient_divide_factor(float(parallel.data_count))
        else:
            divided_later += list(unit.parameters())
        units.append((unit, parallel.dp_size))
    dense_mesh = _dense_mesh(parallel)
    replica_names = [a.name for a in assignments if a.kind == "replica"]
    # a pattern such as "*": "replica" also names the experts of an expert layer: they are its unit
    sharded_experts = {id(m) for layer in experts for m in layer.experts.modules()}
    shared_outside = _modules_sharing_parameters_outside(model)
    for a in assignments:
        outermost = not any(a.name.startswith(other + ".") for other in replica_names)
        if id(a.module) in sharded_experts or a.name in shared_outside:
            continue  # a module sharing a parameter with another (a tied embedding): the root's unit
        if a.kind == "replica" and outermost and any(True for _ in a.module.parameters()):
            units.append((fully_shard(a.module, mesh=dense_mesh, **options), parallel.data_count))
    units.append((fully_shard(model, mesh=dense_mesh, **options), parallel.data_count))
    if sum_only:
        for unit, size in units:
            # On a 1-rank mesh nothing is communicated, and forcing sums would divide twice (torch 2.13).
            unit.set_force_sum_reduction_for_comms(size > 1)
    if not divided_later or parallel.data_count == 1:
        return []
    return [GradReducer(divided_later, parallel.expert_dp_group, 1, parallel.data_count)]


def _modules_sharing_parameters_outside(model: nn.Module) -> set[str]:
    """Names of the modules holding a Parameter that something outside them holds too (an
    embedding tied to its head: ``embed`` and ``head``). FSDP2 manages a Parameter in one unit only,
    so such a module is left to an enclosing unit."""
    found = set()
    for group in tied_parameters(model):
        for name in group:
            parts = name.split(".")[:-1]
            for depth in range(1, len(parts) + 1):
                module = ".".join(parts[:depth])
                if any(not other.startswith(module + ".") for other in group):
                    found.add(module)
    return found


def parallelize(
    model: nn.Module,
    target,
    strategy: dict[str, str] | None = None,
    *,
    replica: str | None = None,
    cpu_offload: bool | None = None,
    comm_hook: str | None = None,
    find_unused_parameters: bool = False,
    auto=None,
) -> Parallelized:
    """Applies ``strategy`` (see the module docstring) to ``model`` in place over ``target``: a
    :class:`~moetrain.parallel.ParallelContext`, or a ``DeviceMesh`` with dimensions
    ``("dp", "ep", "tp")`` (wrapped by :meth:`ParallelContext.from_mesh`). ``strategy`` None: the
    model's :mod:`moetrain.scope` marks for this mesh (:func:`~moetrain.scope.strategy_from_scopes`)
    when it has any, else :func:`default_strategy`.
    ``replica``: ``"ddp"`` or ``"fsdp"`` (default: the context's ``config.replica``);
    ``cpu_offload``: FSDP2's CPU offload policy (default: ``config.fsdp_cpu_offload``);
    ``comm_hook``: DDP's gradient compression (None, ``"bf16"``, ``"fp16"``);
    ``find_unused_parameters``: DDP's option of that name (``replica: ddp``, no pipeline): True
    when a forward may leave a replicated parameter unused on some ranks (a branch one rank's batch
    skips), which DDP would otherwise wait for (expert, split and pipeline gradients need nothing:
    a rank's missing gradient joins their reduction as zeros);
    ``auto``: the decision for ``scope.auto()`` modules when ``tp_size > 1``
    (``moetrain.planner.auto.AutoSplit(cluster, description)``: the planner's replica-or-split choice
    per unit, logged).

    The model may be on ``meta``: experts are then sliced on ``meta`` too; materialise it
    afterwards with :func:`materialize`. Call it on every rank with the same arguments (it creates
    DTensors and DDP / FSDP state collectively)."""
    parallel = target if isinstance(target, ParallelContext) else ParallelContext.from_mesh(target)
    replica, cpu_offload = _replica_options(parallel, replica, cpu_offload, comm_hook)
    _check_find_unused(find_unused_parameters, replica, parallel)
    strategy = _chosen_strategy(model, parallel, strategy, auto)
    assignments = resolve_strategy(model, strategy)
    stages = None
    if parallel.pp_size > 1:
        stages = _split_pipeline_stages(model, assignments, parallel)
        assignments = resolve_strategy(model, strategy, allow_unmatched=True)
    experts = _shard_experts_and_splits(model, assignments, parallel)
    assignments = _current_modules(model, assignments)
    reducers, wrap = [], None
    module = model
    if parallel.mesh is not None:
        module, reducers, wrap = _replicate(
            model,
            parallel,
            assignments,
            experts,
            replica,
            cpu_offload,
            comm_hook,
            pipelined=stages is not None,
            find_unused_parameters=find_unused_parameters,
        )
    pipeline = None
    if stages is not None:
        from moetrain.pipeline import Pipeline

        chunks, stage_ids, ranges, moe_layers = stages
        device = next(model.parameters()).device
        pipeline = Pipeline(model, chunks, stage_ids, ranges, parallel, device, moe_layers)
    result = Parallelized(model, module, parallel, assignments, replica, reducers, wrap, pipeline)
    log.debug("%s", result.summary())
    return result


def _replica_options(
    parallel: ParallelContext, replica: str | None, cpu_offload: bool | None, comm_hook: str | None
) -> tuple[str, bool]:
    """``replica`` and ``cpu_offload`` of :func:`parallelize`, defaulted from the context's config
    and checked with ``comm_hook`` (DDP's: refused where no DDP runs, FSDP2 or a pipeline)."""
    replica = replica or parallel.config.replica
    if replica not in REPLICA_MODES:
        raise ValueError(f"replica must be one of {', '.join(map(repr, REPLICA_MODES))}, got {replica!r}")
    cpu_offload = parallel.config.fsdp_cpu_offload if cpu_offload is None else cpu_offload
    if cpu_offload and replica != "fsdp":
        raise ValueError("cpu_offload is FSDP2's offload policy: it needs replica = 'fsdp'")
    if comm_hook not in DDP_COMM_HOOKS:
        raise ValueError(
            f"comm_hook must be one of {', '.join(map(repr, DDP_COMM_HOOKS))}, got {comm_hook!r}"
        )
    if comm_hook is not None and replica == "fsdp":
        raise ValueError(
            f"comm_hook = {comm_hook!r} is DDP's gradient compression: replica = 'fsdp' has no DDP; use "
            "comm_hook=None or replica='ddp'"
        )
    if comm_hook is not None and parallel.pp_size > 1:
        raise ValueError(
            f"comm_hook = {comm_hook!r} is DDP's gradient compression: pp_size = {parallel.pp_size} "
            "averages the replicas without DDP; use comm_hook=None"
        )
    return replica, cpu_offload


def _check_find_unused(find_unused_parameters, replica: str, parallel: ParallelContext) -> None:
    """``find_unused_parameters`` of :func:`parallelize`: a bool, True only where DDP runs."""
    require_bool("find_unused_parameters", find_unused_parameters)
    if find_unused_parameters and (replica == "fsdp" or parallel.pp_size > 1):
        where = (
            "replica = 'fsdp' has no DDP"
            if replica == "fsdp"
            else f"pp_size = {parallel.pp_size} runs no DDP"
        )
        raise ValueError(
            f"find_unused_parameters = True is DDP's option: {where}; use find_unused_parameters=False"
        )


def _chosen_strategy(model: nn.Module, parallel: ParallelContext, strategy: dict[str, str] | None, auto):
    """The strategy given, else the model's scope marks for this mesh, else the plain default."""
    if strategy is None:
        marked = strategy_from_scopes(model, parallel, auto=auto) if has_marks(model) else {}
        if marked:
            log.debug("parallelize: the strategy of the model's scopes, %d module(s)", len(marked))
        return marked or _plain_default(model)
    if has_marks(model):
        log.debug("parallelize: the strategy given is applied as is, not the model's scope marks")
    return strategy


def _split_pipeline_stages(model: nn.Module, assignments, parallel: ParallelContext):
    """Cuts the strategy's one ``pipeline`` layer stack into this rank's stages (``pp_size > 1``);
    returns ``(chunks, stage_ids, ranges, moe_layers)``, ``moe_layers``: the MoE layers' names
    before the cut."""
    stacks = [a.name for a in assignments if a.kind == "pipeline"]
    if len(stacks) != 1:
        raise ValueError(
            f"pp_size = {parallel.pp_size} needs exactly one strategy entry 'pipeline' naming the layer "
            f"stack (e.g. {{'blocks': 'pipeline'}}), the strategy marks {stacks or 'none'}"
        )
    from moetrain.pipeline import split_stages

    moe_layers = [name for name, m in model.named_modules() if isinstance(m, MoELayer)]
    chunks, stage_ids, ranges = split_stages(model, stacks[0], parallel)
    return chunks, stage_ids, ranges, moe_layers


def _current_modules(model: nn.Module, assignments: list[Assignment]) -> list[Assignment]:
    """The assignments with the module each name holds now. Sharding replaces every MoE layer's
    experts by its slice (a copy on a real device): an assignment still holding the module it was
    resolved with would keep the full layer's experts alive beside the slice, on every rank."""
    return [dataclasses.replace(a, module=model.get_submodule(a.name)) for a in assignments]


def _shard_experts_and_splits(model: nn.Module, assignments, parallel: ParallelContext) -> list:
    """Checks the split modules against ``tp_size``, slices the experts over expert parallelism and
    applies tensor parallelism to the split modules; returns the expert layers."""
    tp = parallel.tp_size
    splits = [a for a in assignments if a.kind in SPLIT_KINDS]
    if splits and tp == 1 and parallel.world_size > 1:
        log.info("parallelize: tp_size 1, the %d split module(s) stay whole", len(splits))
    if tp > 1 and not splits:
        raise ValueError(
            f"tp_size = {tp} but the strategy splits no module: tensor-parallel ranks would repeat the same "
            "work; mark layers 'split' / 'split.row' / 'split.head' or use tp_size 1"
        )
    check_split(assignments, model, tp)

    experts = [a.module for a in assignments if a.kind == "expert"]
    slices = {}  # layers sharing one experts module share its slice
    for layer in experts:
        shard_experts(layer, parallel, slices=slices)
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and module.parallel is None and id(module.experts) in slices:
            raise ValueError(
                f"MoELayer {name!r} shares its experts with an 'expert' layer but is not one itself: "
                "its copy would train apart from the slices; mark every layer sharing them 'expert'"
            )
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = parallel.submesh("tp")
        tied = tied_parameters(model)  # split modules get their own DTensors: tie them again after
        styles = split_styles(splits)
        if styles:
            parallelize_module(model, tp_mesh, styles)
        for a in splits:
            if isinstance(a.module, DenseFFN):
                split_dense_ffn(a.module, tp_mesh)
        retie_parameters(model, tied, {a.name: a.kind for a in assignments})
    return experts


def _replicate(
    model, parallel, assignments, experts, replica, cpu_offload, comm_hook, *, pipelined: bool, **ddp_options
):
    """Data parallelism over the mesh: FSDP2 in place, or gradient reducers (experts, split params,
    and the replicated params of a pipeline) plus DDP, wrapped now or, for a model on ``meta`` or a
    pipeline, left to later (``ddp_options``: DDP's). Returns ``(module, reducers, wrap)``."""
    reducers, wrap = [], None
    module = model
    expert_params = list({id(p): p for layer in experts for p in layer.experts.parameters()}.values())
    if replica == "fsdp":
        return module, _apply_fsdp(model, parallel, assignments, experts, cpu_offload), wrap
    if expert_params:
        reducers.append(
            GradReducer(expert_params, parallel.expert_dp_group, parallel.expert_dp_size, parallel.data_count)
        )
    split_params = [p for p in model.parameters() if is_dtensor(p)]
    if split_params:
        reducers.append(
            GradReducer(split_params, parallel.dense_group, parallel.data_count, parallel.data_count)
        )
    if pipelined:  # the schedule runs the stages: replicas averaged after it, no DDP
        ignored = {id(p) for p in expert_params}
        replicated = [p for p in model.parameters() if id(p) not in ignored and p.requires_grad]
        reducers.append(
            GradReducer(replicated, parallel.dense_group, parallel.data_count, parallel.data_count)
        )

    def wrap():
        return wrap_data_parallel(model, parallel, comm_hook, ignore=expert_params, **ddp_options)

    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if pipelined:
        wrap = None
    elif not on_meta:
        module, wrap = wrap(), None
    return module, reducers, wrap


def materialize(model: nn.Module, device) -> nn.Module:
    """A model built (and parallelized) on ``meta``, allocated on ``device`` and initialised: every
    module's ``reset_parameters()`` runs, children before their parents (a model's own
    ``reset_parameters`` has the last word on its direct tensors: the LM's and M6's embeddings).
    Experts: each from its own per-global-expert seed, so they equal the CPU build's; other
    weights: their modules' initialisation, not the CPU build's values.

    A model only partly on ``meta`` (built within :func:`moetrain.layers.experts_on_meta`: the
    experts alone) keeps every tensor it has: only the modules with tensors of their own on
    ``meta`` are allocated on ``device`` and reset, so it equals the model built whole and
    sharded; a model with nothing on ``meta`` is left as it is. Returns the model."""
    tensors = [*model.parameters(), *model.buffers()]
    everything = bool(tensors) and all(t.device.type == "meta" for t in tensors)
    modules = list(model.modules())
    pending = modules if everything else [module for module in modules if _has_own_meta_tensors(module)]
    # Allocated in place: each parameter stays the object that parallelize's gradient reducers
    # (and anything else holding it) refer to; to_empty would otherwise make new ones.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        if everything:
            model.to_empty(device=device)
        else:
            for module in pending:
                module.to_empty(device=device, recurse=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with torch.no_grad():
        for module in reversed(pending):
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return model


def _has_own_meta_tensors(module: nn.Module) -> bool:
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.device.type == "meta" for t in own)


def to_device_but_meta(model: nn.Module, device) -> nn.Module:
    """``model.to(device)`` for every module but those with tensors of their own on ``meta`` (a
    model built within :func:`moetrain.layers.experts_on_meta`: its experts), which stay there for
    :func:`materialize`. Returns the model."""
    detached = []
    for name, module in list(model.named_modules()):
        if name and _has_own_meta_tensors(module):
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            detached.append((parent, attribute, module))
            setattr(parent, attribute, None)
    try:
        model.to(device)
    finally:
        for parent, attribute, module in reversed(detached):
            setattr(parent, attribute, module)
    return model


__all__ = [
    "Assignment",
    "Parallelized",
    "default_strategy",
    "materialize",
    "to_device_but_meta",
    "parallelize",
    "resolve_strategy",
    "strategy_from_scopes",
]
