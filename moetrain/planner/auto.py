"""``scope.auto()`` decided by the planner: replica or split for each unit, at ``parallelize`` time.

A model built under :func:`moetrain.scope.auto` leaves the choice to the system, as Whale's auto mode
does. :class:`AutoSplit` makes it the way ``moetrain plan --recommend`` does (:mod:`moetrain.planner.split`):
for the mesh's ``tp_size`` and the cluster described, each splittable unit inside the scope
(attention, dense FFN, vocabulary embedding, output head) is split when its split step time
(:func:`~moetrain.planner.split.unit_costs`) is below its replicated one, replicated otherwise;
everything else inside the scope is replicated. Each choice is logged with its two times. The run
does not import the planner: the caller builds the decision and hands it over::

    from moetrain.planner import cluster_preset
    from moetrain.planner.auto import AutoSplit

    auto = AutoSplit(cluster_preset("a100-80gb", nodes=1, gpus_per_node=4), describe_lm(config))
    trained = parallelize(model, mesh, auto=auto)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from moetrain.planner.hardware import ClusterSpec, cluster_preset
from moetrain.planner.model import ModelDescription
from moetrain.planner.plan import resolve_seq_len
from moetrain.planner.settings import PlanSettings
from moetrain.planner.split import split_units, unit_costs

log = logging.getLogger(__name__)


class AutoSplit:
    """The decision for ``scope.auto()`` modules: ``AutoSplit(cluster, model, settings)(module,
    parallel, names) -> {name: kind}``. ``cluster``: the machines (its world size must be the
    mesh's); ``model``: the planner's description of the model parallelized (its module names are
    the model's: ``describe_lm(config)``, a registry's ``describe`` hook); ``settings``: the batch
    and precision the costs are taken at (default :class:`PlanSettings`, ``seq_len`` the model's
    maximum), as for ``moetrain plan``."""

    def __init__(self, cluster: ClusterSpec, model: ModelDescription, settings: PlanSettings | None = None):
        self.cluster, self.model = cluster, model
        self.settings = resolve_seq_len(model, settings or PlanSettings())
        self.costs = []  # the last decision's UnitCosts

    def __call__(self, module: nn.Module, parallel, names: Sequence[str]) -> dict[str, str]:
        tp, world = parallel.tp_size, parallel.world_size
        if world != self.cluster.world_size:
            raise ValueError(
                f"scope.auto(): the cluster described has {self.cluster.world_size} GPUs "
                f"({self.cluster.nodes} x {self.cluster.gpus_per_node}), the mesh {world} ranks: describe "
                "the machines the model is parallelized over"
            )
        settings = self.settings
        flops_per_s = self.cluster.gpu.flops_for(settings.precision) * settings.compute_efficiency
        self.costs = unit_costs(split_units(self.model, settings), self.cluster, settings, tp, flops_per_s)
        known = {name for name, _ in module.named_modules()}
        wanted = set(names)
        chosen: dict[str, str] = {}
        for cost in self.costs:
            modules = cost.unit.modules
            missing = sorted(set(modules) - known)
            if missing:
                raise ValueError(
                    f"scope.auto(): the planner's unit {cost.unit.name!r} names modules the model does not "
                    f"have ({missing[:3]}): the description must be of this model"
                )
            if not set(modules) <= wanted:
                continue  # not (wholly) under scope.auto()
            kinds = modules if cost.split else dict.fromkeys(modules, "replica")
            chosen.update(kinds)
            split_ms = "-" if cost.split_s is None else f"{cost.split_s * 1e3:.3f} ms"
            log.info(
                "scope.auto(): %s %s at tp_size %d (replica %.3f ms, split %s per step)",
                cost.unit.name, "split" if cost.split else "replica", tp, cost.replica_s * 1e3, split_ms,
            )  # fmt: skip
        rest = [name for name in names if name not in chosen]
        if rest:
            log.info("scope.auto(): %d other auto-scoped module(s) replicated", len(rest))
        return chosen


__all__ = ["AutoSplit"]


class RunAutoSplit:
    """:class:`AutoSplit` for a run whose machines are known only once its process groups exist
    (``moetrain train`` with ``parallel.auto_gpu``): at ``parallelize`` time the cluster is
    ``cluster_preset(gpu, nodes=parallel.num_nodes, gpus_per_node=parallel.local_world_size)``, the
    run's own node layout, and the decision is :class:`AutoSplit`'s. ``last`` is that AutoSplit."""

    def __init__(self, gpu: str, model: ModelDescription, settings: PlanSettings | None = None):
        self.gpu, self.model, self.settings = gpu, model, settings
        self.last: AutoSplit | None = None

    def __call__(self, module: nn.Module, parallel, names: Sequence[str]) -> dict[str, str]:
        cluster = cluster_preset(self.gpu, nodes=parallel.num_nodes, gpus_per_node=parallel.local_world_size)
        self.last = AutoSplit(cluster, self.model, self.settings)
        return self.last(module, parallel, names)
