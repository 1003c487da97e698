"""Exchange -> experts -> return exchange in chunks, communication overlapped with the experts.

Legend: P EP ranks, E local experts, n chunks, ``N_s`` rows this rank sends (permuted, grouped by
destination rank then expert: ``[p][e]``), ``N_r`` rows it receives (``[e][p]`` once regrouped:
the unchunked expert order), D model dim.

Chunk c takes the c-th share of every (rank, expert) block (:mod:`moetrain.comm.chunking`), so its
rows for expert e are a subset of e's rows, in order. One autograd function spans the whole trip:

- forward, per chunk (scheduled by :func:`moetrain.comm.overlap.run_pipeline`, chunk c + 1 travels
  while chunk c is computed and c - 1 returns): receive, regroup ``[p][e] -> [e][p]``, the experts
  (the phases of :class:`~moetrain.layers.experts.ExpertRowMath`, the experts' own math, whose rows
  do not depend on the call), regroup back, return;
- backward, mirrored: the output gradient's chunk travels, the experts' backward to their inputs
  runs on it, its result returns; the weight gradients are computed once, over all rows in the
  unchunked order, after the last chunk (while its return travels).

The rows the experts need again (inputs, hidden rows, activations, and in the backward the
gradients for the weights) are kept in buffers of all ``N_r`` rows in the unchunked order, so the
weight-gradient GEMMs see exactly the matrices of the unchunked layer: outputs and every gradient are
bit-identical to ``a2a_chunks = 1`` (on the CPU, in fp32 and fp64, with every wire dtype; see
``tests/distributed/test_a2a_chunks.py``). A forward given the rows of an earlier identical trip
(:class:`TripRows`: the received rows, i.e. the experts' input buffer, and the returned rows)
computes the experts again and communicates nothing; given an empty :class:`TripRows`, it fills it
(recompute replay, :mod:`moetrain.layers.replay`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.comm.all_to_all import regroup_chunks
from moetrain.comm.buffers import CommBufferPool
from moetrain.comm.chunking import chunk_major_order, split_counts
from moetrain.comm.overlap import Trip, encode_into, run_pipeline
from moetrain.layers.expert_math import ExpertActivations, row_offsets


class ChunkedExchange:
    """The chunks of one dispatch: per chunk the exchange plan, the ``[P, E]`` block sizes it
    receives, the rows of the send buffer it takes (``send_index``) and the positions its regrouped
    rows hold in the unchunked expert order (``recv_index``)."""

    def __init__(self, plan, chunks: int):
        self.plan, self.chunks, self.stages = plan, chunks, plan.stages
        send_PE, recv_PE = plan.send_counts_PE, plan.recv_counts_PE
        send_order, send_rows = chunk_major_order(send_PE, chunks)  # blocks [p][e]
        recv_order, recv_rows = chunk_major_order(recv_PE.t(), chunks)  # blocks [e][p]
        self.send_index = _pieces(send_order, send_rows)
        self.recv_index = _pieces(recv_order, recv_rows)
        self.plans = [plan.chunk(lambda t, c=c: split_counts(t, chunks, c)) for c in range(chunks)]
        self.recv_PE = [split_counts(recv_PE, chunks, c) for c in range(chunks)]
        self.offsets = [row_offsets(counts.sum(0).tolist()) for counts in self.recv_PE]
        self.full_offsets = row_offsets(recv_PE.sum(0).tolist())
        self.rows_sent, self.rows_received = plan.rows_sent, plan.rows_received


def _pieces(order: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for count in rows:
        out.append(order[start : start + count])
        start += count
    return out


class OverlapSettings:
    """What a dispatcher's chunked trips need besides tensors: the chunks, the wire format and the
    pool; ``peak_bytes`` is measured into it."""

    def __init__(self, chunks: ChunkedExchange, comm_dtype, pool):
        self.chunks, self.comm_dtype, self.pool = chunks, comm_dtype, pool
        self.peak_bytes = 0  # most pool bytes held by this layer's forward or backward


@dataclass(eq=False)
class TripRows:
    """The rows one chunked trip delivered: ``received_ND`` (``N_r`` rows, the unchunked expert
    order) and ``returned_ND`` (``N_s`` rows, send order); both None until a trip fills them."""

    received_ND: torch.Tensor | None = None
    returned_ND: torch.Tensor | None = None


def _measure(pool: CommBufferPool):
    pool.reset_peak()
    return pool.in_use


class _ChunkedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w1_EDF, w2_EFD, b1_EF, b2_ED, settings: OverlapSettings, math, rows):
        chunks, pool = settings.chunks, settings.pool
        weights = (w1_EDF, w2_EFD, b1_EF, b2_ED)
        d_model, received = x_ND.shape[1], chunks.rows_received
        reused = rows is not None and rows.received_ND is not None
        x_full = rows.received_ND if reused else x_ND.new_empty(received, d_model)
        kept = math.new_activations(received, weights, x_ND)

        def experts(c: int, x_c: torch.Tensor) -> torch.Tensor:
            y_c, saved = math.forward(x_c, weights, chunks.offsets[c])
            math.keep_activations(kept, chunks.recv_index[c], saved)
            return y_c

        if reused:  # an earlier trip's rows: compute the experts again, communicate nothing
            for c in range(chunks.chunks):
                experts(c, x_full.index_select(0, chunks.recv_index[c]))
            y_ND = rows.returned_ND.view_as(rows.returned_ND)
        else:
            y_ND = x_ND.new_empty(chunks.rows_sent, d_model)
            base = _measure(pool)

            def receive(c, rows):
                x_c = regroup_chunks(rows, chunks.recv_PE[c], chunks.plan.kernels)  # -> [e][p]
                x_full.index_copy_(0, chunks.recv_index[c], x_c)
                return x_c

            def compute(c, x_c):
                return regroup_chunks(experts(c, x_c), chunks.recv_PE[c].t(), chunks.plan.kernels)

            _run(ctx, settings, x_ND, y_ND, receive, compute, None)
            settings.peak_bytes = max(settings.peak_bytes, pool.peak - base)
            if rows is not None:
                rows.received_ND, rows.returned_ND = x_full.detach(), y_ND.detach()
        ctx.settings, ctx.math = settings, math
        ctx.save_for_backward(x_full, kept.h_PF2, kept.a_PF, kept.s_PF, w1_EDF, w2_EFD)
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        settings, math = ctx.settings, ctx.math
        chunks, pool = settings.chunks, settings.pool
        x_full, h_full, a_full, s_full, w1_EDF, w2_EFD = ctx.saved_tensors
        weights = (w1_EDF, w2_EFD, None, None)
        grad_y_ND = grad_y_ND.contiguous()
        received, d_model = x_full.shape
        grad_y_full = grad_y_ND.new_empty(received, d_model)
        grad_h_full = grad_y_ND.new_empty(received, h_full.shape[1])
        grad_x_ND = grad_y_ND.new_empty(chunks.rows_sent, d_model)
        weight_grads: list = []

        def receive(c, rows):
            g_c = regroup_chunks(rows, chunks.recv_PE[c], chunks.plan.kernels)
            grad_y_full.index_copy_(0, chunks.recv_index[c], g_c)
            return g_c

        def compute(c, g_c):
            index = chunks.recv_index[c]
            saved = math.chunk_activations(ExpertActivations(h_full, a_full, s_full), index)
            grad_x_c, grad_h_pad = math.input_grad(g_c, saved, weights, chunks.offsets[c])
            grad_h_full.index_copy_(0, index, grad_h_pad[: g_c.shape[0]])
            return regroup_chunks(grad_x_c, chunks.recv_PE[c].t(), chunks.plan.kernels)

        def weights_grads():
            needs = ctx.needs_input_grad[1:5]
            full = (x_full, a_full, grad_y_full, grad_h_full)
            weight_grads.extend(math.weight_grads(*full, weights, chunks.full_offsets, needs))

        base = _measure(pool)
        _run(ctx, settings, grad_y_ND, grad_x_ND, receive, compute, weights_grads)
        settings.peak_bytes = max(settings.peak_bytes, pool.peak - base)
        return grad_x_ND, *weight_grads, None, None, None


def _run(ctx, settings: OverlapSettings, source_ND, target_ND, receive, compute, before_drain) -> None:
    """The pipeline of one direction: ``source_ND`` (send order) out by chunks, the returned rows into
    ``target_ND`` (send order)."""
    chunks, pool, comm_dtype = settings.chunks, settings.pool, settings.comm_dtype
    kernels, dtype = chunks.plan.kernels, source_ND.dtype

    def start_in(c):
        wire = encode_into(source_ND, chunks.send_index[c], comm_dtype, kernels, pool)
        return Trip(wire, chunks.plans[c], True, comm_dtype, dtype, pool)

    def start_out(c, rows):
        return Trip(
            encode_into(rows, None, comm_dtype, kernels, pool),
            chunks.plans[c],
            False,
            comm_dtype,
            dtype,
            pool,
        )

    def deliver(c, rows):
        target_ND.index_copy_(0, chunks.send_index[c], rows)

    run_pipeline(chunks.chunks, chunks.stages, start_in, receive, compute, start_out, deliver, before_drain)
    pool.end_round()


def chunked_experts(x_ND, experts, settings: OverlapSettings, rows: TripRows | None = None) -> torch.Tensor:
    """``y_ND`` (send order, as the unchunked exchange -> ``experts`` (a
    :class:`~moetrain.layers.experts.GroupedExperts`) -> return exchange gives it) for the permuted
    rows ``x_ND`` (send order, ``N_s`` rows); differentiable in the rows and the weights. ``rows``:
    filled rows are reused instead of communicating, empty ones are filled (module docstring)."""

    def compute(x_ND, weights, math):
        return _ChunkedExperts.apply(x_ND, *weights, settings, math, rows)

    return experts.forward_rows(x_ND, compute)
