"""Launched by tests/test_launch.py under torchrun: EP MoE forward/backward from the environment."""

import json
import sys

import torch

from moetrain import MoELayer, ParallelContext
from moetrain.parallel import init_distributed

launch = init_distributed()
ctx = ParallelContext(ep_size=launch.world_size)
torch.manual_seed(0)
layer = MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=2, parallel=ctx)
out = layer(torch.randn(6, 8) * (1 + launch.rank))
out.sum().backward()
report = {
    "rank": launch.rank,
    "world": launch.world_size,
    "launcher": launch.launcher,
    "local_world_size": ctx.local_world_size,
    "local_experts": list(ctx.local_experts(4)),
}
with open(f"{sys.argv[1]}/rank{launch.rank}.json", "w") as f:
    json.dump(report, f)
torch.distributed.destroy_process_group()  # gloo's threads must stop before the interpreter exits
