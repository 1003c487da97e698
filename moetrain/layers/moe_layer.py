"""MoELayer: a drop-in replacement for a transformer FFN, ``[..., d_model] -> [..., d_model]``.

Forward = route -> dispatch -> experts -> combine (legend: T tokens, D model dim, E experts,
K choices, N kept rows):

1. ``router``: fp32 ``logits_TE``, ``probs_TE``, top-k ``expert_ids_TK`` and ``gates_TK``.
2. ``dispatch``: capacity cut and counting-sort permutation into expert-ordered ``x_ND``.
3. ``experts``: one GEMM per expert over exactly its rows.
4. ``combine``: ``y_TD[t] = sum_j gates_TK[t, j] * y_ND[row(t, j)]`` (+ the shared expert).

The aux loss ``aux_loss_coef * load_balancing + z_loss_coef * z_loss`` is attached to the autograd
graph of the gates (which feed the output), so ``loss.backward()`` on anything computed from the
output trains the router without the model returning it; its value
and the routing statistics are in ``layer.last_stats`` (and summed over a model by
:func:`collect_moe_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moetrain.config import MoEConfig, config_from_dict
from moetrain.layers.dispatch import (
    AllToAllTokenDispatcher,
    DispatchPlan,
    LocalTokenDispatcher,
    compute_capacity,
)
from moetrain.layers.experts import DenseFFN, GroupedExperts
from moetrain.layers.losses import attach_aux_loss, load_balancing_loss, router_z_loss, sequence_balance_loss
from moetrain.layers.node_dispatch import NodeDedupTokenDispatcher
from moetrain.layers.precision import autocast_off, compute_dtype
from moetrain.layers.replay import ReplayedRoute, RoutingReplay, with_replay
from moetrain.layers.route import RouteStep
from moetrain.layers.router import RouterOutput, TopKRouter
from moetrain.validation import require_nonneg_float

INPUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class MoEStats:
    """Statistics of a layer's last forward. Tensors are detached; counts are per expert ``[E]``."""

    aux_loss: torch.Tensor
    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    routed_per_expert: torch.Tensor
    kept_per_expert: torch.Tensor
    capacity: int | None

    @property
    def dropped_fraction(self) -> float:
        """Share of the routed slots cut by the capacity (0 when dropless)."""
        routed = int(self.routed_per_expert.sum())
        return 0.0 if routed == 0 else 1.0 - int(self.kept_per_expert.sum()) / routed

    @property
    def token_share(self) -> torch.Tensor:
        """Share of the routed slots each expert was chosen for, ``[E]``, summing to 1."""
        counts = self.routed_per_expert.double()
        return counts / counts.sum().clamp_min(1)


@dataclass
class MoEModelStats:
    """Sum of the aux losses and the per-layer statistics of every MoELayer in a model."""

    aux_loss: torch.Tensor
    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    layers: list[MoEStats] = field(default_factory=list)

    @property
    def dropped_fraction(self) -> float:
        routed = sum(int(s.routed_per_expert.sum()) for s in self.layers)
        kept = sum(int(s.kept_per_expert.sum()) for s in self.layers)
        return 0.0 if routed == 0 else 1.0 - kept / routed


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN holding all ``num_experts`` experts. Build it from keyword options or
    a :class:`MoEConfig`::

    ffn = MoELayer(d_model=512, d_ff=2048, num_experts=8, top_k=2)
    y = ffn(x)  # x: [..., 512] -> y: [..., 512]

    Expert parallelism is applied afterwards (:func:`moetrain.parallelize` with ``expert``, or
    :func:`shard_experts`): the layer then keeps this rank's experts only.

    ``seed``: the experts' initialisation, expert ``g`` from a generator seeded ``seed + g``
    (:class:`~moetrain.layers.experts.GroupedExperts`), so a layer built on ``meta`` and
    materialised equals one built on the CPU. None: drawn from torch's global CPU generator (after
    the router's initialisation, which draws on the CPU and not on ``meta``: builds on both devices
    agree only with an explicit seed; the LM and M6 pass
    :func:`~moetrain.layers.experts.derive_seed` of the run seed and the layer's name).
    """

    def __init__(self, config: MoEConfig | None = None, *, seed: int | None = None, **options):
        super().__init__()
        if config is None:
            config = config_from_dict(MoEConfig, options)  # a misspelt option is a ValueError naming it
        elif options:
            raise ValueError(f"pass either a MoEConfig or keyword options, not both (got {sorted(options)})")
        self.config = config
        self.parallel = None
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(
            config.num_experts,
            config.d_model,
            config.d_ff,
            config.activation,
            0,
            seed,
            bias=config.expert_bias,
        )
        self.shared_expert = (
            DenseFFN(config.d_model, config.shared_expert_d_ff, config.activation)
            if config.shared_expert_d_ff
            else None
        )
        self.route = RouteStep(self.router, config)
        self.dispatcher = LocalTokenDispatcher(config.num_experts, config.kernels)
        self.replay = RoutingReplay()  # the records of recompute replay, used once it is on
        self.last_stats: MoEStats | None = None
        self.aux_loss_scale = 1.0

    def set_recompute_replay(self, enabled: bool) -> None:
        """For activation checkpointing: when enabled, each forward that builds a graph records its
        routing decision (experts, capacity cut and, under expert parallelism, the all-to-all
        results), and a forward re-run during backward (a recompute) replays the oldest record
        whose graph is still alive and whose input is the recomputed one (a layer called twice in
        a forward replays each call's): the same experts and received rows, no communication. Gates
        and expert outputs are recomputed as usual. A forward whose graph is dropped without
        backward leaves nothing behind (compiled: see :mod:`moetrain.layers.replay`). Backward
        passes of graphs that are alive at the same time must run in the order of their forwards.
        Calling this drops every record. Replay is two wrappers (:mod:`moetrain.layers.replay`),
        around the route step and around the dispatcher's exchanger; enabling installs them and
        disabling removes them."""
        self.replay.clear()
        self.route, self.dispatcher.exchanger = with_replay(
            self.route, self.dispatcher.exchanger, self.replay, bool(enabled)
        )

    @property
    def recompute_replay(self) -> bool:
        """Whether recompute replay is on (:meth:`set_recompute_replay`)."""
        return isinstance(self.route, ReplayedRoute)

    def replay_record_bytes(self) -> int:
        """Bytes held by the replay records of this layer's live graphs (0 without replay)."""
        return self.replay.nbytes()

    def comm_peak_bytes(self) -> int:
        """Bytes of all-to-all send and receive buffers the last forward or backward held at once
        (0 without expert parallelism): measured in the buffer pool when ``a2a_chunks`` chunks the
        exchange, modelled for the unchunked exchange (see ``docs/expert_parallel.md``)."""
        return self.dispatcher.comm_peak_bytes()

    def capacity(self, num_tokens: int) -> int | None:
        cfg = self.config
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        return compute_capacity(num_tokens, cfg.num_experts, cfg.top_k, factor, cfg.min_capacity)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``x_TD``; a ValueError naming the expected shape and dtypes otherwise."""
        d_model = self.config.d_model
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() < 1
            or x.shape[-1] != d_model
            or x.dtype not in INPUT_DTYPES
        ):
            got = f"{type(x).__name__}" if not isinstance(x, torch.Tensor) else f"{x.dtype} {tuple(x.shape)}"
            raise ValueError(
                f"MoELayer expects inputs [..., d_model={d_model}] of dtype float32, float64, bfloat16 or "
                f"float16, got {got}"
            )
        return x.reshape(-1, d_model)

    def forward(self, x: torch.Tensor, sequence_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., d_model]`` -> ``y [..., d_model]``: route (the router's decision and the
        dispatch plan) -> dispatch -> experts -> combine (the dispatcher) + the shared expert.
        ``sequence_lengths``: for tokens of several sequences flattened to ``x [T, d_model]`` in
        sequence-major order (e.g. the real tokens of padded samples), the integer ``[B]`` lengths of
        the sequences (summing to T); only the sequence-level balance loss uses them, which needs them
        or inputs ``[..., seq_len, d_model]`` (then ``seq_len = x.shape[-2]``)."""
        cfg = self.config
        x_TD = self._tokens(x)
        if sequence_lengths is not None:
            check_sequence_lengths(sequence_lengths, x_TD.shape[0])
        seq_len = x.shape[-2] if x.dim() >= 3 else None
        if cfg.seq_aux_loss_coef and seq_len is None and sequence_lengths is None:
            raise ValueError(
                f"seq_aux_loss_coef needs inputs [..., seq_len, d_model] or sequence_lengths (the balance "
                f"is per sequence), got shape {tuple(x.shape)}"
            )
        capacity = self.capacity(x_TD.shape[0])
        routing, plan = self.route(x_TD, capacity, self.training)
        # The aux loss rides on the gates (they feed the output, and under expert parallelism a
        # compiled graph ends at the exchange, so a tensor made before it must carry the loss).
        gates_TK = self._attach_losses(routing, plan, capacity, seq_len, sequence_lengths)
        dtype = compute_dtype(x)
        with autocast_off(x.device.type):
            y_TD = self.dispatcher.compute(x_TD.to(dtype), plan, gates_TK, self.experts)
            if self.shared_expert is not None:
                y_TD = y_TD + self.shared_expert(x_TD.to(dtype))
        return y_TD.view(*x.shape[:-1], cfg.d_model)

    def _attach_losses(
        self,
        routing: RouterOutput,
        plan: DispatchPlan,
        capacity: int | None,
        seq_len: int | None,
        sequence_lengths: torch.Tensor | None,
    ) -> torch.Tensor:
        """Records ``last_stats`` and returns ``routing.gates_TK`` carrying the aux loss: backward
        through them adds ``aux_loss_scale * aux_loss``'s gradient. The sequence-level loss takes
        the lengths ``sequence_lengths [B]`` when given, else sequences of ``seq_len`` tokens."""
        cfg = self.config
        expert_ids_TK = routing.expert_ids_TK
        zero = routing.probs_TE.new_zeros(())
        balance = load_balancing_loss(routing.probs_TE, expert_ids_TK) if cfg.aux_loss_coef else zero
        z_loss = router_z_loss(routing.logits_TE) if cfg.z_loss_coef else zero
        aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z_loss
        if cfg.seq_aux_loss_coef:
            aux_loss = aux_loss + cfg.seq_aux_loss_coef * sequence_balance_loss(
                routing.probs_TE,
                expert_ids_TK,
                seq_len if sequence_lengths is None else None,
                sequence_lengths,
            )
        self.last_stats = MoEStats(
            aux_loss=aux_loss.detach(),
            load_balancing_loss=balance.detach(),
            z_loss=z_loss.detach(),
            routed_per_expert=plan.routed_per_expert_E,
            kept_per_expert=plan.kept_per_expert_E,
            capacity=capacity,
        )
        if not (cfg.aux_loss_coef or cfg.z_loss_coef or cfg.seq_aux_loss_coef):
            return routing.gates_TK
        return attach_aux_loss(routing.gates_TK, aux_loss, self.aux_loss_scale)

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"d_model={cfg.d_model}, d_ff={cfg.d_ff}, num_experts={cfg.num_experts}, top_k={cfg.top_k}, "
            f"capacity_factor={cfg.capacity_factor}, num_prototypes={cfg.num_prototypes}, "
            f"activation={cfg.activation!r}"
        )


def check_sequence_lengths(lengths_B, tokens: int) -> None:
    """``MoELayer.forward``'s ``sequence_lengths``: a 1-D integer tensor; on the CPU (outside
    compiled code) also its values, each in ``[0, tokens]`` and summing to ``tokens`` (the bound
    keeps the int64 sum from wrapping around to ``tokens``; elsewhere the check would wait for the
    device, and lengths that break it give a meaningless loss, never an out-of-bounds access).
    Raises a one-line ``ValueError``."""
    is_tensor = isinstance(lengths_B, torch.Tensor)
    fits = (
        is_tensor
        and lengths_B.dim() == 1
        and not (lengths_B.is_floating_point() or lengths_B.is_complex() or lengths_B.dtype == torch.bool)
    )
    if fits and lengths_B.device.type == "cpu" and not torch.compiler.is_compiling():
        fits = bool(((lengths_B >= 0) & (lengths_B <= tokens)).all()) and int(lengths_B.sum()) == tokens
    if fits:
        return
    if not is_tensor:
        got = type(lengths_B).__name__
    elif lengths_B.device.type == "cpu" and lengths_B.numel() <= 16:
        got = f"{str(lengths_B.dtype).removeprefix('torch.')} {lengths_B.tolist()}"
    else:
        got = f"{str(lengths_B.dtype).removeprefix('torch.')} {tuple(lengths_B.shape)} on {lengths_B.device}"
    raise ValueError(f"sequence_lengths must be 1-D integers >= 0 summing to T = {tokens}, got {got}")


def shard_experts(layer: MoELayer, parallel, *, slices: dict | None = None) -> MoELayer:
    """Expert parallelism of one layer, in place: the layer keeps the global experts
    ``parallel.local_experts(E)`` (``[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)``) and
    exchanges tokens with its EP group (``AllToAllTokenDispatcher``, flat or hierarchical, or
    ``NodeDedupTokenDispatcher``, with ``parallel.config.comm_dtype`` on the wire); node-limited
    routing learns the nodes the experts are spread over (``parallel.ep_nodes``). On a real device
    the weights are copies of the full layer's slices (the full ones are freed); on ``meta`` the
    slice is a ``meta`` module initialised, once materialised, with the same per-global-expert
    seeds. ``slices``: one dict passed to the calls for all the layers of a model,
    ``{id(full experts module): its slice}``: layers sharing one experts module (weights tied
    across layers) then share one slice, cut once, as they shared the full module (None: this
    layer's experts are its own). Returns the layer."""
    if layer.parallel is not None or layer.experts.num_experts != layer.config.num_experts:
        raise ValueError("shard_experts: the layer's experts are already sharded")
    local = parallel.local_experts(layer.config.num_experts)
    # node-limited routing needs the node grid of the experts: the one place routing reads the layout
    layer.router.set_expert_nodes(parallel.ep_nodes)
    full = layer.experts
    sliced = None if slices is None else slices.get(id(full))
    if sliced is None:
        sliced = full.slice_experts(local.start, local.stop)
        if slices is not None:
            slices[id(full)] = sliced
    layer.experts = sliced
    layer.parallel = parallel
    if parallel.ep_size > 1:
        kind = NodeDedupTokenDispatcher if parallel.all_to_all == "node_dedup" else AllToAllTokenDispatcher
        exchanger = layer.dispatcher.exchanger  # with recompute replay's wrapper, when it is on
        layer.dispatcher = kind(layer.config.num_experts, parallel, layer.config.kernels, exchanger)
    return layer


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Sets the factor applied to the aux-loss gradient that every MoELayer injects into backward.

    The injected gradient is that of ``scale * aux_loss`` added to the loss. Use it when the loss
    you call ``backward()`` on is scaled: ``1 / accumulation_steps`` under gradient accumulation,
    ``1 / n`` when averaging n separate forward calls, or the fp16 loss scale. Default 1.
    """
    require_nonneg_float("scale", scale)
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_loss_scale = float(scale)


def update_score_biases(model: nn.Module, group=None) -> None:
    """Aux-loss-free balancing, once per optimizer step: sums every MoELayer's routed counts since
    the last call over the ranks of ``group`` (None: the default group, when torch.distributed is
    initialised; every rank that routes with a replica of the same routers must be in it), in one
    all-reduce for all layers, and moves each layer's score biases by
    ``rate * sign(mean load - load_e)``. Layers without ``score_bias_rate`` are skipped."""
    routers = [
        m.router for m in model.modules() if isinstance(m, MoELayer) and m.router.score_bias_E is not None
    ]
    if not routers:
        return
    loads = torch.stack([router.load_E for router in routers])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(loads, group=group)
    for router, load_E in zip(routers, loads, strict=True):
        router.update_score_bias(load_E)


def discard_routed_counts(model: nn.Module) -> None:
    """Drops the routed counts gathered since the last :func:`update_score_biases` (a skipped
    optimizer step: its routing leaves no trace, and the next update sees only its own step)."""
    for module in model.modules():
        if isinstance(module, MoELayer) and module.router.load_E is not None:
            module.router.load_E.zero_()


def collect_moe_stats(model: nn.Module) -> MoEModelStats:
    """Sums the aux losses of every MoELayer's last forward in ``model`` and lists their stats."""
    layers = [m.last_stats for m in model.modules() if isinstance(m, MoELayer) and m.last_stats is not None]
    zero = torch.zeros(())

    def total(name: str) -> torch.Tensor:
        return sum((getattr(s, name).cpu().float() for s in layers), zero)

    return MoEModelStats(total("aux_loss"), total("load_balancing_loss"), total("z_loss"), layers)
