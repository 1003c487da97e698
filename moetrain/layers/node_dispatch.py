"""Node-deduplicating expert-parallel dispatch (``ParallelConfig.all_to_all = "node_dedup"``).

A token crosses to each node its kept experts are on **once**, however many of its experts live
there, and fans out to them inside the node; on the way back the node sums its experts' outputs,
weighted by their gates, into one partial row per token, which crosses once and is added at the
source. This is DeepSeek-V3's dispatch (its section 3.2.2: a token goes over IB to the GPU with the
same in-node index on each target node, then over NVLink to its experts there); with node-limited
routing (``max_nodes_per_token = M``) a token crosses to at most M nodes (M - 1 other than its own
at best), instead of sending one row per routed slot as the flat and hierarchical all-to-alls do.

Legend: the EP group is a grid of M nodes x L ranks (``ParallelContext.ep_node_grid``; EP rank
``p = m*L + l``), El experts per rank, En = L*El per node (node m holds experts
``[m*En, (m+1)*En)``, local rank l' of it the El after ``l'*El`` of those); T tokens on this
rank, K choices; C copies this rank sends, one per (token, node one of its kept slots is on); R
copies it receives; N rows of its node's slots it keeps for the node; D model dim.

One round at rank (m, l):

1. copies (``copy_plan``, a :class:`~moetrain.layers.dispatch.DispatchPlan` over the M nodes with
   M slots per token): ``x_CD[c] = x_TD[t_c]`` for every pair (t, m') where token t has a slot
   kept by the usual (source-side) capacity cut on node m', ordered [m'][t]; with each copy, the
   node-local expert id of each of its K slots (-1: a slot on another node, or cut).
2. inter-node exchange in ``inter_node_group`` (to rank (m', l)): counts, then the rows (in
   ``comm_dtype``) and their ids (int32) in one message per node
   (:func:`~moetrain.comm.all_to_all.pack_rows`: correct for any row count and row dtype). The own
   node's copies stay on the rank (``all_to_all_single`` to itself: no network).
3. at (m', l): a dropless plan of the received copies' slots over the node's En experts
   (``node_plan``: rows ordered by destination local rank, then expert) expands each copy into one
   row per slot of this node.
4. intra-node exchange in ``intra_node_group`` (counts, then rows), regrouped from [source][expert]
   to [expert][source]: the rows the local experts compute.
5. combine: regroup back, reverse intra-node exchange; the gates of every copy go to (m', l) (an
   inter-node exchange of K floats per copy, in the gates' own dtype: :class:`MoELayer` hands the
   gates to ``combine``, not to ``dispatch``), and the node sums each copy's slots weighted by their
   gates: ``partial_RD[r] = sum_{j on this node} gate[r, j] * y[row(r, j)]`` (``unpermute`` on
   ``node_plan``).
6. reverse inter-node exchange of the partial rows.
7. ``y_TD[t] = sum_{m' reached by t} partial[(t, m')]`` (``unpermute`` on ``copy_plan``, weights 1).

Every step is a differentiable op (the permute/unpermute operators, the row exchanges of
:mod:`moetrain.comm.all_to_all` on a flat plan of a subgroup), so autograd returns the gradients of
the input, the gates (to the source's router) and the experts along the same paths.

**Exactness.** The output sums the same terms ``gate * expert output`` as the flat algorithm, but
in another order (per node, then over nodes), and each node's partial sum is rounded to the row
dtype (and with ``comm_dtype`` to the wire, as are the expert rows on their intra-node hop back:
two roundings on the way back, docs/expert_parallel.md states the bound) before the sum over
nodes: outputs and gradients equal the flat algorithm within floating-point tolerance (fp32: ~1e-7
relative; fp64: ~1e-15), not bit for bit.

**Exchanges.** Every count and row exchange goes through the dispatcher's exchanger
(:mod:`moetrain.layers.exchange`), each under its own name: the count exchanges of steps 2 and 4
(``plans``: the inter-node plan; the node plan and the intra-node plan, which depend on the received
ids) and the row exchanges ``copies``, ``node_rows``, ``node_returned``, ``gates`` and ``partials``.
Recompute replay (:mod:`moetrain.layers.replay`) thereby replays a recorded round without
communicating; its backward communicates the gradients as usual.

**Cost per round**, beside the flat algorithm's one row per kept slot: C copies (one per token
and node reached) cross, plus 8K bytes of ids and gates per copy (fp32 gates; and at most 4 bytes
that align the ids and the next row), and every slot row takes one intra-node hop ((L-1)/L of them
leave the rank), as in the hierarchical all-to-all. Messages: one
inter-node count exchange and three inter-node row exchanges (rows+ids, gates, partial rows) of
M - 1 messages, one intra-node count exchange and two row exchanges of L - 1 messages, per forward;
the backward sends the same rows again (no count exchange).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrain.comm.all_to_all import FlatAllToAllPlan, regroup_chunks
from moetrain.comm.timing import exchange_span
from moetrain.kernels import kernel
from moetrain.layers.dispatch import (
    DispatchPlan,
    LocalTokenDispatcher,
    build_dispatch_plan,
    permute_tokens,
    unpermute_tokens,
)
from moetrain.layers.eager import prepare_eager_methods, runs_eagerly
from moetrain.layers.exchange import Exchanger


@dataclass(eq=False)
class NodeDedupRound:
    """The plans of one dispatch round at rank (m, l) (module docstring): ``copy_plan`` (tokens ->
    copies [node][token]), ``inter_plan`` (copies to and from rank (m', l) of every node),
    ``node_plan`` (received copies -> this node's slots, by destination local rank then expert),
    ``intra_plan`` (slot rows to and from the node's ranks) and ``recv_counts_LE[l', e]``: rows
    from local rank l' for local expert e."""

    node: int
    copy_plan: DispatchPlan
    inter_plan: FlatAllToAllPlan
    node_plan: DispatchPlan
    intra_plan: FlatAllToAllPlan
    recv_counts_LE: torch.Tensor

    @property
    def copies_per_node(self) -> list[int]:
        """Copies this rank sends to each node ``[M]`` (its own node's stay on the rank)."""
        return list(self.inter_plan.send)

    @property
    def cross_node_copies(self) -> int:
        """Copies this rank sends to other nodes: its token rows that cross nodes, each way."""
        return sum(n for m, n in enumerate(self.inter_plan.send) if m != self.node)


def plan_of_real_slots(ids_TK: torch.Tensor, experts: int, kernels: str = "auto") -> DispatchPlan:
    """Dropless :class:`DispatchPlan` of the slots with ``ids_TK < experts``; slots whose id is the
    spare value ``experts`` go nowhere (``row_of_slot`` -1, as a cut slot). One counting sort over
    ``experts + 1`` experts whose last one (the spare's rows, at the end of the order) is cut off."""
    full = build_dispatch_plan(ids_TK, experts + 1, None, None, kernels)
    kept_E = full.kept_per_expert_E[:experts]
    rows = int(kept_E.sum())
    row_of_slot_TK = torch.where(ids_TK < experts, full.row_of_slot_TK, -1)
    return DispatchPlan(row_of_slot_TK, full.slot_of_row_N[:rows], kept_E, full.routed_per_expert_E[:experts])


def expert_of_slots(plan: DispatchPlan) -> torch.Tensor:
    """``expert_TK[t, j]``: the expert of slot (t, j) if the plan kept it, else ``E`` (the plan's
    expert count): expert e owns rows ``[sum(kept[:e]), sum(kept[:e+1]))``."""
    experts = plan.kept_per_expert_E.numel()
    device = plan.row_of_slot_TK.device
    expert_of_row_N = torch.repeat_interleave(torch.arange(experts, device=device), plan.kept_per_expert_E)
    spare_N1 = torch.full((1,), experts, dtype=expert_of_row_N.dtype, device=device)
    expert_of_row_N = torch.cat([expert_of_row_N, spare_N1])  # row -1 (a cut slot) reads the spare
    return expert_of_row_N[plan.row_of_slot_TK]


def copies_of_tokens(
    plan: DispatchPlan, nodes: int, kernels: str = "auto"
) -> tuple[DispatchPlan, torch.Tensor]:
    """(``copy_plan``, ``ids_CK``) of step 1 (module docstring) from the source's dispatch plan over
    ``E`` experts laid out node-major over ``nodes`` nodes. ``copy_plan`` has ``nodes`` slots per
    token, slot (t, m') kept iff token t has a kept slot on node m'; its rows (the copies) are
    ordered [m'][t], ``kept_per_expert_E`` counting them per node. ``ids_CK[c, j]``: the node-local
    expert of slot j of copy c's token if that slot is kept and on copy c's node, else -1."""
    tokens, _ = plan.row_of_slot_TK.shape
    experts = plan.kept_per_expert_E.numel()
    per_node = experts // nodes
    device = plan.row_of_slot_TK.device
    expert_TK = expert_of_slots(plan)
    node_TK = expert_TK // per_node  # cut slots: `nodes`, the spare
    reach_TN = torch.zeros(tokens, nodes + 1, dtype=torch.bool, device=device).scatter_(1, node_TK, True)
    node_ids_TN = torch.where(reach_TN[:, :nodes], torch.arange(nodes, device=device), nodes)
    copy_plan = plan_of_real_slots(node_ids_TN, nodes, kernels)
    token_C, node_C = copy_plan.slot_of_row_N // nodes, copy_plan.slot_of_row_N % nodes
    local_CK = expert_TK.index_select(0, token_C) - node_C.unsqueeze(1) * per_node
    on_node_CK = node_TK.index_select(0, token_C) == node_C.unsqueeze(1)
    return copy_plan, torch.where(on_node_CK, local_CK, -1)


def exchange_counts_in(send_AE: torch.Tensor, group, kernels: str = "auto"):
    """``send_AE[a, e]``: rows for expert (or bucket) e of member a of ``group`` -> (``recv_AE[a, e]``,
    rows from member a for this rank's e; the flat row plan of that group). The exchange is timed as
    phase ``all_to_all`` (:func:`moetrain.comm.timing.exchange_span`): it is where a rank waits for
    slower ones."""
    send_AE = send_AE.to(torch.int64).contiguous()
    recv_AE = torch.empty_like(send_AE)
    with exchange_span():
        dist.all_to_all_single(recv_AE, send_AE, group=group)
    return recv_AE, FlatAllToAllPlan(send_AE, recv_AE, group, kernels)


class NodeDedupTokenDispatcher(LocalTokenDispatcher):
    """Expert-parallel dispatcher of ``all_to_all="node_dedup"`` (module docstring): ``dispatch``
    returns the rows of this rank's experts ordered [local expert][source local rank], the row
    count of each local expert and the round (its ``a2a_plan`` a :class:`NodeDedupRound`);
    ``combine`` returns ``y_TD``. Like
    :class:`~moetrain.layers.dispatch.AllToAllTokenDispatcher`, both run eagerly under
    ``torch.compile`` (``@runs_eagerly``) and every rank joins every exchange, rows or none."""

    def __init__(self, num_experts: int, parallel, kernels: str = "auto", exchanger: Exchanger | None = None):
        super().__init__(num_experts, kernels, exchanger)
        if parallel.ep_node_grid is None or parallel.inter_node_group is None:
            raise ValueError(
                "all_to_all = 'node_dedup' needs a node grid and its node groups (ParallelContext with "
                f"all_to_all='node_dedup' on a regular layout), got {parallel!r}"
            )
        self.parallel = parallel
        self.nodes, self.per_node = parallel.ep_node_grid
        self.node = parallel.ep_rank // self.per_node
        self.local_experts = num_experts // parallel.ep_size
        self.comm_dtype = parallel.config.comm_dtype
        self.comm_kernels = parallel.config.kernels
        self.last_round_rows = (0, 0, 0)  # copies sent, copies received, node rows held: the last round's
        prepare_eager_methods(type(self))

    @runs_eagerly
    def dispatch(self, x_TD, plan):
        exchanger, wire = self.exchanger, self.comm_dtype
        rnd = exchanger.new_round(plan)
        copy_plan, ids_CK = copies_of_tokens(plan, self.nodes, self.kernels)
        inter_plan = exchanger.plans(rnd, "inter-node counts", lambda: self._inter_node_plan(copy_plan))
        x_CD = permute_tokens(x_TD, copy_plan, self.kernels)
        x_RD, ids_RK = exchanger.all_to_all_with_ids(rnd, "copies", x_CD, ids_CK, inter_plan, wire)
        node_plan, recv_counts_LE, intra_plan = exchanger.plans(
            rnd, "node rows", lambda: self._node_rows_plans(ids_RK)
        )
        x_ND = permute_tokens(x_RD, node_plan, self.kernels)
        # [source local rank][expert]
        received = exchanger.all_to_all(rnd, "node_rows", x_ND, intra_plan, wire)
        rnd.a2a_plan = NodeDedupRound(self.node, copy_plan, inter_plan, node_plan, intra_plan, recv_counts_LE)
        self.last_round_rows = (inter_plan.rows_sent, sum(inter_plan.recv), node_plan.num_rows)
        regrouped = regroup_chunks(received, recv_counts_LE, self.comm_kernels)  # [expert][source]
        return regrouped, recv_counts_LE.sum(0), rnd

    def _inter_node_plan(self, copy_plan: DispatchPlan) -> FlatAllToAllPlan:
        """The plan of step 2 (module docstring): the copies to each node, after a count exchange."""
        counts_M1 = copy_plan.kept_per_expert_E.view(-1, 1)
        return exchange_counts_in(counts_M1, self.parallel.inter_node_group, self.comm_kernels)[1]

    def _node_rows_plans(self, ids_RK: torch.Tensor):
        """(``node_plan``, ``recv_counts_LE``, ``intra_plan``) of steps 3-4 (module docstring) from
        the received copies' node-local expert ids ``ids_RK`` (-1: not on this node)."""
        per_node_experts = self.per_node * self.local_experts
        node_plan = plan_of_real_slots(
            torch.where(ids_RK >= 0, ids_RK, per_node_experts), per_node_experts, self.kernels
        )
        recv_counts_LE, intra_plan = exchange_counts_in(
            node_plan.kept_per_expert_E.view(self.per_node, self.local_experts),
            self.parallel.intra_node_group,
            self.comm_kernels,
        )
        return node_plan, recv_counts_LE, intra_plan

    @runs_eagerly
    def combine(self, y_ND, gates_TK, rnd):
        exchanger, wire, round_plans = self.exchanger, self.comm_dtype, rnd.a2a_plan
        returned = regroup_chunks(y_ND, round_plans.recv_counts_LE.t().contiguous(), self.comm_kernels)
        gates_CK = permute_tokens(gates_TK, round_plans.copy_plan, self.kernels)
        y_node = exchanger.all_to_all_reverse(rnd, "node_returned", returned, round_plans.intra_plan, wire)
        # the gates travel uncompressed: K numbers per copy
        gates_RK = exchanger.all_to_all(rnd, "gates", gates_CK, round_plans.inter_plan, None)
        partial_RD = unpermute_tokens(y_node, gates_RK, round_plans.node_plan, self.kernels)
        partial_CD = exchanger.all_to_all_reverse(rnd, "partials", partial_RD, round_plans.inter_plan, wire)
        unpermute = kernel("unpermute_rows", partial_CD.device, self.kernels)
        y_TD = unpermute(partial_CD.contiguous(), round_plans.copy_plan.row_of_slot_TK, None)
        return exchanger.close(rnd, y_TD)
