"""Every blocking all-to-all of an expert-parallel MoE layer's forward and backward runs inside
``moetrain.comm.timing.exchange_span``, so ``time/all_to_all_s`` holds the time a rank waits there
for slower ranks, for each exchange algorithm (4 gloo ranks as 2 nodes x 2)."""

from __future__ import annotations

import contextlib
import traceback

import pytest

from tests.helpers.dist_utils import run_distributed

CASES = [("flat", 1), ("flat", 2), ("hierarchical", 1), ("hierarchical", 2), ("node_dedup", 1)]


def _calls_outside_spans(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from moetrain import MoEConfig, MoELayer, shard_experts
    from moetrain.comm.timing import recording_exchanges
    from moetrain.parallel import ParallelContext

    depth, outside = [0], []

    class Recorder:
        @contextlib.contextmanager
        def phase(self, name):
            depth[0] += 1
            try:
                yield
            finally:
                depth[0] -= 1

    original = dist.all_to_all_single

    def watched(output, input, *args, **kwargs):
        if not kwargs.get("async_op") and depth[0] == 0:
            caller = traceback.extract_stack(limit=2)[0]
            outside.append(f"{caller.filename.rsplit('moetrain/', 1)[-1]}:{caller.lineno}")
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = watched
    found = {}
    try:
        for algorithm, chunks in CASES:
            parallel = ParallelContext(
                ep_size=world, all_to_all=algorithm, local_world_size=2, a2a_chunks=chunks
            )
            torch.manual_seed(0)
            config = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2, capacity_factor=None)
            layer = shard_experts(MoELayer(config), parallel)
            outside.clear()
            with recording_exchanges(Recorder()):
                layer(torch.randn(6, 8, requires_grad=True)).sum().backward()
            found[f"{algorithm}/{chunks}"] = list(outside)
    finally:
        dist.all_to_all_single = original
    return found


@pytest.mark.timeout(300)
def test_no_blocking_exchange_runs_outside_a_timed_span():
    for found in run_distributed(_calls_outside_spans, 4, timeout=240):
        assert found == {f"{a}/{c}": [] for a, c in CASES}, found
