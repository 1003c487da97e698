"""Autograd-aware all-to-all with uneven splits: flat, and hierarchical (2-D).

Legend: P ranks in the expert-parallel group, numbered node-major as p = m * L + l (M nodes, L
ranks of the group per node); El experts per rank.

A plan is built once per dispatch from the per-expert row counts (``exchange_counts``, which
also tells every rank how many rows it will receive from each source for each local expert);
``plan.exchange(x)`` sends rows grouped by destination rank and returns rows grouped by source
rank; ``plan.reverse(y)`` is its exact inverse (the backward pass, and the return trip of combine).

Flat: one ``all_to_all_single`` in the EP group: P - 1 messages per rank.
Hierarchical (Tutel's 2-D algorithm): rows for destination (m', l') go first to this node's rank
l' (intra-node all-to-all, L - 1 messages), are regrouped by destination node (a C++ chunk
transpose), then travel to node m' among the ranks with local index l' (inter-node all-to-all,
M - 1 messages): L + M - 2 messages instead of P - 1, each inter-node message L times larger.

Rows of several tensors that travel together (node_dedup's rows and slot ids) are packed into one
byte message by :func:`pack_rows`: a fresh, standard-strided byte tensor whose fields sit at
offsets aligned to their element size, so the dtype views that fill and read it are valid for any
row count (0 and 1 included) and any dtype. Everything else moves tensors in their own dtype and
takes no dtype view of a caller's tensor (the chunked exchange's pool buffers are fresh 1-D byte
tensors viewed from offset 0: :mod:`moetrain.comm.buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from moetrain.comm.compression import decode_rows, encode_rows
from moetrain.comm.timing import exchange_span
from moetrain.kernels import kernel


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out, x = x.new_empty((sum(recv), *x.shape[1:])), x.contiguous()
    with exchange_span():
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def packed_row_layout(fields: Sequence[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Where the fields ``(dtype, width)`` of one packed row lie: ``(byte offset of each field, bytes
    per row)``. Field i starts at the first multiple of its element size at or after the end of field
    i - 1, and the row is rounded up to the largest element size, so in a ``[N, row bytes]`` byte
    tensor with the standard strides every field of every row starts at a multiple of its element
    size (the padding bytes are zeros)."""
    offsets, end, align = [], 0, 1
    for dtype, width in fields:
        size = dtype.itemsize
        offsets.append(-(-end // size) * size)
        end = offsets[-1] + width * size
        align = max(align, size)
    return offsets, -(-end // align) * align


def _field(packed_NB: torch.Tensor, offset: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """``[N, width]`` ``dtype`` view of the bytes ``[offset, offset + width * size)`` of every row of a
    standard-strided, aligned ``packed_NB`` (what :func:`pack_rows` builds and :func:`unpack_rows`
    reads): its row stride, offset and length are multiples of the element size by construction."""
    return packed_NB[:, offset : offset + width * dtype.itemsize].view(dtype)


def pack_rows(fields_N: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows of several tensors ``[N, W_i]`` (any dtypes, any strides, N >= 0) -> one message
    ``[N, B]`` of bytes whose row n holds row n of every field (:func:`packed_row_layout`), so that
    one all-to-all moves them together. The message is a fresh byte tensor with the standard strides
    and each field is copied into its aligned slice of it: no dtype view is ever taken of a caller's
    tensor, whose strides (a 0- or 1-row tensor counts as contiguous whatever its strides, so
    ``.contiguous()`` keeps them) or storage offset could forbid one."""
    rows, device = fields_N[0].shape[0], fields_N[0].device
    offsets, row_bytes = packed_row_layout([(f.dtype, f.shape[1]) for f in fields_N])
    used = sum(f.shape[1] * f.dtype.itemsize for f in fields_N)
    make = torch.empty if used == row_bytes else torch.zeros  # padding bytes travel as zeros
    packed_NB = make((rows, row_bytes), dtype=torch.uint8, device=device)
    for field, offset in zip(fields_N, offsets, strict=True):
        if field.shape[0] != rows:
            raise ValueError(f"pack_rows: fields of {rows} and {field.shape[0]} rows")
        _field(packed_NB, offset, field.dtype, field.shape[1]).copy_(field)
    return packed_NB


def unpack_rows(packed_NB: torch.Tensor, fields: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`: the fields ``(dtype, width)`` of a message ``[N, B]`` (as
    received: any strides or storage offset), each a fresh contiguous ``[N, width]`` tensor,
    bit-exact."""
    offsets, row_bytes = packed_row_layout(fields)
    rows = packed_NB.shape[0]
    if packed_NB.dtype != torch.uint8 or packed_NB.dim() != 2 or packed_NB.shape[1] != row_bytes:
        raise ValueError(
            f"unpack_rows: expected a uint8 message [N, {row_bytes}], got {packed_NB.dtype} "
            f"{tuple(packed_NB.shape)}"
        )
    align = max((dtype.itemsize for dtype, _ in fields), default=1)
    if packed_NB.is_contiguous() and packed_NB.storage_offset() % align == 0:
        # the same bytes with the standard strides (a 0- or 1-row tensor may carry others)
        packed_NB = packed_NB.as_strided((rows, row_bytes), (row_bytes, 1))
    else:
        fresh_NB = torch.empty((rows, row_bytes), dtype=torch.uint8, device=packed_NB.device)
        packed_NB = fresh_NB.copy_(packed_NB)
    return [
        _field(packed_NB, offset, dtype, width).clone(memory_format=torch.contiguous_format)
        for (dtype, width), offset in zip(fields, offsets, strict=True)
    ]


def transpose_chunks(x: torch.Tensor, sizes_AB: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """Rows stored as chunks [a][b] (``sizes_AB[a, b]`` rows each) -> the same chunks in [b][a] order
    (differentiable: the gradient takes the transposed trip).

    CPU rows use ``csrc/a2a_layout.cpp`` (``sizes_AB`` on the CPU); CUDA rows use
    ``csrc/a2a_layout_cuda.cu``, with ``sizes_AB`` on the CPU or on the rows' GPU (offsets are computed on
    the device, no synchronisation); ``kernels="torch"``: one ``index_select``."""
    return kernel("transpose_chunks", x.device, kernels)(x.contiguous(), sizes_AB.contiguous())


class Stage(NamedTuple):
    """One all-to-all of a trip: the rows' chunks are first transposed by ``transpose_sizes`` (None:
    taken as they are), then ``send[i]`` rows go to and ``recv[i]`` rows come from member i of
    ``group``."""

    transpose_sizes: torch.Tensor | None
    send: list[int]
    recv: list[int]
    group: object


class FlatAllToAllPlan:
    """One ``all_to_all_single`` in the EP group. ``send_counts_PE`` / ``recv_counts_PE`` (rows to /
    from each EP rank's local experts) are kept for the chunked exchange
    (:mod:`moetrain.comm.overlap`)."""

    stages = 1

    def __init__(
        self, send_counts_PE: torch.Tensor, recv_counts_PE: torch.Tensor, group, kernels: str = "auto"
    ):
        self.send_counts_PE, self.recv_counts_PE = send_counts_PE, recv_counts_PE
        self.send = send_counts_PE.sum(1).tolist()
        self.recv = recv_counts_PE.sum(1).tolist()
        self.group = group
        self.kernels = kernels

    @property
    def rows_sent(self) -> int:
        return sum(self.send)

    @property
    def rows_received(self) -> int:
        return sum(self.recv)

    def chunk(self, split) -> FlatAllToAllPlan:
        """The plan of one chunk: ``split(counts)`` gives the chunk's share of every block."""
        send, recv = split(self.send_counts_PE), split(self.recv_counts_PE)
        return FlatAllToAllPlan(send, recv, self.group, self.kernels)

    def steps(self, forward_direction: bool) -> tuple[list[Stage], torch.Tensor | None]:
        """The trip as stages, and the chunk sizes of a last transpose (None: none)."""
        if forward_direction:
            return [Stage(None, self.send, self.recv, self.group)], None
        return [Stage(None, self.recv, self.send, self.group)], None

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        return _all_to_all(x, self.send, self.recv, self.group)

    def reverse(self, y: torch.Tensor) -> torch.Tensor:
        return _all_to_all(y, self.recv, self.send, self.group)


class HierarchicalAllToAllPlan:
    """Stage sizes: ``send_ML[m', l']`` rows to each destination; after the intra-node stage this
    rank holds ``stage1_LM[l, m']`` rows from local source l for destination node m'; after the
    inter-node stage, ``stage2_ML[m, l]`` rows from source rank (m, l). Each is the sum over experts
    of a per-expert tensor (``send_MLE``, ``stage1_LME``, ``stage2_MLE``) whose every entry is one
    block of rows from one rank to one expert; those are kept for the chunked exchange."""

    stages = 2

    def __init__(
        self,
        send_MLE: torch.Tensor,
        stage1_LME: torch.Tensor,
        stage2_MLE: torch.Tensor,
        intra,
        inter,
        kernels: str = "auto",
    ):
        self.send_MLE, self.stage1_LME, self.stage2_MLE = send_MLE, stage1_LME, stage2_MLE
        self.send_ML, self.stage1_LM = send_MLE.sum(-1), stage1_LME.sum(-1)
        self.stage2_ML = stage2_MLE.sum(-1)
        self.intra, self.inter = intra, inter
        self.kernels = kernels
        self.intra_send = self.send_ML.sum(0).tolist()  # to local rank l'
        self.intra_recv = self.stage1_LM.sum(1).tolist()  # from local rank l
        self.inter_send = self.stage1_LM.sum(0).tolist()  # to node m'
        self.inter_recv = self.stage2_ML.sum(1).tolist()  # from node m

    @property
    def rows_sent(self) -> int:
        return sum(self.intra_send)

    @property
    def rows_received(self) -> int:
        return sum(self.inter_recv)

    @property
    def send_counts_PE(self) -> torch.Tensor:
        return self.send_MLE.reshape(-1, self.send_MLE.shape[-1])

    @property
    def recv_counts_PE(self) -> torch.Tensor:
        return self.stage2_MLE.reshape(-1, self.stage2_MLE.shape[-1])

    def chunk(self, split) -> HierarchicalAllToAllPlan:
        """The plan of one chunk: ``split(counts)`` gives the chunk's share of every block (each
        stage-1 block is a block the source split the same way)."""
        return HierarchicalAllToAllPlan(
            split(self.send_MLE),
            split(self.stage1_LME),
            split(self.stage2_MLE),
            self.intra,
            self.inter,
            self.kernels,
        )

    def steps(self, forward_direction: bool) -> tuple[list[Stage], torch.Tensor | None]:
        """Forward: [m'][l'] -> [l'][m'], intra-node stage, -> [m'][l], inter-node stage. Reverse: the
        inter-node stage, -> [l][m'], intra-node stage, then a last transpose -> [m'][l']."""
        if forward_direction:
            return [
                Stage(self.send_ML, self.intra_send, self.intra_recv, self.intra),
                Stage(self.stage1_LM, self.inter_send, self.inter_recv, self.inter),
            ], None
        return [
            Stage(None, self.inter_recv, self.inter_send, self.inter),
            Stage(self.stage1_LM.t(), self.intra_recv, self.intra_send, self.intra),
        ], self.send_ML.t()

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        x_LM = transpose_chunks(x, self.send_ML, self.kernels)  # [m'][l'] -> [l'][m']
        y_LM = _all_to_all(x_LM, self.intra_send, self.intra_recv, self.intra)  # [src l][dst m']
        x_ML = transpose_chunks(y_LM, self.stage1_LM, self.kernels)  # -> [dst m'][src l]
        return _all_to_all(x_ML, self.inter_send, self.inter_recv, self.inter)  # [src m][src l]

    def reverse(self, y: torch.Tensor) -> torch.Tensor:
        x_ML = _all_to_all(y, self.inter_recv, self.inter_send, self.inter)
        y_LM = transpose_chunks(x_ML, self.stage1_LM.t(), self.kernels)
        x_LM = _all_to_all(y_LM, self.intra_recv, self.intra_send, self.intra)
        return transpose_chunks(x_LM, self.send_ML.t(), self.kernels)


def exchange_counts(
    send_counts_PE: torch.Tensor, ctx, kernels: str = "auto"
) -> tuple[torch.Tensor, FlatAllToAllPlan | HierarchicalAllToAllPlan]:
    """Exchanges per-expert row counts in the EP group and builds the rows' plan.

    ``send_counts_PE[p, e]``: rows this rank sends to local expert e of EP rank p. Returns
    ``recv_counts_PE[p, e]`` (rows from EP rank p for this rank's local expert e) and the plan.
    The counts travel by the same algorithm as the rows (one small message per stage).
    """
    recv_counts_PE, plan, _ = exchange_counts_and_value(send_counts_PE, ctx, kernels, None)
    return recv_counts_PE, plan


def exchange_counts_and_value(
    send_counts_PE: torch.Tensor, ctx, kernels: str = "auto", value: int | None = None
) -> tuple[torch.Tensor, FlatAllToAllPlan | HierarchicalAllToAllPlan, torch.Tensor | None]:
    """:func:`exchange_counts`, and ``value`` (an integer, or None) sent along with the counts to
    every EP rank: the third result is the value of each EP rank ``[P]`` (None without one). Every
    rank sends to every rank, so all ranks learn all values: a decision made from them (their
    maximum, say) is the same on every rank, at the cost of one more integer per message."""
    send_counts_PE = send_counts_PE.to(torch.int64).contiguous()
    ranks, experts = send_counts_PE.shape
    if value is not None:
        column = torch.full((ranks, 1), int(value), dtype=torch.int64, device=send_counts_PE.device)
        send_counts_PE = torch.cat([send_counts_PE, column], 1)
    width = send_counts_PE.shape[1]
    if ctx.all_to_all == "flat":
        received_PE = _all_to_all(send_counts_PE.view(-1), [width] * ranks, [width] * ranks, ctx.ep_group)
        received_PE = received_PE.view(ranks, width)
        recv_counts_PE = received_PE[:, :experts].contiguous()
        plan = FlatAllToAllPlan(
            send_counts_PE[:, :experts].contiguous(), recv_counts_PE, ctx.ep_group, kernels
        )
        return recv_counts_PE, plan, None if value is None else received_PE[:, experts]
    nodes, per_node = ctx.ep_node_grid
    send_MLE = send_counts_PE.view(nodes, per_node, width)
    stage1_send = send_MLE.transpose(0, 1).contiguous().view(-1)  # [l'][m'][e]
    block = nodes * width
    stage1_LME = _all_to_all(stage1_send, [block] * per_node, [block] * per_node, ctx.intra_node_group)
    stage1_LME = stage1_LME.view(per_node, nodes, width)
    stage2_send = stage1_LME.transpose(0, 1).contiguous().view(-1)  # [m'][l][e]
    block = per_node * width
    stage2_MLE = _all_to_all(stage2_send, [block] * nodes, [block] * nodes, ctx.inter_node_group)
    stage2_MLE = stage2_MLE.view(nodes, per_node, width)
    plan = HierarchicalAllToAllPlan(
        send_MLE[..., :experts].contiguous(),
        stage1_LME[..., :experts].contiguous(),
        stage2_MLE[..., :experts].contiguous(),
        ctx.intra_node_group,
        ctx.inter_node_group,
        kernels,
    )
    values = None if value is None else stage2_MLE[..., experts].reshape(ranks)
    return plan.recv_counts_PE, plan, values


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan, comm_dtype: str | None, forward_direction: bool) -> torch.Tensor:
        ctx.plan, ctx.comm_dtype, ctx.forward_direction = plan, comm_dtype, forward_direction
        move = plan.exchange if forward_direction else plan.reverse
        wire = encode_rows(x, comm_dtype, plan.kernels)
        return decode_rows(move(wire), comm_dtype, x.dtype, plan.kernels)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _move_gradient(ctx, grad), None, None, None


def _move_gradient(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The backward of an exchange: the opposite trip, in the same wire precision."""
    move = ctx.plan.reverse if ctx.forward_direction else ctx.plan.exchange
    wire = encode_rows(grad.contiguous(), ctx.comm_dtype, ctx.plan.kernels)
    return decode_rows(move(wire), ctx.comm_dtype, grad.dtype, ctx.plan.kernels)


class _ExchangeWithIds(torch.autograd.Function):
    """Rows (in ``comm_dtype``) and their int32 ids in one message per peer (:func:`pack_rows`: each
    row's bytes, its ids at the next multiple of 4 bytes, the row padded to the larger element
    size); differentiable in the rows (the gradient takes the reverse trip, as :func:`all_to_all`'s)."""

    @staticmethod
    def forward(ctx, x_CD: torch.Tensor, ids_CK: torch.Tensor, plan, comm_dtype):
        ctx.plan, ctx.comm_dtype, ctx.forward_direction = plan, comm_dtype, True
        wire_CW = encode_rows(x_CD, comm_dtype, plan.kernels)
        fields = [(wire_CW.dtype, wire_CW.shape[1]), (torch.int32, ids_CK.shape[1])]
        packed_CB = pack_rows([wire_CW, ids_CK.to(torch.int32)])  # any row count, any row dtype
        wire_RW, ids_RK = unpack_rows(plan.exchange(packed_CB), fields)
        ids_RK = ids_RK.to(torch.int64)
        ctx.mark_non_differentiable(ids_RK)
        return decode_rows(wire_RW, comm_dtype, x_CD.dtype, plan.kernels), ids_RK

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor, _grad_ids):
        return _move_gradient(ctx, grad_RD), None, None, None


def all_to_all_with_ids(
    x_CD: torch.Tensor, ids_CK: torch.Tensor, plan, comm_dtype: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`all_to_all` of the rows ``x_CD`` together with integer ids ``ids_CK`` (``[C, K]``, K
    per row) in one message per peer -> (``x_RD``, ``ids_RK`` int64). Differentiable in the rows."""
    return _ExchangeWithIds.apply(x_CD, ids_CK, plan, comm_dtype)


class _ReplayedExchange(torch.autograd.Function):
    """Forward returns rows recorded by an earlier identical exchange (no communication); backward
    communicates the gradient exactly as :class:`_Exchange` does. Used when a checkpointed block
    is recomputed, so recompute never re-communicates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recorded: torch.Tensor, plan, comm_dtype, forward_direction: bool):
        ctx.plan, ctx.comm_dtype, ctx.forward_direction = plan, comm_dtype, forward_direction
        return recorded.view_as(recorded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _move_gradient(ctx, grad), None, None, None, None


def replay_all_to_all(x: torch.Tensor, recorded: torch.Tensor, plan, comm_dtype=None, forward_direction=True):
    """Differentiable stand-in for :func:`all_to_all` (or its reverse) whose output was recorded."""
    return _ReplayedExchange.apply(x, recorded, plan, comm_dtype, forward_direction)


def all_to_all(x: torch.Tensor, plan, comm_dtype: str | None = None) -> torch.Tensor:
    """Rows grouped by destination rank -> rows grouped by source rank (differentiable; the chunk
    transposes and codecs use the kernels the plan was built with)."""
    return _Exchange.apply(x, plan, comm_dtype, True)


def all_to_all_reverse(y: torch.Tensor, plan, comm_dtype: str | None = None) -> torch.Tensor:
    """The return trip of :func:`all_to_all` (differentiable)."""
    return _Exchange.apply(y, plan, comm_dtype, False)


def regroup_chunks(x: torch.Tensor, sizes_AB: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """:func:`transpose_chunks` of the layer's rows: [source rank][expert] -> [expert][source rank],
    say (differentiable)."""
    return transpose_chunks(x, sizes_AB, kernels)
