"""Where ``split`` (tensor parallelism) pays off: per layer, replica against split on the alpha-beta model.

A *unit* is what the strategy splits together so that activations stay sharded between its layers
(legend: W weight elements of the unit, R rows (tokens) through it per sequence, D model width,
m sequences per rank per micro-step, t = tp_size, b activation bytes, w gradient bytes):

- attention (``q``, ``k``, ``v`` by columns, ``proj`` by rows): one all-reduce of ``m*R*D*b`` after
  ``proj`` (forward) and one at the q/k/v input (backward) per micro-step;
- a dense FFN (Megatron's MLP): the same two all-reduces;
- a vocabulary embedding (``split``): one all-reduce of its output, forward only;
- the output head (``split.head``) with the parallel cross-entropy: the backward all-reduce of its
  input's gradient ``m*R*D*b`` and three all-reduces of per-row statistics ``m*R*4`` (the
  logits' max, their sum of exponentials, the target logit), never the logits themselves.

Replica: the unit's gradient ``W*w`` is all-reduced over the dense group (the ``world / t`` ranks
with the same tp index), ``~2*(n-1)/n*W*w`` per rank. Split: its activations are all-reduced in
the tp group (consecutive ranks, inside a node) and only ``W*w/t`` crosses the dense group; its
FLOPs are divided by t. With the global batch fixed, a tp group of t ranks reads one data stream:
each rank runs ``m = t * micro_batch`` sequences per micro-step, so everything a strategy leaves
replicated (the MoE layers, the attention core outside split units, norms) is computed t times.

:func:`recommend_split` tries every ``tp_size`` dividing the GPUs of a node (and the world / ep)
and for each unit takes the cheaper of replica and split; the tp size with the least step time
(compute + the collectives above + the remaining gradient all-reduce) wins. Its strategy file
(``parallel`` sizes and ``strategy`` patterns) is what ``moetrain train --strategy`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from moetrain.layers.experts import DenseFFN
from moetrain.layers.moe_layer import MoELayer
from moetrain.planner.comm import all_reduce_traffic, group_layout
from moetrain.planner.hardware import ClusterSpec
from moetrain.planner.model import ModelDescription
from moetrain.planner.settings import ITEMSIZE, PlanSettings

HEAD_STATS = 3  # all-reduces of per-row fp32 statistics in the parallel cross-entropy


@dataclass(frozen=True)
class SplitUnit:
    """Layers split together: ``strategy`` (module-name patterns -> kinds) when split; ``weights``
    elements; per sequence and micro-step: ``rows`` through it, ``activation_elements`` all-reduced
    in the tp group, ``calls`` all-reduces (each ``activation_elements / calls``), ``stat_elements``
    fp32 statistics (head); ``flops`` of its forward; ``divides``: sizes it must split evenly."""

    name: str
    kind: str  # "attention", "ffn", "embedding", "head"
    strategy: dict[str, str]
    weights: int
    rows: int
    activation_elements: int
    calls: int
    flops: float
    divides: tuple[int, ...]
    stat_elements: int = 0

    @property
    def modules(self) -> dict[str, str]:
        """``{module name: kind}`` of every module the unit splits."""
        if self.kind == "attention":
            return {**{f"{self.name}.{p}": "split" for p in "qkv"}, f"{self.name}.proj": "split.row"}
        return dict(self.strategy)


def _weights(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _rows(model: ModelDescription, settings: PlanSettings) -> dict[str, int]:
    """Rows per sequence through the candidate modules: measured for a generic model; from the
    architecture otherwise (every token through the blocks; logits for every position of a
    language model, for the targets only with ``arch.targets_only``)."""
    arch = model.arch
    if arch.generic:
        return dict(arch.measured.module_rows)
    tokens = arch.image_tokens + settings.seq_len
    head = (settings.target_len or settings.seq_len) if arch.targets_only else settings.seq_len
    return {"__tokens__": tokens, "__text__": settings.seq_len, "__head__": head}


def split_units(model: ModelDescription, settings: PlanSettings) -> list[SplitUnit]:
    """The units of ``model`` a strategy could split (see the module docstring), found on the model
    built on ``meta``: attention modules (``q``, ``k``, ``v``, ``proj`` Linears and ``num_heads``),
    dense FFNs outside MoE layers (not SwiGLU), vocabulary embeddings not tied to the output, and
    the output head."""
    arch = model.arch
    meta = model.meta_model
    rows = _rows(model, settings)
    generic = arch.generic
    inside_moe = {
        name + "." for name, module in meta.named_modules() if isinstance(module, MoELayer)
    }  # fmt: skip

    def through(name: str, default_key: str) -> int:
        return int(rows.get(name, 0)) if generic else rows[default_key]

    units = []
    modules = dict(meta.named_modules())
    for name, module in meta.named_modules():
        if any(name.startswith(prefix) for prefix in inside_moe):
            continue
        children = [getattr(module, part, None) for part in ("q", "k", "v", "proj")]
        if all(isinstance(c, nn.Linear) for c in children) and isinstance(
            getattr(module, "num_heads", None), int
        ):
            r = through(name + ".q", "__tokens__")
            d = children[0].in_features
            weights = sum(_weights(c) for c in children)
            core = 4.0 * r * r * d  # scores and weighted values over the sequence
            units.append(
                SplitUnit(
                    name, "attention", {f"{name}.[qkv]": "split", f"{name}.proj": "split.row"}, weights, r,
                    2 * r * d, 2, 2.0 * weights * r + core, (module.num_heads,),
                )
            )  # fmt: skip
        elif isinstance(module, DenseFFN) and module.activation != "swiglu":
            r = int(rows.get(name, rows.get("__tokens__", 0)))
            d, hidden = module.w1_DF.shape
            units.append(
                SplitUnit(name, "ffn", {name: "split"}, _weights(module), r, 2 * r * d, 2,
                          2.0 * _weights(module) * r, (hidden,))
            )  # fmt: skip
        elif isinstance(module, nn.Embedding):
            if arch.tied_head and not generic and module.num_embeddings == arch.vocab_size:
                continue  # the output projection is this matrix
            r = through(name, "__text__")
            units.append(
                SplitUnit(name, "embedding", {name: "split"}, _weights(module), r,
                          r * module.embedding_dim, 1,
                          0.0, (module.num_embeddings,))
            )  # fmt: skip
    head_name = arch.measured.output_module if generic else ("head" if "head" in modules else None)
    head = modules.get(head_name) if head_name else None
    if isinstance(head, nn.Linear):
        r = through(head_name, "__head__")
        units.append(
            SplitUnit(head_name, "head", {head_name: "split.head"}, _weights(head), r,
                      r * head.in_features, 1,
                      2.0 * _weights(head) * r, (head.out_features,), HEAD_STATS * r)
        )  # fmt: skip
    return units


@dataclass(frozen=True)
class UnitCost:
    """One unit at one tp size: seconds per optimizer step kept replicated and split."""

    unit: SplitUnit
    replica_s: float
    split_s: float | None  # None: the unit cannot be split over this tp size

    @property
    def split(self) -> bool:
        return self.split_s is not None and self.split_s < self.replica_s

    def to_dict(self) -> dict:
        return {
            "unit": self.unit.name,
            "kind": self.unit.kind,
            "weights": self.unit.weights,
            "replica_s": self.replica_s,
            "split_s": self.split_s,
            "choice": "split" if self.split else "replica",
        }


@dataclass
class SplitRecommendation:
    """``tp_size`` and ``ep_size`` chosen, the ``strategy`` (module-name patterns -> kinds, MoE
    layers ``expert``), the step time of every tp size tried (``step_s``) and the per-unit costs
    at the chosen one (``units``)."""

    tp_size: int
    ep_size: int
    strategy: dict[str, str]
    step_s: dict[int, float] = field(default_factory=dict)
    units: list[UnitCost] = field(default_factory=list)

    def strategy_file(self) -> dict:
        """What ``moetrain train --strategy FILE`` reads."""
        return {
            "parallel": {"ep_size": self.ep_size, "tp_size": self.tp_size},
            "strategy": dict(self.strategy),
        }

    def to_dict(self) -> dict:
        return {
            **self.strategy_file(),
            "step_s_by_tp_size": {str(k): v for k, v in self.step_s.items()},
            "units": [u.to_dict() for u in self.units],
        }

    def format_table(self) -> str:
        lines = [
            f"strategy: tp_size {self.tp_size}, ep_size {self.ep_size} "
            f"(step time by tp_size: {', '.join(f'{k}: {v * 1e3:.2f} ms' for k, v in self.step_s.items())})",
            f"  {'unit':<24} {'weights':>12} {'replica ms':>11} {'split ms':>10}  choice",
        ]
        for u in self.units:
            split = "-" if u.split_s is None else f"{u.split_s * 1e3:.3f}"
            lines.append(
                f"  {u.unit.name:<24} {u.unit.weights:>12,} {u.replica_s * 1e3:>11.3f} {split:>10}  "
                f"{'split' if u.split else 'replica'}"
            )
        lines.append("  strategy file (moetrain train --strategy FILE): " + str(self.strategy_file()))
        return "\n".join(lines)


def _moe_strategy(model: ModelDescription) -> dict[str, str]:
    arch = model.arch
    return {arch.layer_module(i) + ("" if arch.generic else ".ffn"): "expert" for i in arch.moe_layers}


def _all_reduce_s(cluster: ClusterSpec, ranks: list[int], payload: float, calls: int) -> float:
    if payload <= 0 or calls <= 0:
        return 0.0
    bucket = payload / calls
    layout = group_layout(ranks, cluster.gpus_per_node)
    return all_reduce_traffic(cluster, "split", layout, payload, max(1, int(bucket))).seconds


def unit_costs(
    units: list[SplitUnit], cluster: ClusterSpec, settings: PlanSettings, tp: int, flops_per_s: float
) -> list[UnitCost]:
    """Each unit's replica and split seconds per optimizer step at ``tp`` (module docstring)."""
    world = cluster.world_size
    dense = list(range(0, world, tp))
    group = list(range(tp))
    sequences = settings.micro_batch * tp  # per rank and micro-step: one stream per tp group
    accum = settings.grad_accum
    b = ITEMSIZE[settings.precision]
    w = 4 if settings.autocast or settings.precision == "fp32" else b
    costs = []
    for unit in units:
        compute = accum * 3 * unit.flops * sequences / flops_per_s
        replica = compute + _all_reduce_s(cluster, dense, unit.weights * w, 1)
        split = None
        if tp > 1 and all(size % tp == 0 for size in unit.divides):
            activations = (
                accum
                * unit.calls
                * _all_reduce_s(cluster, group, unit.activation_elements * sequences * b / unit.calls, 1)
            )
            stats = (
                accum
                * HEAD_STATS
                * _all_reduce_s(cluster, group, unit.stat_elements * sequences * 4 / HEAD_STATS, 1)
            )
            split = (
                compute / tp + activations + stats + _all_reduce_s(cluster, dense, unit.weights * w / tp, 1)
            )
        costs.append(UnitCost(unit, replica, split))
    return costs


def recommend_split(
    model: ModelDescription,
    cluster: ClusterSpec,
    settings: PlanSettings,
    forward_flops_per_sequence: float,
    dense_elements: int,
    tp_sizes: list[int] | None = None,
) -> SplitRecommendation:
    """The tp size and per-unit choice with the least step time (see the module docstring):
    ``forward_flops_per_sequence`` of the whole model (the plan's), ``dense_elements`` its
    replicated parameters; ``settings.ep_size`` is kept where it still divides ``world / tp``
    (else its largest divisor that does)."""
    world = cluster.world_size
    flops_per_s = cluster.gpu.flops_for(settings.precision) * settings.compute_efficiency
    units = split_units(model, settings)
    unit_flops = sum(u.flops for u in units)
    unit_weights = sum(u.weights for u in units)
    w = 4 if settings.autocast or settings.precision == "fp32" else ITEMSIZE[settings.precision]
    if tp_sizes is None:
        tp_sizes = [t for t in range(1, cluster.gpus_per_node + 1) if cluster.gpus_per_node % t == 0]
    best = None
    step_s = {}
    for tp in tp_sizes:
        if world % tp:
            continue
        ep = max(
            d for d in range(1, settings.ep_size + 1) if settings.ep_size % d == 0 and (world // tp) % d == 0
        )
        costs = unit_costs(units, cluster, settings, tp, flops_per_s)
        if tp > 1 and not any(c.split for c in costs):
            continue  # tensor-parallel ranks with nothing split would only repeat each other's work
        sequences = settings.micro_batch * tp
        rest = (
            settings.grad_accum
            * 3
            * max(forward_flops_per_sequence - unit_flops, 0)
            * sequences
            / flops_per_s
        )
        rest += _all_reduce_s(
            cluster, list(range(0, world, tp)), max(dense_elements - unit_weights, 0) * w, 1
        )
        total = rest + sum(min(c.replica_s, c.split_s if c.split else c.replica_s) for c in costs)
        step_s[tp] = total
        if best is None or total < best[0]:
            best = (total, tp, ep, costs)
    _, tp, ep, costs = best
    strategy = _moe_strategy(model)
    for cost in costs:
        if tp > 1 and cost.split:
            strategy.update(cost.unit.strategy)
    return SplitRecommendation(tp, ep, strategy or {"*": "replica"}, step_s, costs)


def split_plan_terms(model: ModelDescription, settings: PlanSettings, cluster: ClusterSpec) -> dict:
    """What ``settings.strategy`` splits over ``settings.tp_size`` ranks, for :func:`make_plan`:
    ``elements`` (parameters of the split units, held ``1/tp`` per rank: weights, gradients and
    optimizer states), ``flops`` (their forward FLOPs per sequence, ``1/tp`` per rank) and the tp
    group's activation all-reduces per optimizer step (``intra_bytes``, ``inter_bytes``,
    ``messages``, ``seconds``, ``calls``). A unit counts when the strategy gives every one of its
    modules the kind its split needs."""
    from moetrain.parallelize import resolve_strategy

    tp = settings.tp_size
    kinds = {}
    if tp > 1:
        assignments = resolve_strategy(model.meta_model, settings.strategy)
        kinds = {a.name: a.kind for a in assignments}
    chosen = [u for u in split_units(model, settings) if all(kinds.get(k) == v for k, v in u.modules.items())]
    sequences = settings.micro_batch
    b = ITEMSIZE[settings.precision]
    terms = {"elements": 0, "flops": 0.0, "intra_bytes": 0.0, "inter_bytes": 0.0, "messages": 0,
             "seconds": 0.0, "calls": 0, "units": [u.name for u in chosen]}  # fmt: skip
    if tp == 1:
        return terms
    layout = group_layout(list(range(tp)), cluster.gpus_per_node)
    for unit in chosen:
        terms["elements"] += unit.weights
        terms["flops"] += unit.flops
        for payload, calls in (
            (unit.activation_elements * sequences * b / unit.calls, unit.calls),
            (unit.stat_elements * sequences * 4 / HEAD_STATS, HEAD_STATS if unit.stat_elements else 0),
        ):
            if payload <= 0 or calls == 0:
                continue
            count = calls * settings.grad_accum
            t = all_reduce_traffic(cluster, "tp_all_reduce", layout, payload, max(1, int(payload)))
            terms["intra_bytes"] += count * t.intra_bytes
            terms["inter_bytes"] += count * t.inter_bytes
            terms["messages"] += count * (t.intra_messages + t.inter_messages)
            terms["seconds"] += count * t.seconds
            terms["calls"] += count * t.calls
    return terms
