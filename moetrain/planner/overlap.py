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
  ``4 e + 3 c``, nothing hidden. The hidden time is the difference.

The count exchange (once per forward) and a recomputed layer's forward (which replays its rows and
sends nothing) are not overlapped. The run picks ``a2a_chunks="auto"`` with the same model
(:mod:`moetrain.comm.chunk_cost`, where it lives), from its ``ParallelConfig.a2a_links``.
"""

from __future__ import annotations

from moetrain.comm.chunk_cost import exchange_cost, layer_overlap_inputs, plan_chunks

__all__ = ["exchange_cost", "layer_overlap_inputs", "plan_chunks"]
