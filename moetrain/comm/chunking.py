"""How a chunked all-to-all splits its rows, what the overlap saves, and how many chunks to use.

Pure functions; the runtime (:mod:`moetrain.comm.overlap`, :mod:`moetrain.layers.overlap`) and the
planner (:mod:`moetrain.planner.plan`) share them.

Splitting (legend: n chunks, a block = the rows one rank sends to one expert of one rank, s rows):
chunk c takes rows ``[floor(s * c / n), floor(s * (c + 1) / n))`` of every block, so sender and
receiver agree on every chunk's sizes from the block sizes alone (no extra communication), each
chunk holds ``s / n`` rows of every block (+-1), and a block of fewer than n rows leaves some chunks
empty.

Time of one MoE layer's exchanges and expert computation (alpha-beta; ``e = A + B`` is one
unchunked exchange, latency ``A`` and transfer ``B``; a chunk's exchange is ``e_n = A + B / n``;
``c_f`` the experts' forward, ``c_i`` their backward to the inputs, ``c_w`` their weight gradients):

- unchunked (n = 1), nothing overlaps: forward ``2 e + c_f``, backward ``2 e + c_i + c_w``;
- n >= 2, pipelined: chunk i + 1 travels while chunk i is computed and chunk i - 1 returns, so per
  chunk the link carries two exchanges and the cores one chunk's computation; the first chunk's
  exchange and the last chunk's return are not hidden (fill and drain):
  forward ``T_f = 2 e_n + c_f / n + (n - 1) * max(c_f / n, 2 e_n)``; backward
  ``T_b = e_n + c_i / n + (n - 1) * max(c_i / n, 2 e_n) + max(e_n, c_w)`` (the weight gradients are
  computed once, after the last chunk, while its return travels).

What is hidden = unchunked time - overlapped time; more chunks hide more until the per-chunk
latency ``2 n A`` costs more than they hide. :func:`choose_chunks` takes the n with the least
``T_f + T_b``.

Communication memory (bytes of send and receive buffers held at once; ``S`` and ``R`` the wire
bytes the rank sends and receives in one exchange, ``k`` the algorithm's stages, 1 flat, 2
hierarchical): unchunked, :func:`unchunked_comm_bytes`; chunked, each of the ``k`` trips in flight
per direction holds one chunk's send and receive buffers, ``min(2 k, n) (S + R) / n``
(:func:`chunked_comm_bytes`); it shrinks with n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_AUTO_CHUNKS = 8


def split_counts(counts: torch.Tensor, chunks: int, chunk: int) -> torch.Tensor:
    """Chunk ``chunk``'s share of every block: ``floor(s (c+1) / n) - floor(s c / n)``."""
    return counts * (chunk + 1) // chunks - counts * chunk // chunks


def chunk_major_order(counts: torch.Tensor, chunks: int) -> tuple[torch.Tensor, list[int]]:
    """For rows stored as consecutive blocks of ``counts`` (flattened in order) rows: the row indices
    chunk by chunk (each chunk's rows in storage order, on ``counts``' device) and the rows of each
    chunk. Row j of a block of s rows is in chunk ``ceil(n (j + 1) / s) - 1``."""
    counts = counts.reshape(-1).to(torch.int64)
    device = counts.device
    rows = int(counts.sum())
    block_R = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=rows)
    start_B = torch.cumsum(counts, 0) - counts
    j_R = torch.arange(rows, device=device) - start_B[block_R]
    s_R = counts[block_R]
    chunk_R = (chunks * (j_R + 1) + s_R - 1) // s_R - 1
    order = torch.sort(chunk_R, stable=True).indices
    rows_C = torch.bincount(chunk_R, minlength=chunks).tolist()
    return order, rows_C


@dataclass(frozen=True)
class ExchangeCost:
    """One unchunked exchange of a MoE layer (seconds): ``latency`` (message latencies, paid again
    by every chunk) and ``transfer`` (bytes over bandwidth, split between the chunks)."""

    latency: float
    transfer: float

    def chunk(self, chunks: int) -> float:
        return self.latency + self.transfer / chunks


def overlapped_seconds(
    exchange: ExchangeCost, forward: float, backward_input: float, backward_weight: float, chunks: int
) -> tuple[float, float]:
    """``(T_f, T_b)``: seconds of one MoE layer's exchanges and expert computation, forward and
    backward, with ``chunks`` chunks (see the module docstring)."""
    e = exchange.chunk(chunks)
    if chunks == 1:
        return 2 * e + forward, 2 * e + backward_input + backward_weight
    n = chunks
    t_f = 2 * e + forward / n + (n - 1) * max(forward / n, 2 * e)
    t_b = e + backward_input / n + (n - 1) * max(backward_input / n, 2 * e) + max(e, backward_weight)
    return t_f, t_b


def hidden_seconds(
    exchange: ExchangeCost, forward: float, backward_input: float, backward_weight: float, chunks: int
) -> float:
    """Communication time the overlap hides: the unchunked time (latency paid once per exchange)
    minus the overlapped time. Can be negative when the chunks' extra latencies cost more than they
    hide."""
    if chunks == 1:
        return 0.0
    serial = 4 * (exchange.latency + exchange.transfer) + forward + backward_input + backward_weight
    return serial - sum(overlapped_seconds(exchange, forward, backward_input, backward_weight, chunks))


def choose_chunks(
    exchange: ExchangeCost,
    forward: float,
    backward_input: float,
    backward_weight: float,
    max_chunks: int = MAX_AUTO_CHUNKS,
) -> int:
    """The chunk count in ``1..max_chunks`` with the least ``T_f + T_b`` (the fewest on ties)."""
    best, best_time = 1, None
    for n in range(1, max_chunks + 1):
        total = sum(overlapped_seconds(exchange, forward, backward_input, backward_weight, n))
        if best_time is None or total < best_time * (1 - 1e-9):
            best, best_time = n, total
    return best


def unchunked_comm_bytes(sent: float, received: float, stages: int, encoded: bool) -> float:
    """Wire buffers of one unchunked exchange: the rows received (``R``) and, with a codec, the
    encoded rows sent (``S``; without one the permuted rows themselves are sent); the 2-D algorithm
    adds its stage copies: the transposed rows, the stage-1 rows and their transpose (``3 S``)."""
    total = received + (sent if encoded else 0)
    if stages == 2:
        total += 3 * sent
    return total


def chunked_comm_bytes(sent: float, received: float, stages: int, chunks: int) -> float:
    """Most bytes the chunked exchange's pool buffers hold at once (what the layer reports):
    ``min(2 * stages, n)`` trips in flight (``stages`` each way once the pipeline is full), each
    holding one chunk's send and receive buffers: ``min(2 k, n) * (S + R) / n``. Exact when the
    blocks divide evenly into the chunks (``tests/distributed/test_a2a_chunks.py`` measures it)."""
    return min(2 * stages, chunks) * (sent + received) / chunks
