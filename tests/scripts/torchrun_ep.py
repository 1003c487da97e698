"""Launched by tests/distributed/test_launch.py under torchrun: EP MoE forward/backward from the
environment."""

import json
import sys

import torch

from moetrain import MoELayer, ParallelContext, shard_experts
from moetrain.parallel import init_distributed


def main(out_dir: str) -> None:
    launch = init_distributed()
    ctx = ParallelContext(ep_size=launch.world_size)
    torch.manual_seed(0)
    layer = shard_experts(MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=2), ctx)
    out = layer(torch.randn(6, 8) * (1 + launch.rank))
    out.sum().backward()
    report = {
        "rank": launch.rank,
        "world": launch.world_size,
        "launcher": launch.launcher,
        "local_world_size": ctx.local_world_size,
        "local_experts": list(ctx.local_experts(4)),
    }
    with open(f"{out_dir}/rank{launch.rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
    # Every object holding a process group died with main()'s frame, so destroying the groups now
    # joins gloo's worker threads while the interpreter is alive. Left to interpreter shutdown, a
    # worker can still be releasing its last all-to-all (a tensor decref that needs the GIL), and the
    # process aborts with "terminate called without an active exception".
    torch.distributed.destroy_process_group()
