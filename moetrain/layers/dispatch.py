"""Capacity, the dispatch plan and the sort-based permutation between token order and expert order.

Legend: T tokens, D hidden, E experts, K choices per token, S = T*K routing slots (slot
``s = t*K + j`` is token t's j-th choice), N rows kept after the capacity cut.

The permutation is a counting sort of the slots by expert (``build_dispatch_plan``); the row
movement in both directions is done by the C++ kernels in ``csrc/permute.cpp``:

- dispatch ``x_ND[r] = x_TD[slot_of_row[r] // K]``
- combine ``y_TD[t] = sum_j gates_TK[t, j] * y_ND[row_of_slot[t, j]]`` (dropped slots contribute 0)

No dense ``[T, E, C]`` mask is ever built, and experts see exactly their kept rows, no padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetrain._ext import kernels_for, ops
from moetrain.comm.all_to_all import (
    all_to_all,
    all_to_all_reverse,
    exchange_counts,
    regroup_chunks,
    replay_all_to_all,
)


def compute_capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None, min_capacity: int
) -> int | None:
    """Rows an expert keeps: ``max(min_capacity, ceil(capacity_factor * T * K / E))``.

    ``None`` (dropless) when ``capacity_factor`` is ``None`` or 0.
    """
    if not capacity_factor:
        return None
    return max(min_capacity, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def token_priority_order(
    num_tokens: int, top_k: int, token_score_T: torch.Tensor | None
) -> torch.Tensor | None:
    """The order in which slots claim capacity: choice-major (every token's first choice before any
    second choice), tokens by position (``token_score_T`` None: returns None, the kernel's default)
    or by descending score (batch-prioritised routing: the lowest-score tokens are dropped first)."""
    if token_score_T is None:
        return None
    token_order_T = torch.argsort(token_score_T, descending=True, stable=True)
    choice_K1 = torch.arange(top_k, device=token_order_T.device).view(top_k, 1)
    return (token_order_T.view(1, num_tokens) * top_k + choice_K1).reshape(-1)


@dataclass
class DispatchPlan:
    """Where each routing slot goes. ``row_of_slot_TK[t, j]`` is the expert-order row of slot
    (t, j) or -1 if dropped; ``slot_of_row_N`` is its inverse; expert e owns rows
    ``[sum(kept_per_expert_E[:e]), sum(kept_per_expert_E[:e+1]))``."""

    row_of_slot_TK: torch.Tensor
    slot_of_row_N: torch.Tensor
    kept_per_expert_E: torch.Tensor
    routed_per_expert_E: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.row_of_slot_TK.shape[1]

    @property
    def num_rows(self) -> int:
        return self.slot_of_row_N.numel()

    @property
    def num_dropped(self) -> int:
        return self.row_of_slot_TK.numel() - self.num_rows


def build_dispatch_plan(
    expert_ids_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    priority_order_S: torch.Tensor | None = None,
) -> DispatchPlan:
    """Counting sort of the slots by expert; an expert keeps the first ``capacity`` slots in
    ``priority_order_S`` (default: choice-major, by position). O(S) integer work.

    CPU ids use the C++ counting sort; CUDA ids use :func:`sort_dispatch_plan` (torch ops, same
    result, the plan stays on the GPU)."""
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None (dropless), got {capacity}")
    if expert_ids_TK.device.type == "cuda":
        return sort_dispatch_plan(expert_ids_TK, num_experts, capacity, priority_order_S)
    row_of_slot, slot_of_row, kept, routed = ops.build_dispatch_plan(
        expert_ids_TK.contiguous(),
        None if priority_order_S is None else priority_order_S.contiguous(),
        num_experts,
        -1 if capacity is None else capacity,
    )
    return DispatchPlan(row_of_slot, slot_of_row, kept, routed)


def sort_dispatch_plan(
    expert_ids_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    priority_order_S: torch.Tensor | None = None,
) -> DispatchPlan:
    """:func:`build_dispatch_plan` by torch ops on any device (the CUDA path), equal to the C++ op.

    ``queue_Q``: the slots in priority order (default choice-major, ``q -> (q % T) * K + q // T``).
    A stable sort of ``queue_Q`` by expert lists each expert's slots in priority order; a slot's
    rank inside its expert is ``position - routed_before_E[e]``, and it is kept iff
    ``rank < kept_E[e]`` (``kept_E = min(routed_E, capacity)``). The kept slots, in that sorted
    order, are ``slot_of_row_N``; ``row_of_slot`` is its inverse (-1 for dropped slots).
    The argument checks of the C++ op and N travel to the host in one copy, the only
    synchronisation (counts use ``scatter_add_``, not ``bincount``, which would synchronise).
    """
    if expert_ids_TK.dim() != 2 or expert_ids_TK.dtype != torch.int64:
        raise ValueError(
            "expert_ids must be a 2-D int64 tensor [tokens, k], "
            f"got {expert_ids_TK.dim()}-D {expert_ids_TK.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None (dropless), got {capacity}")
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
    kept_E = routed_E.clone() if capacity is None else routed_E.clamp_max(capacity)
    *failed, rows = torch.stack([*(bad.any().long() for bad in checks.values()), kept_E.sum()]).tolist()
    for message, bad in zip(checks, failed, strict=True):
        if bad:
            raise ValueError(message)

    expert_Q = expert_S[queue_Q]  # expert of each slot, in priority order
    order_Q = torch.sort(expert_Q, stable=True).indices
    sorted_slot_Q, sorted_expert_Q = queue_Q[order_Q], expert_Q[order_Q]
    routed_before_E = torch.cumsum(routed_E, 0) - routed_E
    rank_Q = torch.arange(slots, device=device) - routed_before_E[sorted_expert_Q]
    dropped_Q = (rank_Q >= kept_E[sorted_expert_Q]).long()
    kept_first_Q = torch.sort(dropped_Q, stable=True).indices  # kept slots first, in sorted order
    slot_of_row_N = sorted_slot_Q[kept_first_Q[:rows]]
    row_of_slot_S = torch.full((slots,), -1, dtype=torch.int64, device=device)
    row_of_slot_S[slot_of_row_N] = torch.arange(rows, device=device)
    return DispatchPlan(row_of_slot_S.view(tokens, k), slot_of_row_N, kept_E, routed_E)


def _weight_dtype(rows: torch.Tensor) -> torch.dtype:
    return torch.float64 if rows.dtype == torch.float64 else torch.float32


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        ctx.plan = plan
        kernels = kernels_for(x_TD, "permute_tokens(x_TD)")
        return kernels.permute_rows(x_TD.contiguous(), plan.slot_of_row_N, plan.top_k, None)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        kernels = kernels_for(grad_ND, "permute_tokens backward (grad_ND)")
        return kernels.unpermute_rows(grad_ND.contiguous(), ctx.plan.row_of_slot_TK, None), None


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, y_ND: torch.Tensor, gates_TK: torch.Tensor, plan: DispatchPlan, keep_alive
    ) -> torch.Tensor:
        y_ND = y_ND.contiguous()
        weights_TK = gates_TK.detach().to(_weight_dtype(y_ND)).contiguous()
        ctx.plan = plan
        ctx.keep_alive = keep_alive
        ctx.gates_dtype = gates_TK.dtype
        ctx.save_for_backward(y_ND, weights_TK)
        kernels = kernels_for(y_ND, "unpermute_tokens(y_ND)")
        return kernels.unpermute_rows(y_ND, plan.row_of_slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_ND, weights_TK = ctx.saved_tensors
        plan = ctx.plan
        grad_TD = grad_TD.contiguous()
        kernels = kernels_for(grad_TD, "unpermute_tokens backward (grad_TD)")
        grad_y = grad_gates = None
        if ctx.needs_input_grad[0]:
            grad_y = kernels.permute_rows(grad_TD, plan.slot_of_row_N, plan.top_k, weights_TK.view(-1))
        if ctx.needs_input_grad[1]:
            grad_gates = kernels.unpermute_weight_grad(grad_TD, y_ND, plan.row_of_slot_TK).to(ctx.gates_dtype)
        return grad_y, grad_gates, None, None


def permute_tokens(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Token order -> expert order: ``x_ND[r] = x_TD[slot_of_row[r] // K]`` (differentiable)."""
    return _PermuteTokens.apply(x_TD, plan)


def unpermute_tokens(
    y_ND: torch.Tensor, gates_TK: torch.Tensor, plan: DispatchPlan, keep_alive=None
) -> torch.Tensor:
    """Expert order -> token order, weighted: ``y_TD[t] = sum_j gates[t, j] * y_ND[row_of_slot[t, j]]``
    (differentiable in ``y_ND`` and ``gates_TK``; dropped slots contribute 0). ``keep_alive`` is
    held by the autograd graph for as long as the graph lives (a :class:`DispatchRecord`)."""
    return _UnpermuteTokens.apply(y_ND, gates_TK, plan, keep_alive)


@dataclass(eq=False)
class DispatchRecord:
    """What one forward decided and received: the routing choice, the dispatch plan, and under
    expert parallelism the exchange plan and the rows each all-to-all delivered. The autograd
    graph of that forward owns it, so that recomputing the layer (activation checkpointing) can
    replay it, neither re-routing nor re-communicating, and it is freed with the graph."""

    expert_ids_TK: torch.Tensor
    plan: DispatchPlan
    recv_counts_PE: torch.Tensor | None = None
    a2a_plan: object = None
    received_rows: torch.Tensor | None = None
    returned_rows: torch.Tensor | None = None
    replayed: bool = False

    def release_rows(self) -> None:
        """Drops the all-to-all rows (when no recompute will replay this round)."""
        self.received_rows = self.returned_rows = None

    def nbytes(self) -> int:
        """Bytes this record keeps beyond the autograd graph's own tensors: the expert ids and the
        all-to-all rows (the plan's index tensors are held by the graph with or without replay)."""
        tensors = [t for t in (self.expert_ids_TK, self.received_rows, self.returned_rows) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class LocalTokenDispatcher:
    """Dispatcher for experts that all live on this rank: permute, then unpermute.

    ``dispatch`` returns the expert-ordered rows, the row count of each local expert and the
    round's :class:`DispatchRecord` (pass a record to replay it); ``combine`` takes the experts'
    output rows back to token order.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(
        self,
        x_TD: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        capacity: int | None,
        priority_order_S: torch.Tensor | None = None,
        replay: DispatchRecord | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchRecord]:
        if replay is None:
            plan = build_dispatch_plan(expert_ids_TK, self.num_experts, capacity, priority_order_S)
            record = DispatchRecord(expert_ids_TK, plan)
        else:
            record = replay
            record.replayed = True
        return permute_tokens(x_TD, record.plan), record.plan.kept_per_expert_E, record

    def combine(self, y_ND: torch.Tensor, gates_TK: torch.Tensor, record: DispatchRecord) -> torch.Tensor:
        return unpermute_tokens(y_ND, gates_TK, record.plan, keep_alive=record)


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    """Expert-parallel dispatcher: permute into global-expert order (which is destination-rank
    order), exchange counts then rows with the EP group, regroup the received rows from
    [source rank][local expert] to [local expert][source rank]; combine undoes each step.

    Legend: P EP ranks, El local experts. A rank whose experts receive nothing still joins every
    exchange (with zero-row splits), so no rank can hang the group.
    """

    def __init__(self, num_experts: int, parallel):
        super().__init__(num_experts)
        self.parallel = parallel
        self.comm_dtype = parallel.config.comm_dtype

    def dispatch(self, x_TD, expert_ids_TK, capacity, priority_order_S=None, replay=None):
        x_ND, kept_E, record = super().dispatch(x_TD, expert_ids_TK, capacity, priority_order_S, replay)
        if replay is None:
            record.recv_counts_PE, record.a2a_plan = exchange_counts(
                kept_E.view(self.parallel.ep_size, -1), self.parallel
            )
            received = all_to_all(x_ND, record.a2a_plan, self.comm_dtype)  # [source rank][local expert]
            record.received_rows = received.detach()
        else:
            received = replay_all_to_all(x_ND, record.received_rows, record.a2a_plan, self.comm_dtype, True)
        return regroup_chunks(received, record.recv_counts_PE), record.recv_counts_PE.sum(0), record

    def combine(self, y_ND, gates_TK, record):
        returned = regroup_chunks(y_ND, record.recv_counts_PE.t().contiguous())  # [source rank][expert]
        if record.replayed:
            y_ND = replay_all_to_all(returned, record.returned_rows, record.a2a_plan, self.comm_dtype, False)
        else:
            y_ND = all_to_all_reverse(returned, record.a2a_plan, self.comm_dtype)
            record.returned_rows = y_ND.detach()
        return super().combine(y_ND, gates_TK, record)
