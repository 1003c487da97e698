"""Plain-PyTorch references the C++ kernels and MoELayer are compared against.

Written independently of the product code: simple loops over tokens and slots, no C++ ops.
Legend: T tokens, D hidden, E experts, K choices, S = T*K slots (slot s = t*K + j).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# (tokens, k, experts, hidden, capacity): empty experts, T < E, capacity cuts, odd hidden sizes.
PERMUTE_SHAPES = [
    (1, 1, 1, 1, None),
    (3, 2, 8, 5, None),
    (2, 1, 16, 33, None),
    (17, 2, 4, 31, 3),
    (40, 3, 6, 16, 5),
    (64, 2, 8, 100, None),
    (9, 4, 4, 17, 0),
    (0, 2, 4, 8, None),
]


def reference_dispatch_plan(expert_ids_TK, num_experts, capacity, priority_order=None):
    """(row_of_slot [T,K], slot_of_row [N], kept [E], routed [E]) by visiting slots in priority order."""
    tokens, k = expert_ids_TK.shape
    if priority_order is None:
        priority_order = [t * k + j for j in range(k) for t in range(tokens)]
    else:
        priority_order = priority_order.tolist()
    flat = expert_ids_TK.reshape(-1).tolist()
    per_expert: list[list[int]] = [[] for _ in range(num_experts)]
    routed = [0] * num_experts
    for s in priority_order:
        e = flat[s]
        routed[e] += 1
        if capacity is None or len(per_expert[e]) < capacity:
            per_expert[e].append(s)
    slot_of_row = [s for slots in per_expert for s in slots]
    row_of_slot = [-1] * (tokens * k)
    for row, s in enumerate(slot_of_row):
        row_of_slot[s] = row
    return (
        torch.tensor(row_of_slot, dtype=torch.long).view(tokens, k),
        torch.tensor(slot_of_row, dtype=torch.long),
        torch.tensor([len(s) for s in per_expert], dtype=torch.long),
        torch.tensor(routed, dtype=torch.long),
    )


def reference_permute(x_TD, slot_of_row, k, weights_S=None):
    rows = [x_TD[int(s) // k] * (1 if weights_S is None else weights_S[int(s)]) for s in slot_of_row]
    return torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])


def reference_unpermute(y_ND, row_of_slot_TK, weights_TK=None):
    tokens, k = row_of_slot_TK.shape
    out = []
    for t in range(tokens):
        acc = y_ND.new_zeros(y_ND.shape[1])
        for j in range(k):
            row = int(row_of_slot_TK[t, j])
            if row >= 0:
                acc = acc + (1 if weights_TK is None else weights_TK[t, j]) * y_ND[row]
        out.append(acc)
    return torch.stack(out) if out else y_ND.new_zeros(0, y_ND.shape[1])


def _activation(h, name):
    if name == "relu":
        return torch.relu(h)
    if name == "gelu":
        return F.gelu(h)
    half = h.shape[-1] // 2
    return F.silu(h[..., :half]) * h[..., half:]


def naive_moe_forward(layer, x, jitter_noise=None):
    """Per-token loop re-implementation of MoELayer's forward (same parameters, any dtype).

    Returns (output shaped like x, aux_loss) where aux_loss is the coefficient-weighted sum that the
    layer injects into backward.
    """
    cfg = layer.config
    E, K, G = cfg.num_experts, cfg.top_k, cfg.num_prototypes
    per_group, k_per_group = E // G, K // G
    x_TD = x.reshape(-1, cfg.d_model)
    T = x_TD.shape[0]
    w_router = layer.router.weight
    w1, w2 = layer.experts.w1_EDF, layer.experts.w2_EFD
    router_in = x_TD if jitter_noise is None else x_TD * jitter_noise

    logits, probs, choices, gates = [], [], [], []
    for t in range(T):
        logit_E = w_router @ router_in[t]
        if cfg.score_function == "softmax":
            prob_E = torch.cat(
                [torch.softmax(logit_E[g * per_group : (g + 1) * per_group], 0) for g in range(G)]
            )
        else:
            prob_E = torch.sigmoid(logit_E)
        chosen = []
        for g in range(G):
            group = list(range(g * per_group, (g + 1) * per_group))
            group.sort(key=lambda e, p=prob_E: -float(p[e].detach()))
            chosen += group[:k_per_group]
        gate = torch.stack([prob_E[e] for e in chosen])
        normalize = cfg.normalize_gates if cfg.normalize_gates is not None else K > 1
        if normalize:
            gate = gate / gate.sum()
        logits.append(logit_E)
        probs.append(prob_E)
        choices.append(chosen)
        gates.append(gate)

    factor = cfg.capacity_factor if layer.training else cfg.eval_capacity_factor
    capacity = max(cfg.min_capacity, math.ceil(factor * T * K / E)) if factor else None
    token_order = list(range(T))
    if cfg.batch_prioritized_routing:
        token_order.sort(key=lambda t: -float(max(probs[t]).detach()))
    used = [0] * E
    kept = [[False] * K for _ in range(T)]
    for j in range(K):
        for t in token_order:
            e = choices[t][j]
            if capacity is None or used[e] < capacity:
                kept[t][j] = True
                used[e] += 1

    outputs = []
    for t in range(T):
        y = x_TD.new_zeros(cfg.d_model)
        for j in range(K):
            if kept[t][j]:
                e = choices[t][j]
                y = y + gates[t][j] * (_activation(x_TD[t] @ w1[e], cfg.activation) @ w2[e])
        if layer.shared_expert is not None:
            shared = layer.shared_expert
            y = y + _activation(x_TD[t] @ shared.w1_DF, cfg.activation) @ shared.w2_FD
        outputs.append(y)
    out = torch.stack(outputs) if outputs else x_TD.new_zeros(0, cfg.d_model)

    aux = x_TD.new_zeros(())
    if T and cfg.aux_loss_coef:
        counts = [0.0] * E
        for t in range(T):
            for e in choices[t]:
                counts[e] += 1
        mean_dist = sum(p / p.sum() for p in probs) / T
        aux = aux + cfg.aux_loss_coef * E * sum(counts[e] / (T * K) * mean_dist[e] for e in range(E))
    if T and cfg.z_loss_coef:
        aux = aux + cfg.z_loss_coef * sum(torch.logsumexp(lg, 0) ** 2 for lg in logits) / T
    return out.view_as(x), aux


# ------------------------------------------------------------------------------------------------
# All-to-all layout (csrc/a2a_layout.cpp, csrc/a2a_layout_cuda.cu).
# ------------------------------------------------------------------------------------------------


def reference_transpose_chunks(x, sizes_AB):
    """Rows stored as chunks [a][b] (``sizes_AB[a, b]`` rows each) -> the same chunks in [b][a]
    order, by slicing."""
    a_count, b_count = sizes_AB.shape
    starts = [0, *sizes_AB.reshape(-1).cumsum(0).tolist()]
    chunks = [x[starts[i] : starts[i + 1]] for i in range(a_count * b_count)]
    ordered = [chunks[a * b_count + b] for b in range(b_count) for a in range(a_count)]
    return torch.cat(ordered) if ordered else x[:0]


def scaled_fp16_inputs(dtype):
    """64 x 40 rows for the scaled-fp16 wire format: large, tiny, zero, power-of-two rows; row 4
    holds an inf, row 5 a nan."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 40, generator=g, dtype=torch.float64)
    x[1] *= 1e6  # large rows scale down, small rows scale up
    x[2] *= 1e-30
    x[3] = 0.0
    x[4, 5] = float("inf")
    x[5, 7] = float("nan")
    x[6] = 2.0**10  # exact power of two: max/2^e = 2^15 exactly
    x[7] *= 1e-40 if dtype == torch.float64 else 1e-3
    return x.to(dtype)


def _times_power_of_two(x_ND, exponent_N):
    """``x_ND * 2^exponent_N[:, None]`` in fp64, exact: two factors, so none over- or underflows."""
    first = [e // 2 for e in exponent_N.tolist()]
    second = [e - f for e, f in zip(exponent_N.tolist(), first, strict=True)]
    factor = [
        torch.tensor([math.ldexp(1.0, e) for e in part], dtype=torch.float64).view(-1, 1)
        for part in (first, second)
    ]
    return x_ND.double() * factor[0] * factor[1]


SCALED_FP16_MIN_EXPONENT = -1000  # keeps 2^-e finite in fp64 (csrc/a2a_layout.cpp kMinExponent)


def reference_scaled_fp16_exponent(x_ND):
    """Per-row int64 exponent e: the smallest integer with max|x_r| / 2^e <= 2^15, at least
    SCALED_FP16_MIN_EXPONENT (0 for zero rows)."""
    rows, hidden = x_ND.shape
    amax = x_ND.double().abs().amax(1) if hidden else torch.zeros(rows, dtype=torch.float64)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = exponent.long() - (mantissa == 0.5).long()
    scaled = (ceil_log2 - 15).clamp_min(SCALED_FP16_MIN_EXPONENT)
    return torch.where(amax > 0, scaled, torch.zeros_like(ceil_log2))


def reference_pack_scaled_fp16(x_ND):
    """Finite rows [N, D] (any float dtype) -> the wire format [N, D + 1] int16: the bit patterns of
    fp16(x_r / 2^e_r), then e_r."""
    assert bool(torch.isfinite(x_ND).all()), "the reference covers finite rows only"
    exponent = reference_scaled_fp16_exponent(x_ND)
    payload = _times_power_of_two(x_ND, -exponent).to(torch.float16)
    return torch.cat([payload.view(torch.int16), exponent.to(torch.int16).view(-1, 1)], dim=1)


def reference_unpack_scaled_fp16(packed, dtype):
    """[N, D + 1] int16 wire rows -> [N, D] ``dtype``: fp16 payload times 2^e, rounded once."""
    payload = packed[:, :-1].contiguous().view(torch.float16)
    return _times_power_of_two(payload, packed[:, -1].long()).to(dtype)
