"""Asynchronous chunked all-to-all: trips of one chunk each, advanced at fixed points so that
communication runs while the caller computes.

A :class:`Trip` carries one chunk's rows through a plan's stages (one ``all_to_all_single`` for the
flat algorithm, two for the hierarchical one, with chunk transposes between them): it encodes the
rows into a pool buffer (:mod:`moetrain.comm.buffers`), starts each stage with ``async_op=True``,
and :meth:`Trip.advance` waits for the stage in flight and starts the next. Every buffer comes from
the pool and goes back once the collective that used it has completed.

:func:`run_pipeline` schedules the trips of a chunked exchange -> compute -> return exchange. Its
order of collectives depends only on the chunk count and the number of stages, never on timing,
so every rank of a group issues the same collectives in the same order (what gloo and NCCL
require). With k stages the k inbound trips ahead of the chunk being computed each advance one stage
per chunk, as do the returns behind it; so each stage of each trip runs while one chunk is computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from moetrain.comm.buffers import CommBufferPool
from moetrain.comm.compression import WIRE_DTYPES, decode_rows, encode_rows
from moetrain.comm.timing import exchange_span
from moetrain.kernels.native import transpose_chunks_index


def encode_into(
    x_ND: torch.Tensor,
    index_R: torch.Tensor | None,
    comm_dtype: str | None,
    kernels: str,
    pool: CommBufferPool,
) -> torch.Tensor:
    """``x_ND[index_R]`` (all rows when None) encoded for the wire (:func:`encode_rows`), in a pool
    buffer."""
    if comm_dtype is None or x_ND.dtype == WIRE_DTYPES[comm_dtype]:
        rows = x_ND.shape[0] if index_R is None else index_R.numel()
        out = pool.take((rows, *x_ND.shape[1:]), x_ND.dtype, x_ND.device)
        if index_R is None:
            out.copy_(x_ND)
        else:
            torch.index_select(x_ND, 0, index_R, out=out)
        return out
    rows_ND = x_ND if index_R is None else x_ND.index_select(0, index_R)
    wire = encode_rows(rows_ND, comm_dtype, kernels)
    out = pool.take(tuple(wire.shape), wire.dtype, wire.device)
    return out.copy_(wire)


def _transpose_into(x: torch.Tensor, sizes_AB: torch.Tensor, pool: CommBufferPool) -> torch.Tensor:
    """:func:`moetrain.comm.all_to_all.transpose_chunks` into a pool buffer."""
    out = pool.take(tuple(x.shape), x.dtype, x.device)
    return torch.index_select(x, 0, transpose_chunks_index(sizes_AB, x.shape[0], x.device), out=out)


class Trip:
    """One chunk's rows through the stages of ``plan`` (forward: ``plan.exchange``'s direction,
    else ``plan.reverse``'s). ``wire_ND`` is a pool buffer from :func:`encode_into`; the trip owns
    it. ``advance()`` completes the stage in flight and starts the next; ``finish()`` completes the
    trip and returns the decoded rows, valid until ``release()``."""

    def __init__(
        self,
        wire_ND: torch.Tensor,
        plan,
        forward_direction: bool,
        comm_dtype: str | None,
        dtype: torch.dtype,
        pool: CommBufferPool,
    ):
        self.stages, self.last_transpose = plan.steps(forward_direction)
        self.comm_dtype, self.dtype, self.kernels, self.pool = comm_dtype, dtype, plan.kernels, pool
        self.stage = 0
        self._rows = wire_ND
        self._held: torch.Tensor | None = None
        self._start()

    @property
    def at_last_stage(self) -> bool:
        return self.stage >= len(self.stages) - 1

    def _start(self) -> None:
        transpose, send, recv, group = self.stages[self.stage]
        source = self._rows
        if transpose is not None:
            source = _transpose_into(self._rows, transpose, self.pool)
            self.pool.give(self._rows)
        self._send = source
        self._recv = self.pool.take((sum(recv), *source.shape[1:]), source.dtype, source.device)
        self._work = dist.all_to_all_single(
            self._recv, source, output_split_sizes=recv, input_split_sizes=send, group=group, async_op=True
        )

    def advance(self) -> None:
        with exchange_span():
            self._work.wait()
        self.pool.give(self._send)
        self._rows = self._recv
        self.stage += 1
        if self.stage < len(self.stages):
            self._start()

    def finish(self) -> torch.Tensor:
        while self.stage < len(self.stages):
            self.advance()
        rows = self._rows
        if self.last_transpose is not None:
            rows = _transpose_into(self._rows, self.last_transpose, self.pool)
            self.pool.give(self._rows)
        self._held = rows
        return decode_rows(rows, self.comm_dtype, self.dtype, self.kernels)

    def release(self) -> None:
        self.pool.give(self._held)
        self._held = None


def run_pipeline(
    chunks: int,
    stages: int,
    start_in: Callable[[int], Trip],
    receive: Callable[[int, torch.Tensor], object],
    compute: Callable[[int, object], torch.Tensor],
    start_out: Callable[[int, torch.Tensor], Trip],
    deliver: Callable[[int, torch.Tensor], None],
    before_drain: Callable[[], None] | None = None,
) -> None:
    """Runs ``chunks`` chunks through exchange -> compute -> return exchange, overlapped.

    ``start_in(c)``: the inbound trip of chunk c; ``receive(c, rows)``: takes what it needs from the
    arrived rows (they are released right after); ``compute(c, received)``: the rows to send back;
    ``start_out(c, rows)``: their trip; ``deliver(c, rows)``: takes the returned rows (released
    right after); ``before_drain()``: runs after the last chunk's computation, while the last returns
    travel. Per chunk c: finish inbound c, advance the inbound trips ahead of it one stage and start
    inbound ``c + stages``, compute c, finish the returns at their last stage, advance the others,
    start return c."""
    inbound: deque[Trip] = deque()
    outbound: deque[tuple[int, Trip]] = deque()
    for c in range(min(stages, chunks)):
        for trip in inbound:
            trip.advance()
        inbound.append(start_in(c))
    for c in range(chunks):
        trip = inbound.popleft()
        received = receive(c, trip.finish())
        trip.release()
        for ahead in inbound:
            if not ahead.at_last_stage:
                ahead.advance()
        if c + stages < chunks:
            inbound.append(start_in(c + stages))
        rows = compute(c, received)
        for _ in range(len(outbound)):
            index, back = outbound.popleft()
            if back.at_last_stage:
                deliver(index, back.finish())
                back.release()
            else:
                back.advance()
                outbound.append((index, back))
        outbound.append((c, start_out(c, rows)))
    if before_drain is not None:
        before_drain()
    while outbound:
        index, back = outbound.popleft()
        deliver(index, back.finish())
        back.release()
