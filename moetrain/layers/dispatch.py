"""Capacity, the dispatch plan and the sort-based permutation between token order and expert order.

Legend: T tokens, D hidden, E experts, K choices per token, S = T*K routing slots (slot
``s = t*K + j`` is token t's j-th choice), N rows kept after the capacity cut.

The permutation is a counting sort of the slots by expert (``build_dispatch_plan``); the row
movement in both directions is done by the ops of :mod:`moetrain.kernels` (the C++/CUDA kernels
of ``csrc/permute.*`` or their torch-native twins, as ``kernels`` selects):

- dispatch ``x_ND[r] = x_TD[slot_of_row[r] // K]``
- combine ``y_TD[t] = sum_j gates_TK[t, j] * y_ND[row_of_slot[t, j]]`` (dropped slots contribute 0)

No dense ``[T, E, C]`` mask is ever built, and experts see exactly their kept rows, no padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetrain.comm.all_to_all import exchange_counts, exchange_counts_and_value, regroup_chunks
from moetrain.comm.buffers import comm_buffer_pool
from moetrain.comm.chunk_cost import group_layout, layer_overlap_inputs, plan_chunks, run_links
from moetrain.comm.chunking import unchunked_comm_bytes
from moetrain.comm.compression import WIRE_DTYPES, wire_row_bytes
from moetrain.kernels import kernel, native
from moetrain.kernels.native import accumulate_dtype
from moetrain.kernels.registration import most_kept_rows
from moetrain.layers.eager import prepare_eager_methods, runs_eagerly
from moetrain.layers.exchange import DispatchRound, Exchanger
from moetrain.layers.overlap import ChunkedExchange, OverlapSettings


def compute_capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None, min_capacity: int
) -> int | None:
    """Rows an expert keeps: ``min(T * K, max(min_capacity, ceil(capacity_factor * T * K / E)))``
    (no expert is routed more than the ``T * K`` slots, so a larger capacity keeps the same rows).

    ``None`` (dropless) when ``capacity_factor`` is ``None`` or 0.
    """
    if not capacity_factor:
        return None
    slots = num_tokens * top_k
    if capacity_factor >= num_experts:  # the bound T * K; also spares the float product an overflow
        return slots
    return min(slots, max(min_capacity, math.ceil(capacity_factor * slots / num_experts)))


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
    ``[sum(kept_per_expert_E[:e]), sum(kept_per_expert_E[:e+1]))``. A padded plan (compiled
    graphs, ``meta``) ends with rows of slot -1, which hold zeros."""

    row_of_slot_TK: torch.Tensor
    slot_of_row_N: torch.Tensor
    kept_per_expert_E: torch.Tensor
    routed_per_expert_E: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.row_of_slot_TK.shape[1]

    @property
    def num_rows(self) -> int:
        """Rows of ``slot_of_row_N``, padding included."""
        return self.slot_of_row_N.numel()


def build_dispatch_plan(
    expert_ids_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    priority_order_S: torch.Tensor | None = None,
    kernels: str = "auto",
    padded: bool = False,
    ids_in_range: bool = False,
) -> DispatchPlan:
    """Counting sort of the slots by expert; an expert keeps the first ``capacity`` slots in
    ``priority_order_S`` (default: choice-major, by position). O(S) integer work.

    ``padded``: ``slot_of_row`` gets the most rows the plan can keep (``T*K`` dropless, else
    ``min(T*K, E*capacity)``), so its shape does not depend on the routing (compiled graphs).
    The C++ counting sort on the CPU; on CUDA (and with ``kernels="torch"``) the torch-native
    stable-sort plan, which keeps the plan on the device. ``ids_in_range``: the ids come from a
    router's top-k, so they need no check; a dropless CUDA plan then has no host synchronisation
    (every slot is kept: ``N = T*K``), which keeps the GPU's queue full."""
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None (dropless), got {capacity}")
    tokens, k = expert_ids_TK.shape
    capacity_arg = -1 if capacity is None else capacity
    num_rows = most_kept_rows(tokens, k, num_experts, capacity_arg) if padded else None
    eager_cuda = expert_ids_TK.is_cuda and not torch.compiler.is_compiling()
    if ids_in_range and capacity is None and priority_order_S is None and eager_cuda:
        row_of_slot, slot_of_row, kept, routed = native.build_dispatch_plan(
            expert_ids_TK.contiguous(), None, num_experts, -1, num_rows, ids_in_range=True
        )
        return DispatchPlan(row_of_slot, slot_of_row, kept, routed)
    build = kernel("build_dispatch_plan", expert_ids_TK.device, kernels)
    row_of_slot, slot_of_row, kept, routed = build(
        expert_ids_TK.contiguous(),
        None if priority_order_S is None else priority_order_S.contiguous(),
        num_experts,
        capacity_arg,
        num_rows,
    )
    return DispatchPlan(row_of_slot, slot_of_row, kept, routed)


def permute_tokens(x_TD: torch.Tensor, plan: DispatchPlan, kernels: str = "auto") -> torch.Tensor:
    """Token order -> expert order: ``x_ND[r] = x_TD[slot_of_row[r] // K]`` (differentiable)."""
    permute = kernel("permute_rows", x_TD.device, kernels)
    return permute(x_TD.contiguous(), plan.slot_of_row_N, plan.top_k, None)


def unpermute_tokens(
    y_ND: torch.Tensor, gates_TK: torch.Tensor, plan: DispatchPlan, kernels: str = "auto"
) -> torch.Tensor:
    """Expert order -> token order, weighted: ``y_TD[t] = sum_j gates[t, j] * y_ND[row_of_slot[t, j]]``
    (differentiable in ``y_ND`` and ``gates_TK``; dropped slots contribute 0). The gates are used
    in fp32 (fp64 for fp64 rows), the dtype the sums are formed in."""
    unpermute = kernel("unpermute_rows", y_ND.device, kernels)
    weights_TK = gates_TK.to(accumulate_dtype(y_ND.dtype)).contiguous()
    return unpermute(y_ND.contiguous(), plan.row_of_slot_TK, weights_TK)


class LocalTokenDispatcher:
    """Dispatcher for experts that all live on this rank: permute, then unpermute.

    ``dispatch`` returns the expert-ordered rows, the row count of each local expert ``[E]`` and
    the round (:class:`~moetrain.layers.exchange.DispatchRound`, opened by the dispatcher's
    ``exchanger``); ``combine`` takes the experts' output rows and the round back to token order and
    closes the round. Every exchange of a dispatcher goes through ``exchanger``
    (:mod:`moetrain.layers.exchange`; this one makes none).
    """

    def __init__(self, num_experts: int, kernels: str = "auto", exchanger: Exchanger | None = None):
        self.num_experts = num_experts
        self.kernels = kernels
        self.exchanger = Exchanger() if exchanger is None else exchanger

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchRound]:
        rnd = self.exchanger.new_round(plan)
        return permute_tokens(x_TD, plan, self.kernels), plan.kept_per_expert_E, rnd

    def combine(self, y_ND: torch.Tensor, gates_TK: torch.Tensor, rnd: DispatchRound) -> torch.Tensor:
        return self.exchanger.close(rnd, unpermute_tokens(y_ND, gates_TK, rnd.plan, self.kernels))

    def compute(
        self, x_TD: torch.Tensor, plan: DispatchPlan, gates_TK: torch.Tensor, experts
    ) -> torch.Tensor:
        """dispatch -> ``experts(x_ND, rows_per_expert_E)`` -> combine: the layer's output ``y_TD``."""
        x_ND, rows_per_expert_E, rnd = self.dispatch(x_TD, plan)
        return self.combine(experts(x_ND, rows_per_expert_E), gates_TK, rnd)

    def comm_peak_bytes(self) -> int:
        """Bytes of communication buffers the last forward or backward held at once (none here)."""
        return 0


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    """Expert-parallel dispatcher: permute into global-expert order (which is destination-rank
    order), exchange counts then rows with the EP group, regroup the received rows from
    [source rank][local expert] to [local expert][source rank]; combine undoes each step.

    Legend: P EP ranks, El local experts. A rank whose experts receive nothing still joins every
    exchange (with zero-row splits), so no rank can hang the group. ``dispatch`` and ``combine``
    run eagerly (``@runs_eagerly``, :mod:`moetrain.layers.eager`): a compiled layer breaks its
    graph around the exchanges and nowhere else (the permutations are opaque operators either
    way). ``ParallelConfig.a2a_chunks`` other than 1: :meth:`compute` runs the exchange, the
    experts and the return exchange as one chunked, overlapped pipeline
    (:mod:`moetrain.layers.overlap`) instead of dispatch -> experts -> combine.
    """

    def __init__(self, num_experts: int, parallel, kernels: str = "auto", exchanger: Exchanger | None = None):
        super().__init__(num_experts, kernels, exchanger)
        prepare_eager_methods(type(self))
        self.parallel = parallel
        self.comm_dtype = parallel.config.comm_dtype
        self.comm_kernels = parallel.config.kernels
        self.a2a_chunks = parallel.config.a2a_chunks
        self.last_chunks = 1  # the chunk count of the last forward
        self.last_received = None  # the last chunked forward's received rows, D and element size
        self._overlap: OverlapSettings | None = None  # the last chunked forward's settings
        self._unchunked_bytes = 0
        self._auto_links: dict[str, tuple] = {}  # device type -> (links, EP group layout), for "auto"

    def compute(self, x_TD, plan, gates_TK, experts):
        """With ``a2a_chunks`` other than 1 (eagerly, off ``meta``), the chunked exchange overlapped
        with the experts (:mod:`moetrain.layers.overlap`); otherwise dispatch -> experts -> combine.
        A compiled layer always takes the latter."""
        if self.a2a_chunks == 1 or torch.compiler.is_compiling() or x_TD.device.type == "meta":
            return super().compute(x_TD, plan, gates_TK, experts)
        return self._compute_chunked(x_TD, plan, gates_TK, experts)

    def comm_peak_bytes(self) -> int:
        """Bytes of all-to-all buffers the last forward or backward held at once: measured in the
        buffer pool for a chunked exchange (forward and backward, the larger), modelled for the
        unchunked one (:func:`moetrain.comm.chunking.unchunked_comm_bytes` of its last exchange)."""
        if self._overlap is not None:
            return int(self._overlap.peak_bytes)
        return int(self._unchunked_bytes)

    @runs_eagerly
    def _compute_chunked(self, x_TD, plan, gates_TK, experts):
        exchanger = self.exchanger
        rnd = exchanger.new_round(plan)
        x_ND = permute_tokens(x_TD, plan, self.kernels)
        rnd.recv_counts_PE, rnd.a2a_plan, chunks = exchanger.plans(
            rnd, "chunked counts", lambda: self._chunked_counts(plan, x_ND, experts)
        )
        self.last_chunks = chunks
        # (rows, D, bytes per element) the experts computed: the chunked path never calls the module
        self.last_received = (rnd.a2a_plan.rows_received, x_ND.shape[1], x_ND.element_size())
        chunked = ChunkedExchange(rnd.a2a_plan, chunks)
        self._overlap = OverlapSettings(chunked, self.comm_dtype, comm_buffer_pool())
        y_ND = exchanger.chunked_trip(rnd, x_ND[: rnd.a2a_plan.rows_sent], experts, self._overlap)
        return super().combine(y_ND, gates_TK, rnd)

    def _chunked_counts(self, plan: DispatchPlan, x_ND: torch.Tensor, experts):
        """(``recv_counts_PE``, the exchange plan, the chunk count) of a chunked round: one count
        exchange, which also agrees on the count for ``a2a_chunks="auto"``."""
        kept_PE = plan.kept_per_expert_E.view(self.parallel.ep_size, -1)
        proposal = self._proposed_chunks(kept_PE, x_ND, experts) if self.a2a_chunks == "auto" else None
        recv_counts_PE, a2a_plan, proposals = exchange_counts_and_value(
            kept_PE, self.parallel, self.comm_kernels, proposal
        )
        return recv_counts_PE, a2a_plan, self.a2a_chunks if proposals is None else int(proposals.max())

    def _proposed_chunks(self, kept_PE, x_ND, experts) -> int:
        """This rank's choice for ``a2a_chunks="auto"`` (the EP group takes the largest): the count
        with the least modelled time (:mod:`moetrain.comm.chunk_cost`) for sending the kept rows of
        ``kept_PE [P, E]``, of ``x_ND``'s width and dtype, with the run's links
        (``ParallelConfig.a2a_links``; CPU ranks: the measured gloo fit)."""
        parallel = self.parallel
        if x_ND.device.type not in self._auto_links:  # fixed for the run: worked out once, not per call
            links = run_links(parallel.config.a2a_links, x_ND.device.type)
            self._auto_links[x_ND.device.type] = (
                links.with_ranks_per_node(parallel.local_world_size),
                group_layout(sorted(parallel.ep_ranks), parallel.local_world_size),
            )
        links, layout = self._auto_links[x_ND.device.type]
        row_bytes = wire_row_bytes(x_ND.shape[1], x_ND.dtype, self.comm_dtype)
        cost, expert_s = layer_overlap_inputs(
            links, layout, parallel.all_to_all, int(kept_PE.sum()), row_bytes, x_ND.shape[1],
            experts.w2_EFD.shape[1], experts.activation, links.flops_per_s,
        )  # fmt: skip
        return plan_chunks("auto", cost, expert_s)

    @runs_eagerly
    def dispatch(self, x_TD, plan):
        exchanger = self.exchanger
        rnd = exchanger.new_round(plan)
        x_ND = permute_tokens(x_TD, plan, self.kernels)
        kept_PE = plan.kept_per_expert_E.view(self.parallel.ep_size, -1)
        rnd.recv_counts_PE, rnd.a2a_plan = exchanger.plans(
            rnd, "counts", lambda: exchange_counts(kept_PE, self.parallel, self.comm_kernels)
        )
        x_ND = x_ND[: rnd.a2a_plan.rows_sent]  # a padded plan's zero rows stay here
        received = exchanger.all_to_all(rnd, "received", x_ND, rnd.a2a_plan, self.comm_dtype)
        self._overlap = None
        self._unchunked_bytes = self._modelled_bytes(rnd.a2a_plan, x_ND)
        regrouped = regroup_chunks(received, rnd.recv_counts_PE, self.comm_kernels)  # [expert][source]
        return regrouped, rnd.recv_counts_PE.sum(0), rnd

    @runs_eagerly
    def combine(self, y_ND, gates_TK, rnd):
        returned = regroup_chunks(y_ND, rnd.recv_counts_PE.t().contiguous(), self.comm_kernels)
        y_ND = self.exchanger.all_to_all_reverse(rnd, "returned", returned, rnd.a2a_plan, self.comm_dtype)
        return super().combine(y_ND, gates_TK, rnd)

    def _modelled_bytes(self, plan, x_ND: torch.Tensor) -> int:
        encoded = self.comm_dtype is not None and x_ND.dtype != WIRE_DTYPES[self.comm_dtype]
        row_bytes = wire_row_bytes(x_ND.shape[1], x_ND.dtype, self.comm_dtype)
        return int(
            unchunked_comm_bytes(
                plan.rows_sent * row_bytes, plan.rows_received * row_bytes, plan.stages, encoded
            )
        )
