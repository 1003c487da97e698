"""The chunked all-to-all of a MoE layer overlapped with its experts, as the planner models it.

One MoE layer per micro-step exchanges its rows four times (dispatch and combine, forward and
backward) and runs its experts three times over (forward, backward to the inputs, weight
gradients); :mod:`moetrain.comm.chunking` gives the overlapped time of that and what it hides:

- one exchange, unchunked: ``e = A + B`` from the alpha-beta formulas of
  :mod:`moetrain.comm.chunk_cost` (``A``: the message latencies, which every chunk pays again;
  ``B``: the bytes over the links, split between the chunks), with the planner's cluster;
- the experts: ``c = ffn_flops(rows) / flops_per_s`` for each of the three (balanced routing);
- ``a2a_chunks = n``: forward ``2 e_n + c / n + (n - 1) max(c / n, 2 e_n)``, backward
  ``e_n + c / n + (n - 1) max(c / n, 2 e_n) + max(e_n, c)`` with ``e_n = A + B / n``; ``n = 1``:
  ``4 e + 3 c``, nothing hidden.
- the n chunks send ``4 n`` exchanges' messages, ``4 (n - 1) A`` more latency than unchunked
  (:func:`chunk_latency_seconds`; the plan's all-to-all traffic counts it); the hidden time
  (:func:`hidden_behind_experts`) is the serial time of those chunks, ``4 (n A + B) + 3 c``, less
  the overlapped time above: never negative, so the plan's all-to-all time less its hidden time
  is what the step pays.

The count exchange (once per forward) and a recomputed layer's forward (which replays its rows and
sends nothing) are not overlapped. The run picks ``a2a_chunks="auto"`` with the same model
(:mod:`moetrain.comm.chunk_cost`, where it lives), from its ``ParallelConfig.a2a_links``.
"""

from __future__ import annotations

from moetrain.comm.chunk_cost import exchange_cost, layer_overlap_inputs, plan_chunks
from moetrain.comm.chunking import ExchangeCost, hidden_seconds

__all__ = [
    "chunk_latency_seconds",
    "exchange_cost",
    "hidden_behind_experts",
    "layer_overlap_inputs",
    "plan_chunks",
]


def chunk_latency_seconds(exchange: ExchangeCost, chunks: int) -> float:
    """Seconds of latency ``chunks`` chunks add to one MoE layer's four row exchanges (every chunk
    sends every message again): ``4 (n - 1) A``."""
    return 4 * (chunks - 1) * exchange.latency


def hidden_behind_experts(exchange: ExchangeCost, expert_s: float, chunks: int) -> float:
    """Seconds one MoE layer's chunked exchanges hide behind its experts (``expert_s`` each for
    forward, backward to the inputs and weight gradients): their serial time ``4 (n A + B) + 3 c``
    less the overlapped ``T_f + T_b`` (:mod:`moetrain.comm.chunking`); 0 for one chunk, never
    negative."""
    unchunked = hidden_seconds(exchange, expert_s, expert_s, expert_s, chunks)
    return max(0.0, unchunked + chunk_latency_seconds(exchange, chunks))  # 0, not a rounding's -1e-19
