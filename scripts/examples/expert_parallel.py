"""Expert parallelism in a few lines: run with
``torchrun --nproc-per-node 4 scripts/examples/expert_parallel.py`` (CPU/gloo or GPU/nccl).

The model is built whole, with no knowledge of the ranks; ``parallelize`` then gives each of the 4
ranks 2 of the 8 experts (strategy ``{"moe": "expert"}``): tokens travel by all-to-all, replicated
parameters are averaged by DDP and expert gradients by the expert-data-parallel reducer; clipping
uses the true global norm. ``--local-world-size 2`` pretends the 4 ranks are 2 nodes x 2, which
makes the all-to-all hierarchical.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoELayer, ParallelContext, parallelize
from moetrain.parallel import init_distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.moe = MoELayer(d_model=64, d_ff=128, num_experts=8, top_k=2)
        self.out = nn.Linear(64, 32)

    def forward(self, x):
        return self.out(self.moe(torch.relu(self.inp(x))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-world-size", type=int, default=None)
    parser.add_argument("--comm-dtype", choices=["bf16", "fp16"], default=None)
    args = parser.parse_args()
    launch = init_distributed()
    ctx = ParallelContext(
        ep_size=launch.world_size, local_world_size=args.local_world_size, comm_dtype=args.comm_dtype
    )
    torch.manual_seed(0)  # same seed everywhere: replicas start equal, experts by global index
    model = Net()
    trained = parallelize(model, ctx, {"moe": "expert"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(launch.rank)
    for step in range(20):
        x = torch.randn(64, 32, generator=generator)
        loss = F.mse_loss(trained(x), x)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trained.reduce_gradients()
        norm = trained.clip_grad_norm_(1.0)
        optimizer.step()
        if launch.rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f} grad-norm {float(norm):.3f} ({ctx.all_to_all})")


if __name__ == "__main__":
    main()
    # After main(): the model and context are gone, so this joins gloo's threads (docs/expert_parallel.md).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
