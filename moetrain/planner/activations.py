"""Analytic activation memory (bytes saved for backward) and forward FLOPs, per layer.

Legend: B sequences per rank, S tokens per sequence (image patches + text), T = B*S tokens
routed per rank, D model dim, H heads, F expert (or dense FFN) hidden size, E experts, El = E/ep
local experts, k choices per token, V vocabulary, b bytes per element of the compute dtype,
N_s rows a rank dispatches (sends), N_r rows its experts compute (receives), pad_m(x) = x
rounded up to a multiple of m.

What the formulas count is what :func:`moetrain.recompute.measure_saved_bytes` measures: the
unique storages autograd saves during the forward (parameters excluded), plus two things that
live with the graph outside autograd's saved tensors and that the tests count separately: the
dispatch index tensors of each MoE layer (``DispatchPlan``) and, for recomputed MoE layers, the
routing replay record. They were derived op by op from the saved tensors of the real modules
(``tests/unit/planner/test_planner_validation.py`` checks them against measurement on CPU):

per layer, outside its sub-blocks ("norms")
    2 x (T*D*b norm input + 2*T*s statistics)         s = 4 on CUDA (fp32 mean/rstd), b on CPU
    + 2 x T*D*m residual dropout masks (dropout > 0)  m = 1 on CUDA (bool), b on CPU
attention (``blocks.i.attn``)
    T*D*b qkv input + 3*T*D*b q,k,v + T*D*b output    (flash / memory-efficient kernels: the
    + B*H*pad(S)*4 logsumexp                           output layout makes the projection's input
    + B*S*pad(S)*b float mask (``attention_mask``)     a view, no copy); pad: 32/16 on CUDA, 1 CPU
MoE FFN (``blocks.i.ffn``), router in fp32
    T*D*4 router input (the FFN input itself when b = 4) [+ E*D*4 fp32 weight copy when b < 4]
    [+ T*D*4 router jitter noise] + T*E*4 probabilities [+ T*E*4 + T*4 z-loss]
    + T*k*(8 + 4) expert ids and gathered gates [+ 2*T*4 + T*k*4 gate normalisation, k > 1]
    [+ 2*T*4 + E*4 + 4 load-balancing loss]
    + N_r*D*b expert input + N_r*F*b*(2 gelu/relu | 4 swiglu, of which 2 on 2F) hidden
    + N_s*D*b returned rows kept by the combine [+ shared expert: T*D*b (b < 4) + T*Fs*b*(2|4)]
dense FFN: T*D*b + T*F*b*(2 | 4).
dispatch index (per MoE layer, outside autograd): T*k*8 + N_s*8 + 2*E*8 [+ E*8 under EP].
outside the layers: the architecture's ``outside`` hook (what its inputs, an image stem and its
    final norm save; the M6 example's are in ``m6_moe.planning``), by default a decoder LM's: token
    ids (int64, T*8) and the final norm over every token; then the head input T_loss*D*b and the
    loss: T_loss*V*4 fp32 log-softmax + T_loss*8 targets (T_loss = T, or the targets' tokens when
    ``targets_only``).

Recompute options per layer (as :func:`moetrain.recompute.default_candidates` makes them): a
recomputed block keeps only its input (T*D*b) and, for a MoE FFN, its replay record
``T*k*8 + (N_r + N_s)*D*b`` (rows only under EP, :func:`moetrain.recompute.moe_replay_bytes`;
node_dedup adds its token copies both ways and their gates).
Its cost is its forward FLOPs once more. (With ``attention_mask``, recomputed layers and attention
blocks also keep the boolean mask, ``B*S*S`` bytes, one storage for all of them.)

The formulas know no model by name: :class:`~moetrain.planner.model.ModelArch` states the facts
(causal attention or an explicit mask, dropout, logits for the targets only, the outside terms) a
model's ``describe`` hook gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.comm.chunk_cost import ffn_flops
from moetrain.config import MoEConfig
from moetrain.layers.dispatch import compute_capacity
from moetrain.planner.model import ModelArch
from moetrain.recompute import RecomputeOption, moe_replay_bytes

KERNELS = ("cuda", "cpu")
ROW_BOUNDS = ("capacity", "balanced")


def _pad(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class MoERows:
    """Rows of one MoE layer on one rank. ``capacity``: C per expert (None: dropless); ``sent``:
    N_s rows dispatched; ``received``: N_r rows computed by the local experts; ``bound``:
    ``"capacity"`` (every expert on every rank filled to C: the most a capacity allows) or
    ``"balanced"`` (every expert gets ``T*k/E`` slots, cut at C)."""

    tokens: int
    capacity: int | None
    sent: int
    received: int
    bound: str


def moe_rows(moe: MoEConfig, tokens: int, ep_size: int, capacity_factor, bound: str) -> MoERows:
    """Rows per rank for ``tokens`` routed tokens, ``C = max(min_capacity, ceil(cf*T*k/E))``:

    - ``capacity``: ``N_s = min(T*k, E*min(C, T))``, ``N_r = ep * min(T*k, El*min(C, T))``
      (an expert keeps at most C slots, and at most one per token); dropless: ValueError.
    - ``balanced``: ``N_s = N_r = min(T*k, E*C)`` (``T*k`` when dropless).
    """
    if bound not in ROW_BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(map(repr, ROW_BOUNDS))}, got {bound!r}")
    experts, k = moe.num_experts, moe.top_k
    capacity = compute_capacity(tokens, experts, k, capacity_factor, moe.min_capacity)
    slots = tokens * k
    if bound == "balanced":
        rows = slots if capacity is None else min(slots, experts * capacity)
        return MoERows(tokens, capacity, rows, rows, bound)
    if capacity is None:
        raise ValueError("bound 'capacity' needs a capacity factor (dropless has no capacity bound)")
    per_expert = min(capacity, tokens)
    local = experts // ep_size
    return MoERows(
        tokens, capacity, min(slots, experts * per_expert), ep_size * min(slots, local * per_expert), bound
    )


@dataclass(frozen=True)
class Workload:
    """What one rank runs per micro-step: ``batch`` sequences of ``seq_len`` text tokens (plus the
    architecture's image patches), ``itemsize`` bytes per compute element, ``kernels`` whose saving
    rules apply (``"cuda"`` or ``"cpu"``), ``ep_size``, the capacity factor in force (None:
    dropless) and the row bound used for memory (``"capacity"`` or ``"balanced"``).
    ``target_len``: text tokens per sequence that get logits (an architecture with
    ``targets_only``; None: all ``seq_len``, the captioning worst case); a language model predicts
    every position. ``nodes_reached``:
    with ``all_to_all="node_dedup"``, the nodes a token's kept slots reach (its replay records keep
    the token copies too); None for the per-slot all-to-alls."""

    batch: int
    seq_len: int
    itemsize: int
    kernels: str = "cuda"
    ep_size: int = 1
    capacity_factor: float | None = None
    row_bound: str = "capacity"
    target_len: int | None = None
    nodes_reached: float | None = None  # all_to_all "node_dedup": nodes a token's slots reach

    def __post_init__(self) -> None:
        if self.target_len is not None and not 1 <= self.target_len <= self.seq_len:
            raise ValueError(
                f"target_len must be in [1, seq_len = {self.seq_len}] or None, got {self.target_len!r}"
            )
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {self.kernels!r}")
        if self.itemsize not in (2, 4):
            raise ValueError(f"itemsize must be 2 (bf16/fp16) or 4 (fp32), got {self.itemsize!r}")


@dataclass(frozen=True)
class LayerActivations:
    """One transformer layer: saved bytes by part, what recomputed blocks keep, forward FLOPs.

    ``terms``: named byte counts (``norms``, ``attn``, ``ffn``, ``dispatch_index``) of the layer
    without recompute. ``*_input``: bytes a recomputed block keeps as its checkpoint input;
    ``replay``: the MoE replay record of a recomputed FFN. FLOPs are forward FLOPs. ``rows``: the
    MoE rows the memory terms assume (the workload's bound); ``balanced_rows``: those of balanced
    routing, which FLOPs and traffic assume."""

    index: int
    is_moe: bool
    terms: dict[str, int]
    layer_input: int
    attn_input: int
    ffn_input: int
    replay: int
    attn_flops: float
    ffn_flops: float
    rows: MoERows | None
    balanced_rows: MoERows | None = None
    module_name: str | None = None

    @property
    def saved_bytes(self) -> int:
        return sum(self.terms.values())

    def options(self, flops_per_s: float) -> tuple[RecomputeOption, ...]:
        """none / attn / [ffn / attn+ffn, MoE layers only] / whole layer, with bytes kept and
        the recompute time ``forward FLOPs / flops_per_s`` (ms), named like the model's modules."""
        t = self.terms
        name = f"blocks.{self.index}"
        base = t["norms"] + t["dispatch_index"]
        attn_kept, ffn_kept = self.attn_input, self.ffn_input + self.replay
        ms = 1e3 / flops_per_s
        if self.module_name is not None:  # a generic model's MoELayer: kept whole or recomputed
            return (
                RecomputeOption((), base + t["attn"] + t["ffn"], 0.0),
                RecomputeOption((self.module_name,), base + t["attn"] + ffn_kept, self.ffn_flops * ms),
            )
        options = [
            RecomputeOption((), base + t["attn"] + t["ffn"], 0.0),
            RecomputeOption((f"{name}.attn",), base + attn_kept + t["ffn"], self.attn_flops * ms),
        ]
        if self.is_moe:
            options += [
                RecomputeOption((f"{name}.ffn",), base + t["attn"] + ffn_kept, self.ffn_flops * ms),
                RecomputeOption(
                    (f"{name}.attn", f"{name}.ffn"),
                    base + attn_kept + ffn_kept,
                    (self.attn_flops + self.ffn_flops) * ms,
                ),
            ]
        whole = self.layer_input + self.replay + t["dispatch_index"]
        options.append(RecomputeOption((name,), whole, (self.attn_flops + self.ffn_flops) * ms))
        return tuple(options)


@dataclass(frozen=True)
class ActivationModel:
    """Per-rank activation bytes of one micro-batch: ``outside`` (named terms saved outside every
    layer: embeddings, image stem, final norm, head, loss) and one :class:`LayerActivations` per
    layer; ``outside_flops``: forward FLOPs outside the layers (stem, head);
    ``attention_mask_bytes``: the boolean attention mask (``arch.attention_mask``, ``B*S*S``), which
    recomputed layers and attention blocks keep as a checkpoint input (one storage, shared by all
    of them)."""

    outside: dict[str, int]
    layers: tuple[LayerActivations, ...]
    outside_flops: float
    tokens: int
    attention_mask_bytes: int = 0

    @property
    def outside_bytes(self) -> int:
        return sum(self.outside.values())

    @property
    def baseline_bytes(self) -> int:
        """Everything saved without recompute."""
        return self.outside_bytes + sum(layer.saved_bytes for layer in self.layers)

    @property
    def forward_flops(self) -> float:
        return self.outside_flops + sum(layer.attn_flops + layer.ffn_flops for layer in self.layers)

    def groups(self, flops_per_s: float) -> list[tuple[RecomputeOption, ...]]:
        """The recompute options of every layer (for :func:`moetrain.recompute.solve_recompute`)."""
        return [layer.options(flops_per_s) for layer in self.layers]


def norm_bytes(tokens: int, d_model: int, b: int, kernels: str) -> int:
    stats = 4 if kernels == "cuda" else b
    return tokens * d_model * b + 2 * tokens * stats


def _ffn_hidden_bytes(rows: int, d_ff: int, b: int, activation: str) -> int:
    """Saved inside the FFN after its input: h and act(h), ``swiglu``: h [2F], silu(gate), product."""
    return rows * d_ff * b * (4 if activation == "swiglu" else 2)


def moe_ffn_bytes(moe: MoEConfig, rows: MoERows, b: int, training: bool = True) -> int:
    """Saved bytes of one MoELayer forward (the ``ffn`` term; see the module docstring)."""
    t, d, e, k = rows.tokens, moe.d_model, moe.num_experts, moe.top_k
    total = t * d * 4  # router input in fp32 (the FFN input itself when b = 4)
    if b < 4:
        total += e * d * 4  # fp32 copy of the router weight
    if training and moe.router_jitter > 0:
        total += t * d * 4  # the noise (the jittered input replaces the input as the saved one)
    total += t * e * 4  # probabilities
    if moe.z_loss_coef:
        total += t * e * 4 + t * 4  # logits and their logsumexp
    total += t * k * (8 + 4)  # expert ids (gather index) and gathered gates
    if moe.gates_normalized:
        total += 2 * t * 4 + t * k * 4  # sum, clamped sum, normalised gates
    if moe.aux_loss_coef:
        total += 2 * t * 4 + e * 4
    if moe.aux_loss_coef or moe.z_loss_coef:
        total += 4  # the aux loss attached to the output
    total += rows.received * d * b + _ffn_hidden_bytes(rows.received, moe.d_ff, b, moe.activation)
    total += rows.sent * d * b  # rows back from the experts, kept by the weighted combine
    if moe.shared_expert_d_ff:
        if b < 4:
            total += t * d * b
        total += _ffn_hidden_bytes(t, moe.shared_expert_d_ff, b, moe.activation)
    return total


def dispatch_index_bytes(moe: MoEConfig, rows: MoERows, ep_size: int) -> int:
    """``DispatchPlan`` tensors (int64): row of each slot, slot of each row, kept and routed
    counts per expert, and under EP the received counts: ``T*k*8 + N_s*8 + 2*E*8 [+ E*8]``."""
    experts = moe.num_experts
    return (rows.tokens * moe.top_k + rows.sent + 2 * experts + (experts if ep_size > 1 else 0)) * 8


def replay_bytes(
    moe: MoEConfig, rows: MoERows, b: int, ep_size: int, nodes_reached: float | None = None
) -> int:
    """The routing replay record of a recomputed MoELayer (see ``moe_replay_bytes``); node_dedup
    (``nodes_reached`` R) also keeps ``C = N_s*R/k`` copies received and as many partial rows back
    (balanced routing), and the copies' fp32 gates, ``C*k*4``."""
    if ep_size > 1 and nodes_reached is not None:
        copies = math.ceil(rows.sent * nodes_reached / moe.top_k)
        return moe_replay_bytes(
            rows.tokens,
            moe.top_k,
            rows.received,
            rows.sent,
            moe.d_model,
            b,
            2 * copies,
            copies * moe.top_k * 4,
        )
    if ep_size > 1:
        return moe_replay_bytes(rows.tokens, moe.top_k, rows.received, rows.sent, moe.d_model, b)
    return moe_replay_bytes(rows.tokens, moe.top_k, 0, 0, moe.d_model, b)


def moe_forward_flops(moe: MoEConfig, tokens: int, rows_computed: int) -> float:
    """Router ``2*T*D*E`` + experts over the computed rows + the shared expert over T."""
    flops = 2.0 * tokens * moe.d_model * moe.num_experts
    flops += ffn_flops(rows_computed, moe.d_model, moe.d_ff, moe.activation)
    if moe.shared_expert_d_ff:
        flops += ffn_flops(tokens, moe.d_model, moe.shared_expert_d_ff, moe.activation)
    return flops


def activation_model(arch: ModelArch, work: Workload) -> ActivationModel:
    """The per-rank activation bytes and forward FLOPs of ``arch`` running ``work``."""
    if arch.generic:
        return _generic_activation_model(arch, work)
    b, kernels = work.itemsize, work.kernels
    d, heads = arch.d_model, arch.num_heads
    seq = arch.image_tokens + work.seq_len
    batch = work.batch
    tokens = batch * seq
    mask_b = 1 if kernels == "cuda" else b
    dropout = arch.dropout > 0
    lse_pad, bias_pad = (32, 16) if kernels == "cuda" else (1, 1)
    if dropout and kernels == "cpu":
        raise ValueError(
            "kernels 'cpu' with attention dropout: CPU attention then takes the math path, whose "
            "[B, H, S, S] saved tensors are not modeled; use dropout = 0 or kernels = 'cuda'"
        )

    attn = tokens * d * b * 5 + batch * heads * _pad(seq, lse_pad) * 4
    if arch.attention_mask:
        attn += batch * seq * _pad(seq, bias_pad) * b  # the boolean mask as a float bias
    # causal attention computes half the score matrix (flash / memory-efficient kernels skip it)
    core = 4.0 * batch * seq * seq * d * (0.5 if arch.causal else 1.0)
    attn_flops = 2.0 * tokens * d * 4 * d + core
    norms = 2 * norm_bytes(tokens, d, b, kernels) + (2 * tokens * d * mask_b if dropout else 0)

    layers = []
    for index in range(arch.num_layers):
        if arch.is_moe_layer(index):
            moe = arch.moe
            bound = work.row_bound if work.capacity_factor else "balanced"
            rows_memory = moe_rows(moe, tokens, work.ep_size, work.capacity_factor, bound)
            rows_time = moe_rows(moe, tokens, work.ep_size, work.capacity_factor, "balanced")
            terms = {
                "norms": norms,
                "attn": attn,
                "ffn": moe_ffn_bytes(moe, rows_memory, b),
                "dispatch_index": dispatch_index_bytes(moe, rows_memory, work.ep_size),
            }
            replay = replay_bytes(moe, rows_memory, b, work.ep_size, work.nodes_reached)
            forward_ffn = moe_forward_flops(moe, tokens, rows_time.received)
            rows, balanced = rows_memory, rows_time
        else:
            d_ff, activation = arch.dense_d_ff, arch.moe.activation
            terms = {
                "norms": norms,
                "attn": attn,
                "ffn": tokens * d * b + _ffn_hidden_bytes(tokens, d_ff, b, activation),
                "dispatch_index": 0,
            }
            replay, forward_ffn, rows, balanced = 0, ffn_flops(tokens, d, d_ff, activation), None, None
        layers.append(
            LayerActivations(
                index=index,
                is_moe=arch.is_moe_layer(index),
                terms=terms,
                layer_input=tokens * d * b,
                attn_input=tokens * d * b,
                ffn_input=tokens * d * b,
                replay=replay,
                attn_flops=attn_flops,
                ffn_flops=forward_ffn,
                rows=rows,
                balanced_rows=balanced,
            )
        )

    outside, outside_flops = _outside_terms(arch, work)
    return ActivationModel(
        outside=outside,
        layers=tuple(layers),
        outside_flops=outside_flops,
        tokens=tokens,
        attention_mask_bytes=batch * seq * seq if arch.attention_mask else 0,
    )


def _generic_activation_model(arch: ModelArch, work: Workload) -> ActivationModel:
    """A model measured on ``meta`` (:mod:`moetrain.planner.generic`): what is saved outside the
    MoE layers as measured (scaled to ``work.batch`` sequences and the compute itemsize), each MoE
    layer by the MoE formulas; its ``T`` the tokens the layer routes."""
    measured, moe, b = arch.measured, arch.moe, work.itemsize
    if work.seq_len != measured.tokens_per_sequence:
        raise ValueError(
            f"seq_len = {work.seq_len}: a model planned without a describe hook is measured at the "
            f"sequence length its data gives ({measured.tokens_per_sequence} tokens per sequence)"
        )
    tokens = work.batch * measured.tokens_per_sequence
    bound = work.row_bound if work.capacity_factor else "balanced"
    rows_memory = moe_rows(moe, tokens, work.ep_size, work.capacity_factor, bound)
    rows_time = moe_rows(moe, tokens, work.ep_size, work.capacity_factor, "balanced")
    layers = tuple(
        LayerActivations(
            index=index,
            is_moe=True,
            terms={
                "norms": 0,
                "attn": 0,
                "ffn": moe_ffn_bytes(moe, rows_memory, b),
                "dispatch_index": dispatch_index_bytes(moe, rows_memory, work.ep_size),
            },
            layer_input=tokens * moe.d_model * b,
            attn_input=0,
            ffn_input=tokens * moe.d_model * b,
            replay=replay_bytes(moe, rows_memory, b, work.ep_size, work.nodes_reached),
            attn_flops=0.0,
            ffn_flops=moe_forward_flops(moe, tokens, rows_time.received),
            rows=rows_memory,
            balanced_rows=rows_time,
            module_name=name,
        )
        for index, name in enumerate(measured.moe_modules)
    )
    return ActivationModel(
        outside={"measured_outside_moe": measured.saved_bytes(work.batch, b), "head_input": 0},
        layers=layers,
        outside_flops=measured.flops(work.batch),
        tokens=tokens,
    )


def loss_tokens(arch: ModelArch, work: Workload) -> int:
    """Tokens that get logits and a loss: the targets' ``B * (target_len or seq_len)`` with
    ``arch.targets_only``, else every token ``B * (image_tokens + seq_len)``."""
    if arch.targets_only:
        return work.batch * (work.target_len or work.seq_len)
    return work.batch * (arch.image_tokens + work.seq_len)


def decoder_outside(arch: ModelArch, work: Workload) -> tuple[dict[str, int], float]:
    """The default ``outside`` terms (a decoder LM): token ids (int64) and the final norm over
    every token; no FLOPs before the layers."""
    tokens = work.batch * (arch.image_tokens + work.seq_len)
    return {
        "embedding": tokens * 8,  # token ids
        "final_norm": norm_bytes(tokens, arch.d_model, work.itemsize, work.kernels),
    }, 0.0


def _outside_terms(arch: ModelArch, work: Workload) -> tuple[dict[str, int], float]:
    """The architecture's outside terms (its hook, else :func:`decoder_outside`), then the head
    input and the loss over :func:`loss_tokens`, and the head's FLOPs."""
    b, d, vocab = work.itemsize, arch.d_model, arch.vocab_size
    outside, flops = (arch.outside or decoder_outside)(arch, work)
    outside = dict(outside)
    loss = loss_tokens(arch, work)
    outside["head_input"] = loss * d * b
    outside["loss"] = loss * vocab * 4 + loss * 8 + 4  # fp32 log-softmax, targets
    return outside, 2.0 * loss * d * vocab + flops


def ceil_fraction(fraction: float, count: int) -> int:
    """``ceil(fraction * count)`` without float noise (0.5 * 24 -> 12)."""
    return min(count, math.ceil(round(fraction * count, 9)))
