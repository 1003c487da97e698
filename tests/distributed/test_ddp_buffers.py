"""Under DDP (``replica: ddp``), each rank's routers count the tokens of its own micro-batches for
aux-loss-free balancing: summed over ranks they equal one process's counts over the same global
batch. DDP broadcasts rank 0's buffers before every forward; it had overwritten the counts of each
rank's earlier micro-batches with rank 0's."""

from __future__ import annotations

import pytest

from tests.helpers.dist_utils import run_distributed

MICRO = 2


def _counts(rank: int, world: int) -> tuple[list, list]:
    import copy

    import torch
    import torch.distributed as dist

    from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy, lm_loss
    from moetrain import MoEConfig, ParallelConfig, ParallelContext, parallelize

    moe = MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2, capacity_factor=None, score_bias_rate=0.05)
    config = LMConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_seq_len=16, moe=moe)
    parallel = ParallelContext(ParallelConfig(ep_size=1, replica="ddp"))
    model = MoETransformerLM(config, seed=3)
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, default_lm_strategy(config, 1, 1))

    def batch(index: int):
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(100 + index))
        return ids[:, :-1], ids[:, 1:]

    for micro in range(MICRO):
        inputs, targets = batch(10 * rank + micro)
        lm_loss(trained(inputs), targets).backward()
    for source in range(world):
        for micro in range(MICRO):
            inputs, targets = batch(10 * source + micro)
            lm_loss(reference(inputs), targets).backward()
    routers = [block.ffn.router for block in model.blocks]
    summed = [router.load_E.clone() for router in routers]
    for counts in summed:
        dist.all_reduce(counts)
    return [c.tolist() for c in summed], [block.ffn.router.load_E.tolist() for block in reference.blocks]


@pytest.mark.timeout(180)
def test_each_rank_keeps_its_own_expert_load_counts_under_ddp():
    for summed, single_process in run_distributed(_counts, 2, timeout=150):
        assert summed == single_process
