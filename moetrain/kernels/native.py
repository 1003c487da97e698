"""Torch-native twins of the C++/CUDA kernels: the same operations written with torch's own ops, so
they run on any device through torch's tested kernels (and trace into compiled graphs).

Each function takes the arguments of the op of the same name in ``csrc/`` (``torch.ops.moetrain.*``)
and returns what it returns, up to float rounding (the custom kernels accumulate in a different
order). They are the implementation a CUDA run falls back to when a custom kernel fails its
start-up check (:mod:`moetrain.kernels.selection`), what ``kernels: torch`` selects, and they are
compared with the C++ CPU kernels in CI.

The row ops' indices are one to one, as a plan's are: the slots >= 0 of ``slot_of_row`` are
distinct, and so are the rows >= 0 of ``row_of_slot`` (the gradients invert the index). Like the C++
CPU kernels, the twins check their indices (range and repeats) where that costs no host
synchronisation: on CPU tensors, outside compiled code.

Legend: T tokens, K choices, S = T*K routing slots (slot ``s = t*K + j``), N kept rows, E experts,
D hidden size.
"""

from __future__ import annotations

import torch

SCALED_FP16_MIN_EXPONENT = -1000  # 2^-e must stay a finite fp64 for the tiniest fp64 rows


def accumulate_dtype(rows: torch.dtype) -> torch.dtype:
    """fp64 for fp64 rows, else fp32: the dtype the kernels form products and sums in, and the
    dtype of their per-slot weights."""
    return torch.float64 if rows == torch.float64 else torch.float32


def inverse_index(index_M: torch.Tensor, size: int) -> torch.Tensor:
    """``inverse[index[m]] = m`` for ``index[m] >= 0``; entries no ``m`` points at are -1.

    ``index`` must not repeat a value >= 0 (a dispatch plan's rows and slots are one to one). The
    entries -1 of ``index`` are written to a spare element that is dropped, so nothing here
    depends on the data (no host synchronisation, no data-dependent shapes)."""
    flat_M = index_M.reshape(-1)
    target_M = torch.where(flat_M >= 0, flat_M, size)
    positions_M = torch.arange(flat_M.numel(), device=flat_M.device, dtype=torch.int64)
    return torch.full((size + 1,), -1, dtype=torch.int64, device=flat_M.device).scatter_(
        0, target_M, positions_M
    )[:size]


def _checkable(t: torch.Tensor) -> bool:
    """Whether a twin checks ``t``'s values: on the CPU outside compiled code (elsewhere a check
    would wait for the device or break the graph)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def check_index(index: torch.Tensor, name: str, size: int, entry: str) -> None:
    """The C++ kernels' check of a plan index ``name`` (an ``entry`` index, e.g. "row"), where
    :func:`_checkable`: every value in ``[-1, size)`` and no value >= 0 twice. Positions are flat,
    as the C++ messages give them. Raises a one-line ``ValueError``."""
    if not _checkable(index):
        return
    flat = index.reshape(-1)
    outside = (flat < -1) | (flat >= size)
    if bool(outside.any()):
        at = int(outside.nonzero()[0])
        raise ValueError(f"{name}[{at}] = {int(flat[at])} outside [-1, {size})")
    uses = torch.zeros(size + 1, dtype=torch.int64).index_add_(
        0, torch.where(flat >= 0, flat, size), torch.ones_like(flat)
    )[:size]
    if bool((uses > 1).any()):
        value = int((uses > 1).nonzero()[0])
        again = int((flat == value).nonzero()[1])
        raise ValueError(
            f"{name} must hold distinct {entry}s; {entry} {value} appears twice (again at [{again}])"
        )


def build_dispatch_plan(
    expert_ids_TK: torch.Tensor,
    priority_order_S: torch.Tensor | None,
    num_experts: int,
    capacity: int,
    num_rows: int | None = None,
    ids_in_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counting sort of the slots by expert by a stable sort; ``capacity < 0``: no cut;
    ``num_rows``: ``slot_of_row``'s length, -1 after the kept rows (None: the kept rows).
    ``ids_in_range``: the caller guarantees every id is in ``[0, num_experts)`` (a router's top-k);
    a dropless plan in the default order then keeps all ``T*K`` slots and needs no host copy at all.

    ``queue_Q``: the slots in priority order (default choice-major, ``q -> (q % T) * K + q // T``).
    A stable sort of ``queue_Q`` by expert lists each expert's slots in priority order; a slot's
    rank inside its expert is ``position - routed_before_E[e]``, and it is kept iff
    ``rank < kept_E[e]`` (``kept_E = min(routed_E, capacity)``). The kept slots, in that sorted
    order, are ``slot_of_row_N``; ``row_of_slot`` is its inverse (-1 for dropped slots).
    Counts use ``scatter_add_`` (``bincount`` would synchronise); the argument checks and N reach
    the host in one copy, the only synchronisation. Bad arguments raise ``ValueError``.
    """
    if expert_ids_TK.dim() != 2 or expert_ids_TK.dtype != torch.int64:
        raise ValueError(
            "expert_ids must be a 2-D int64 tensor [tokens, k], "
            f"got {expert_ids_TK.dim()}-D {expert_ids_TK.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    tokens, k = expert_ids_TK.shape
    slots = tokens * k
    device = expert_ids_TK.device
    expert_S = expert_ids_TK.reshape(-1)
    ones_S = torch.ones_like(expert_S)
    checks = {
        f"expert_ids contains values outside [0, {num_experts})": (expert_S < 0) | (expert_S >= num_experts)
    }
    if priority_order_S is None:
        position_Q = torch.arange(slots, device=device)
        queue_Q = (position_Q % max(tokens, 1)) * k + position_Q // max(tokens, 1)
    else:
        if priority_order_S.dtype != torch.int64 or priority_order_S.device != device:
            raise ValueError(
                f"priority_order must be an int64 tensor on {device}, got {priority_order_S.dtype} on "
                f"{priority_order_S.device}"
            )
        if priority_order_S.numel() != slots:
            raise ValueError(
                f"priority_order must have tokens*k = {slots} elements, got {priority_order_S.numel()}"
            )
        queue_Q = priority_order_S.reshape(-1)
        checks[f"priority_order contains values outside [0, {slots})"] = (queue_Q < 0) | (queue_Q >= slots)
        seen_S = torch.zeros_like(expert_S).scatter_add_(0, queue_Q.clamp(0, max(slots - 1, 0)), ones_S)
        checks["priority_order must be a permutation of the slots; some slot appears twice"] = seen_S > 1

    routed_E = expert_S.new_zeros(num_experts).scatter_add_(0, expert_S.clamp(0, num_experts - 1), ones_S)
    kept_E = routed_E.clone() if capacity < 0 else routed_E.clamp_max(capacity)
    if ids_in_range and capacity < 0 and priority_order_S is None:
        rows = slots  # nothing to check, every slot kept: no host copy
    else:
        *failed, rows = torch.stack([*(bad.any().long() for bad in checks.values()), kept_E.sum()]).tolist()
        for message, bad in zip(checks, failed, strict=True):
            if bad:
                raise ValueError(message)
    if num_rows is not None and num_rows < rows:
        raise ValueError(f"num_rows = {num_rows} is less than the {rows} rows the plan keeps")

    expert_Q = expert_S[queue_Q]  # expert of each slot, in priority order
    order_Q = torch.sort(expert_Q, stable=True).indices
    sorted_slot_Q, sorted_expert_Q = queue_Q[order_Q], expert_Q[order_Q]
    if capacity < 0:  # dropless: every slot is kept, in sorted order
        slot_of_row_N = sorted_slot_Q
    else:
        routed_before_E = torch.cumsum(routed_E, 0) - routed_E
        rank_Q = torch.arange(slots, device=device) - routed_before_E[sorted_expert_Q]
        dropped_Q = (rank_Q >= kept_E[sorted_expert_Q]).long()
        kept_first_Q = torch.sort(dropped_Q, stable=True).indices  # kept slots first, in sorted order
        slot_of_row_N = sorted_slot_Q[kept_first_Q[:rows]]
    row_of_slot_S = inverse_index(slot_of_row_N, slots)
    if num_rows is not None and num_rows > rows:
        slot_of_row_N = torch.cat([slot_of_row_N, slot_of_row_N.new_full((num_rows - rows,), -1)])
    return row_of_slot_S.view(tokens, k), slot_of_row_N, kept_E, routed_E


def permute_rows(
    x_TD: torch.Tensor, slot_of_row_N: torch.Tensor, k: int, weights_S: torch.Tensor | None
) -> torch.Tensor:
    """``out[r] = weights[s] * x[s // k]`` with ``s = slot_of_row[r]``; ``s = -1`` gives zeros.
    Weighted rows are formed in the accumulate dtype and rounded once. ``k >= 1``; the slots >= 0
    are distinct (checked on CPU tensors, :func:`check_index`)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    check_index(slot_of_row_N, "slot_of_row", x_TD.shape[0] * k, "slot")
    slot_N = slot_of_row_N.reshape(-1)
    if x_TD.shape[0] == 0:  # no token: every row is a zero row (slot -1); index a spare zero row
        x_TD = torch.cat([x_TD, x_TD.new_zeros((1, x_TD.shape[1]))])
        weights_S = None if weights_S is None else torch.cat([weights_S.reshape(-1), weights_S.new_zeros(k)])
    source_N = slot_N.clamp_min(0)
    out_ND = x_TD.index_select(0, source_N // k)
    if weights_S is not None:
        weight_N1 = weights_S.reshape(-1).index_select(0, source_N).unsqueeze(1)
        out_ND = (out_ND.to(weights_S.dtype) * weight_N1).to(x_TD.dtype)
    return out_ND.masked_fill((slot_N < 0).unsqueeze(1), 0)


def unpermute_rows(
    y_ND: torch.Tensor, row_of_slot_TK: torch.Tensor, weights_TK: torch.Tensor | None
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[row_of_slot[t, j]]``, dropped slots (-1) skipped; sums
    in the accumulate dtype, rounded once. The rows >= 0 are distinct (:func:`check_index`).
    Works by scattering each row into its token; the rows no slot uses go to a spare token
    ``T`` that is dropped, so neither an empty ``y`` (every slot dropped) nor ``T = 0`` with rows
    in ``y`` needs a special case."""
    tokens, k = row_of_slot_TK.shape
    rows = y_ND.shape[0]
    check_index(row_of_slot_TK, "row_of_slot", rows, "row")
    acc = accumulate_dtype(y_ND.dtype)
    slot_of_row_N = inverse_index(row_of_slot_TK, rows)
    kept_N = slot_of_row_N >= 0
    token_N = torch.where(kept_N, slot_of_row_N // max(k, 1), tokens)
    contribution_ND = y_ND.to(acc)
    if weights_TK is not None:
        weights_S = torch.cat([weights_TK.reshape(-1), weights_TK.new_zeros(1)])  # the spare slot's
        weight_N = weights_S.index_select(0, torch.where(kept_N, slot_of_row_N, tokens * k))
        contribution_ND = contribution_ND * weight_N.unsqueeze(1)
    out_TD = y_ND.new_zeros((tokens + 1, y_ND.shape[1]), dtype=acc).index_add_(0, token_N, contribution_ND)
    return out_TD[:tokens].to(y_ND.dtype)


# unpermute_weight_grad forms its dot products this many elements of [N, D] at a time, so its
# temporaries (grad rows gathered, both in the accumulate dtype, their product) stay within about
# 16 MiB for bf16 rows, whatever N and D.
WEIGHT_GRAD_CHUNK_ELEMENTS = 1 << 20


def unpermute_weight_grad(
    grad_TD: torch.Tensor, y_ND: torch.Tensor, row_of_slot_TK: torch.Tensor
) -> torch.Tensor:
    """``gw[t, j] = <grad[t], y[row_of_slot[t, j]]>`` in the accumulate dtype, 0 for dropped slots;
    the rows >= 0 of ``row_of_slot`` are distinct (:func:`check_index`). The dots are formed
    ``max(1, WEIGHT_GRAD_CHUNK_ELEMENTS // D)`` rows of ``y`` at a time (each as one product and
    row sum in the accumulate dtype), so no temporary is ``[N, D]``."""
    tokens, k = row_of_slot_TK.shape
    check_index(row_of_slot_TK, "row_of_slot", y_ND.shape[0], "row")
    acc = accumulate_dtype(grad_TD.dtype)
    slot_of_row_N = inverse_index(row_of_slot_TK, y_ND.shape[0])
    kept_N = slot_of_row_N >= 0
    if tokens == 0:  # no token: the rows of y (all unused) read a spare zero grad row
        grad_TD = torch.cat([grad_TD, grad_TD.new_zeros((1, grad_TD.shape[1]))])
    token_N = torch.where(kept_N, slot_of_row_N // max(k, 1), 0)
    step = max(1, WEIGHT_GRAD_CHUNK_ELEMENTS // max(y_ND.shape[1], 1))
    dots_N = torch.cat(
        [
            (grad_TD.index_select(0, token_n).to(acc) * y_nD.to(acc)).sum(1)
            for token_n, y_nD in zip(token_N.split(step), y_ND.split(step), strict=True)
        ]
    )
    target_N = torch.where(kept_N, slot_of_row_N, tokens * k)  # unused rows: a spare slot
    gw_S = dots_N.new_zeros(tokens * k + 1).scatter_(0, target_N, dots_N)
    return gw_S[: tokens * k].view(tokens, k)


def transpose_chunks(x: torch.Tensor, sizes_AB: torch.Tensor) -> torch.Tensor:
    """Rows stored as chunks ``[a][b]`` (``sizes[a, b]`` rows each) -> the same chunks in ``[b][a]``
    order, by one ``index_select`` whose source rows are computed on ``x``'s device (no host
    synchronisation, :func:`transpose_chunks_index`). CPU sizes are checked as the C++ kernel
    checks them: each >= 0, summing to the rows of x."""
    rows = x.shape[0]
    if _checkable(sizes_AB):
        flat = sizes_AB.reshape(-1)
        if bool((flat < 0).any()):
            raise ValueError(f"sizes must be >= 0, got {sizes_AB.tolist()}")
        # The first prefix sum past rows is > rows or, having wrapped around int64, < 0 (each
        # earlier one is in [0, rows]): no sum that wraps around to rows gets through.
        prefix = torch.cumsum(flat, 0)
        past = (prefix > rows) | (prefix < 0)
        if bool(past.any()):
            a, b = divmod(int(past.nonzero()[0]), sizes_AB.shape[1])
            raise ValueError(f"sizes sum past the {rows} rows of x at [{a}, {b}]")
        if int(flat.sum()) != rows:
            raise ValueError(f"sizes sum to {int(flat.sum())} but x has {rows} rows")
    return x.index_select(0, transpose_chunks_index(sizes_AB, rows, x.device))


def transpose_chunks_index(sizes_AB: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """The source row of each output row of :func:`transpose_chunks` (int64 ``[rows]`` on ``device``):
    output chunk ``(b, a)`` starts at ``dst_start`` and copies the rows of source chunk ``(a, b)``
    from ``src_start`` on."""
    a_count, b_count = sizes_AB.shape
    sizes = sizes_AB.to(device=device, dtype=torch.int64)
    src_start_AB = (torch.cumsum(sizes.reshape(-1), 0) - sizes.reshape(-1)).view(a_count, b_count)
    sizes_BA = sizes.t().reshape(-1)
    src_start_BA = src_start_AB.t().reshape(-1)
    dst_start_BA = torch.cumsum(sizes_BA, 0) - sizes_BA
    chunks = torch.arange(a_count * b_count, device=device)
    chunk_R = torch.repeat_interleave(chunks, sizes_BA, output_size=rows)
    return src_start_BA[chunk_R] + torch.arange(rows, device=device) - dst_start_BA[chunk_R]


def _powers_of_two(exponent_N: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` as exact fp64 values, built from the bits (``|exponent| <= 1022``)."""
    return ((exponent_N.to(torch.int64) + 1023) << 52).view(torch.float64)


def _ldexp_one(exponent_N: torch.Tensor) -> torch.Tensor:
    """``ldexp(1.0, exponent)`` in fp64 for any integer exponent, as C's ``ldexp`` (the kernels')
    gives it: exact for ``[-1074, 1023]`` (subnormal below -1022), ``inf`` above, 0 below."""
    exponent_N = exponent_N.to(torch.int64).clamp(-1075, 1024)  # 1024: the bits of inf
    normal_N = (exponent_N.clamp_min(-1022) + 1023) << 52
    subnormal_N = torch.where(exponent_N >= -1074, 1 << (exponent_N + 1074).clamp(0, 51), 0)
    return torch.where(exponent_N >= -1022, normal_N, subnormal_N).view(torch.float64)


def scaled_fp16_exponent(x_ND: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest ``e`` with ``max|x| / 2^e <= 2^15`` (NaN ignored), from ``frexp``
    (exact), at least ``SCALED_FP16_MIN_EXPONENT``; 0 for rows that are all zero or hold inf."""
    rows, hidden = x_ND.shape
    if hidden == 0:
        return torch.zeros(rows, dtype=torch.int32, device=x_ND.device)
    magnitude_ND = x_ND.abs()
    amax_N = torch.where(torch.isnan(magnitude_ND), 0, magnitude_ND).amax(dim=1)
    mantissa_N, power_N = torch.frexp(amax_N)
    exponent_N = torch.where(mantissa_N == 0.5, power_N - 1, power_N) - 15
    exponent_N = exponent_N.clamp_min(SCALED_FP16_MIN_EXPONENT)
    return torch.where((amax_N > 0) & torch.isfinite(amax_N), exponent_N, 0)


def pack_scaled_fp16(x_ND: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` fp32/fp64 -> ``[N, D + 1]`` int16: the fp16 bits of ``x / 2^e`` per row, then ``e``.
    The division by a power of two is exact in fp64; the value then rounds to fp32 and to fp16,
    as the C++ kernel does."""
    if x_ND.dim() != 2 or x_ND.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"x must be a 2-D float32 or float64 tensor, got {x_ND.dim()}-D {x_ND.dtype}")
    exponent_N = scaled_fp16_exponent(x_ND)
    scaled_ND = x_ND.to(torch.float64) * _powers_of_two(-exponent_N).unsqueeze(1)
    half_ND = scaled_ND.to(torch.float32).to(torch.float16)
    return torch.cat([half_ND.view(torch.int16), exponent_N.to(torch.int16).unsqueeze(1)], dim=1)


def unpack_scaled_fp16(packed_NW: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_scaled_fp16` to fp32 or fp64 (``W = D + 1``): ``value * 2^e`` formed
    in fp64; an exponent slot outside what pack writes decodes as the kernels' ``ldexp`` does."""
    if packed_NW.dim() != 2 or packed_NW.dtype != torch.int16 or packed_NW.shape[1] < 1:
        raise ValueError(
            f"packed must be a 2-D int16 tensor [N, D + 1], got {packed_NW.dtype} {tuple(packed_NW.shape)}"
        )
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    values_ND = packed_NW[:, :-1].contiguous().view(torch.float16)
    scale_N1 = _ldexp_one(packed_NW[:, -1]).unsqueeze(1)
    return (values_ND.to(torch.float64) * scale_N1).to(dtype)


@torch.no_grad()
def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    param_copy_out: torch.Tensor | None = None,
) -> None:
    """``adam_step_`` with torch ops in fp32, in torch.optim.Adam's (``adamw=False``) or AdamW's
    order of operations; the C++ kernel agrees to about an ulp of the weight per step."""
    g = grad.to(torch.float32).view_as(param) * (1.0 / grad_scale)
    if adamw:
        param.mul_(1.0 - lr * weight_decay)
    elif weight_decay:
        g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if param_copy_out is not None:
        param_copy_out.copy_(param.view_as(param_copy_out))


def adam_step_multi_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    steps: list[int],
    param_copies_out: list[torch.Tensor],
    copy_index: list[int],
    **hyper,
) -> None:
    """``adam_step_`` over lists; ``params[i]``'s copy is ``param_copies_out[copy_index[i]]``
    (-1 or an empty ``copy_index``: none), as the operator's schema says."""
    tensors = zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(tensors):
        index = copy_index[i] if copy_index else -1
        copy = param_copies_out[index] if index >= 0 else None
        adam_step_(param, grad, exp_avg, exp_avg_sq, step=steps[i], param_copy_out=copy, **hyper)


@torch.no_grad()
def adam_memory_probe_(param, grad, exp_avg, exp_avg_sq, param_copy_out=None) -> None:
    """The memory traffic of ``adam_step_`` without its math: p += g, m += g, v += g, copy = p."""
    g = grad.to(torch.float32).view_as(param)
    param.add_(g)
    exp_avg.add_(g)
    exp_avg_sq.add_(g)
    if param_copy_out is not None:
        param_copy_out.copy_(param.view_as(param_copy_out))


NATIVE_OPS = {
    "build_dispatch_plan": build_dispatch_plan,
    "permute_rows": permute_rows,
    "unpermute_rows": unpermute_rows,
    "unpermute_weight_grad": unpermute_weight_grad,
    "transpose_chunks": transpose_chunks,
    "pack_scaled_fp16": pack_scaled_fp16,
    "unpack_scaled_fp16": unpack_scaled_fp16,
    "adam_step_": adam_step_,
    "adam_step_multi_": adam_step_multi_,
    "adam_memory_probe_": adam_memory_probe_,
}
