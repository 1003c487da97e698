"""Pipeline stages in the planner (``PlanSettings.pp_size > 1``): the stage split, each pipeline
rank's memory with its activations in flight, the bubble and the point-to-point transfers.

Legend: ``p`` pipeline ranks, ``v`` stages per rank (``pp_virtual``), ``S = p * v`` stages,
``m = grad_accum`` micro-batches, ``r`` a pipeline rank (0 = the first).

- Stage split: the layers are cut into ``S`` contiguous runs whose largest forward FLOPs is
  smallest (:func:`moetrain.pipeline.balance_layers` over the planner's per-layer attention + FFN
  FLOPs, :mod:`moetrain.planner.activations`); the engine's split balances active parameters
  instead (the same up to attention's ``S^2`` term, which the planner counts).
- Activations in flight (:func:`in_flight`), in stage forwards whose saved activations are alive
  at the peak, following ``torch.distributed.pipelining``'s schedules:

  * GPipe: every forward before any backward: ``m``;
  * 1F1B: ``min(m, p - r)`` (rank 0's ``min(m, p)`` is the peak);
  * interleaved 1F1B: warm-up ``W_r = min((v - 1) * q + 2 * (p - 1 - r), v * m)`` forwards with
    ``q = m / max(1, m // p)`` micro-batches per round, then one forward before each backward:
    ``min(W_r + 1, v * m)`` stage forwards of ``1 / v`` of the rank's layers, on rank 0 with
    ``m`` a multiple of ``p``: ``v * p + p - 1``, i.e. ``p + (p - 1) / v`` micro-batches of the
    rank's layers.

  A rank's activation peak = in flight x its largest stage's activations of one micro-batch
  (its layers' saved bytes, the embeddings / image stem on stage 0, the head input and the loss
  on the last stage).
- Memory of rank ``r``: its layers' weights, gradients and optimizer states (plus the input
  modules on the first rank and the rest, head and final norm, on the last), the DDP buckets of
  its dense gradients, the activation peak and the largest working set of its layers (the loss's
  on the last rank); the plan reports the rank with the largest total.
- Time: each rank runs ``v * m + p - 1`` slots of one stage's forward and backward (``3 x``
  forward FLOPs of the slowest stage / v), so the idle share is the bubble
  ``(p - 1) / (v * m + p - 1)``; point-to-point: ``2 * v * m`` messages of one micro-batch's
  hidden states ``tokens * D * b`` per step (activations forward, gradients back), over NVLink
  when the neighbouring stage (``world / p`` ranks away) is on the same node, else over the node's
  share of the inter-node link; not overlapped (an upper bound, like the rest of the step time).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moetrain.pipeline import balance_layers, bubble_fraction, stage_layers

OUTPUT_TERMS = ("head_input", "loss")  # ActivationModel.outside terms of the last stage


def in_flight(schedule: str, stages: int, microbatches: int, virtual: int, rank: int) -> int:
    """Stage forwards whose activations rank ``rank`` holds at its peak (see the module docstring)."""
    p, m, v = stages, microbatches, virtual
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), v * m)
    return min(warmup + 1, v * m)


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank: its stages' layers, elements (dense, experts on this ep rank) and bytes."""

    rank: int
    layers: tuple[int, ...]
    dense: int
    experts: int
    weights: int
    gradients: int
    optimizer_states: int
    ddp_buckets: int
    activations: int
    working: int
    in_flight: int
    forward_flops: float

    @property
    def total(self) -> int:
        terms = (self.weights, self.gradients, self.optimizer_states, self.ddp_buckets)
        return sum(terms) + self.activations + self.working


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline part of a plan: ``ranges`` (every stage's layers), ``ranks`` (each pipeline
    rank's memory), ``largest`` (the rank with the largest total), bubble, transfers and time."""

    schedule: str
    stages: int
    virtual: int
    microbatches: int
    ranges: tuple[tuple[int, int], ...]
    ranks: tuple[RankMemory, ...]
    largest: int
    bubble: float
    p2p_bytes: int
    p2p_s: float
    compute_s: float
    bubble_s: float
    moe_layers: int

    @property
    def boundaries(self) -> list[int]:
        """The first layer of every stage but the first: ``parallel.pp_layers`` for a run that
        takes this split (balanced by the planner's per-layer FLOPs)."""
        return [start for start, _ in self.ranges[1:]]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ranks"] = [{**asdict(r), "total": r.total} for r in self.ranks]
        out["boundaries"] = self.boundaries
        return out


def plan_pipeline(
    model, acts, settings, cluster, working, loss_working, weight_b, optimizer_b, b, flops_per_s
) -> PipelinePlan:
    """The :class:`PipelinePlan` of ``settings`` (``pp_size > 1``) for ``model`` with activation
    model ``acts``; ``working``: each layer's working bytes, ``loss_working`` the loss's; bytes per
    element of weights / gradients (``weight_b``), optimizer states and activations (``b``)."""
    p, v, m = settings.pp_size, settings.pp_virtual, settings.grad_accum
    ep, world = settings.ep_size, cluster.world_size
    costs = [layer.attn_flops + layer.ffn_flops for layer in acts.layers]
    ranges = stage_layers(len(costs), p * v, balance_layers(costs, p * v))
    counts = model.layer_params
    params = model.params
    inputs = model.input_params
    rest_dense = params.dense - sum(c.dense for c in counts) - inputs
    first_terms = sum(value for key, value in acts.outside.items() if key not in OUTPUT_TERMS)
    last_terms = sum(acts.outside.get(key, 0) for key in OUTPUT_TERMS)
    ranks = []
    for r in range(p):
        mine = list(range(r, p * v, p))
        layers = tuple(i for s in mine for i in ranges[s])
        dense = sum(counts[i].dense for i in layers)
        dense += (inputs if r == 0 else 0) + (rest_dense if r == p - 1 else 0)
        experts = sum(counts[i].expert_per_rank(ep) for i in layers)
        chunk_bytes = []
        for s in mine:
            chunk = sum(acts.layers[i].saved_bytes for i in ranges[s])
            chunk += (first_terms if s == 0 else 0) + (last_terms if s == p * v - 1 else 0)
            chunk_bytes.append(chunk)
        flying = in_flight(settings.pp_schedule, p, m, v, r)
        work = max([working[i] for i in layers] + ([loss_working] if r == p - 1 else []))
        flops = sum(costs[i] for i in layers) + (acts.outside_flops if r == p - 1 else 0.0)
        ranks.append(
            RankMemory(
                rank=r, layers=layers, dense=dense, experts=experts,
                weights=(dense + experts) * weight_b, gradients=(dense + experts) * weight_b,
                optimizer_states=0 if settings.offload else (dense + experts) * optimizer_b,
                ddp_buckets=dense * weight_b if world > p else 0,
                activations=flying * max(chunk_bytes), working=work, in_flight=flying, forward_flops=flops,
            )
        )  # fmt: skip
    largest = max(ranks, key=lambda rank: rank.total).rank
    slowest = max(rank.forward_flops for rank in ranks)
    slot = 3 * slowest / v / flops_per_s  # one stage's forward and backward of one micro-batch
    hidden = acts.tokens * model.arch.d_model * b
    inter = world // p >= cluster.gpus_per_node
    node_share = cluster.inter_node_bandwidth / cluster.gpus_per_node  # every GPU of a node sends
    bandwidth = node_share if inter else cluster.intra_node_bandwidth
    latency = cluster.inter_node_latency if inter else cluster.intra_node_latency
    return PipelinePlan(
        schedule=settings.pp_schedule, stages=p, virtual=v, microbatches=m,
        ranges=tuple((rng.start, rng.stop) for rng in ranges), ranks=tuple(ranks), largest=largest,
        bubble=bubble_fraction(p, m, v), p2p_bytes=hidden,
        p2p_s=2 * v * m * (hidden / bandwidth + latency),
        compute_s=(v * m + p - 1) * slot, bubble_s=(p - 1) * slot,
        moe_layers=sum(1 for i in ranks[largest].layers if acts.layers[i].is_moe),
    )  # fmt: skip


__all__ = ["PipelinePlan", "RankMemory", "in_flight", "plan_pipeline"]
