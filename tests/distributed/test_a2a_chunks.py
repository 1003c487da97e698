"""a2a_chunks: the chunked all-to-all overlapped with the experts gives the unchunked layer's results
bit for bit (fp32 and fp64 rows, every wire dtype, flat and hierarchical, every expert variant,
recompute replay), on real gloo ranks (world 4 = 2 nodes x 2, world 8 = 2 nodes x 4)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from moetrain import MoEConfig, MoELayer, shard_experts
from moetrain.comm.chunking import chunk_major_order, split_counts
from moetrain.parallel import ParallelContext
from tests.helpers.dist_utils import run_distributed

D_MODEL, D_FF, EXPERTS = 16, 24, 8


def _context(base: ParallelContext, **changes) -> ParallelContext:
    """``base``'s groups with other ParallelConfig settings (what a fresh context would read)."""
    ctx = copy.copy(base)
    ctx.config = replace(base.config, **changes)
    return ctx


def _tokens(kind: str, rank: int) -> int:
    return {"even": 20, "uneven": 3 + 5 * rank, "one_empty": 0 if rank == 1 else 9, "few": 1 + rank % 2}[kind]


def _run_layer(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor, checkpointed: bool = False):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    torch.manual_seed(7)
    out = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False) if checkpointed else layer(xi)
    out.backward(upstream)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xi.grad, grads


def chunks_worker(rank, world, local_world, cases):
    contexts = {
        algorithm: ParallelContext(ep_size=world, all_to_all=algorithm, local_world_size=local_world)
        for algorithm in ("flat", "hierarchical")
    }
    report = []
    for case in cases:
        algorithm, comm_dtype, dtype, chunks, options, tokens, checkpointed = case
        base = _context(contexts[algorithm], comm_dtype=comm_dtype)
        cfg = MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=EXPERTS, top_k=2, min_capacity=1, **options)
        results = []
        for a2a_chunks in (1, chunks):
            torch.manual_seed(1234)
            layer = shard_experts(MoELayer(cfg), _context(base, a2a_chunks=a2a_chunks)).to(dtype)
            if checkpointed:
                layer.set_recompute_replay(True)
            g = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(_tokens(tokens, rank), D_MODEL, generator=g, dtype=dtype)
            upstream = torch.randn(x.shape, generator=g, dtype=dtype)
            results.append(_run_layer(layer, x, upstream, checkpointed))
            results[-1] += (layer.dispatcher.last_chunks, layer.comm_peak_bytes())
        (out1, gx1, grads1, _, _), (out_n, gx_n, grads_n, used, peak) = results
        report.append(
            {
                "case": case,
                "used": used,
                "out": torch.equal(out1, out_n),
                "grad_x": torch.equal(gx1, gx_n),
                "params": sorted(grads1) == sorted(grads_n)
                and all(torch.equal(grads1[k], grads_n[k]) for k in grads1),
                "worst": max(
                    [float((out1 - out_n).abs().max()) if out1.numel() else 0.0]
                    + [float((grads1[k] - grads_n[k]).abs().max()) for k in grads1]
                ),
                "peak": peak,
            }
        )
    return report


def _check(results):
    for rank, report in enumerate(results):
        for i, r in enumerate(report):
            if r["case"][3] == "auto":  # every rank of the group runs the count the group agreed on
                assert r["used"] >= 1 and all(other[i]["used"] == r["used"] for other in results), r
            else:
                assert r["used"] == r["case"][3], r
            assert r["out"] and r["grad_x"] and r["params"], (rank, r)


F64 = torch.float64
F32 = torch.float32
BATCH_PRIORITY = {"batch_prioritized_routing": True}
WORLD4_QUICK = [
    ("flat", None, F64, 3, {"capacity_factor": None}, "uneven", False),
    ("hierarchical", "bf16", F32, 3, {"capacity_factor": None}, "uneven", True),  # + recompute replay
]
WORLD4_CASES = [
    # algorithm, comm_dtype, dtype, chunks, MoEConfig options, tokens, checkpointed
    ("flat", None, F64, 3, {"capacity_factor": None}, "uneven", False),
    ("hierarchical", None, F32, 2, {"capacity_factor": 1.0}, "even", False),
    ("hierarchical", "bf16", F32, 3, {"capacity_factor": None}, "uneven", False),
    ("flat", "fp16", F32, 4, {"capacity_factor": None, "activation": "swiglu"}, "uneven", False),
    ("hierarchical", "fp16", F64, 2, {"capacity_factor": 0.75, "expert_bias": True}, "one_empty", False),
    ("flat", "bf16", F64, 5, {"activation": "gelu_tanh", "shared_expert_d_ff": 8}, "even", False),
    ("hierarchical", None, F64, 3, {"capacity_factor": 1.0, **BATCH_PRIORITY}, "uneven", False),
    ("flat", None, F32, 7, {"capacity_factor": None, "activation": "relu"}, "few", False),  # empty chunks
    ("hierarchical", None, F64, 3, {"capacity_factor": None}, "uneven", True),  # recompute replay
    ("flat", None, F64, "auto", {"capacity_factor": None}, "uneven", False),
]
WORLD8_CASES = [
    ("hierarchical", None, F64, 3, {"capacity_factor": None}, "uneven", False),
    ("flat", "fp16", F32, 2, {"capacity_factor": 1.0, "activation": "swiglu"}, "one_empty", False),
    ("hierarchical", "bf16", F32, 4, {"expert_bias": True}, "uneven", True),
]


@pytest.mark.timeout(300)
def test_chunked_layer_is_bit_identical_world4_quick():
    _check(run_distributed(chunks_worker, 4, 2, WORLD4_QUICK))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chunked_layer_is_bit_identical_world4():
    _check(run_distributed(chunks_worker, 4, 2, WORLD4_CASES))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chunked_layer_is_bit_identical_world8():
    _check(run_distributed(chunks_worker, 8, 4, WORLD8_CASES))


def test_chunks_split_every_block_and_keep_the_order():
    counts = torch.tensor([[5, 0], [1, 7]])
    shares = torch.stack([split_counts(counts, 3, c) for c in range(3)])
    assert torch.equal(shares.sum(0), counts)
    assert (shares.amax(0) - shares.amin(0)).le(1).all()
    order, rows = chunk_major_order(counts, 3)
    assert rows == shares.sum((1, 2)).tolist()
    assert sorted(order.tolist()) == list(range(13))
    start = 0
    for count in rows:  # each chunk: its share of every block, blocks in order
        piece = order[start : start + count].tolist()
        assert piece == sorted(piece)
        start += count
    assert order[: rows[0]].tolist() == [0, 6, 7]  # 1 row of block 0 (5 rows), 2 of block 3 (7 rows)


def peak_worker(rank, world, local_world):
    """Every token to every expert (top_k = E): each (rank, expert) block holds T rows, so every chunk
    is the same size and the measured pool peak can be compared with the model exactly."""
    out = []
    for algorithm in ("flat", "hierarchical"):
        base = ParallelContext(ep_size=world, all_to_all=algorithm, local_world_size=local_world)
        for comm_dtype in (None, "bf16"):
            for chunks in (1, 2, 3, 4, 6) if comm_dtype is None else (1, 4):
                ctx = _context(base, a2a_chunks=chunks, comm_dtype=comm_dtype)
                cfg = MoEConfig(
                    d_model=D_MODEL, d_ff=D_FF, num_experts=world, top_k=world, capacity_factor=None
                )
                torch.manual_seed(3)
                layer = shard_experts(MoELayer(cfg), ctx)
                x = torch.randn(12, D_MODEL, requires_grad=True)
                layer(x).sum().backward()
                out.append(
                    (algorithm, comm_dtype, chunks, layer.comm_peak_bytes(), layer.dispatcher.last_chunks)
                )
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reported_comm_peak_matches_the_model_and_shrinks_with_chunks():
    from moetrain.comm.chunking import chunked_comm_bytes, unchunked_comm_bytes

    for report in run_distributed(peak_worker, 4, 2):
        for algorithm, comm_dtype, chunks, peak, used in report:
            stages = 2 if algorithm == "hierarchical" else 1
            row = D_MODEL * (2 if comm_dtype else 4)
            sent = received = 4 * 12 * row  # 12 tokens to each of the 4 experts
            if chunks == 1:
                assert peak == unchunked_comm_bytes(sent, received, stages, comm_dtype is not None)
            else:
                assert used == chunks
                assert peak == pytest.approx(chunked_comm_bytes(sent, received, stages, chunks)), (
                    algorithm, comm_dtype, chunks)  # fmt: skip
        peaks = {(a, d, n): p for a, d, n, p, _ in report}
        for algorithm in ("flat", "hierarchical"):
            chunked = [peaks[(algorithm, None, n)] for n in (2, 3, 4, 6)]
            assert chunked == sorted(chunked, reverse=True) and chunked[-1] < chunked[0], (algorithm, chunked)


def auto_layout_worker(rank, world):
    import moetrain.layers.dispatch as dispatch

    calls = []
    counted = dispatch.group_layout
    dispatch.group_layout = lambda *args: (calls.append(args), counted(*args))[1]
    context = ParallelContext(ep_size=world, local_world_size=world, a2a_chunks="auto")
    cfg = MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=EXPERTS, top_k=2, capacity_factor=None)
    torch.manual_seed(0)
    layer = shard_experts(MoELayer(cfg), context)
    for step in range(3):
        x = torch.randn(12 + rank, D_MODEL, generator=torch.Generator().manual_seed(step * world + rank))
        layer(x.requires_grad_(True)).sum().backward()
    return len(calls)


@pytest.mark.timeout(120)
def test_auto_chunks_work_out_the_group_layout_once_not_per_call():
    """``a2a_chunks: auto`` proposes a count every forward; the EP group's node layout it models
    (a loop over the group's ranks) is fixed for the run and worked out once."""
    assert run_distributed(auto_layout_worker, 2) == [1, 1]
