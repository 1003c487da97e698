"""Whale's MoE snippet, ported to ``moetrain.scope``: run with
``moetrain launch --standalone --nproc-per-node 2 scripts/examples/whale_moe.py`` (CPU/gloo or
GPU/nccl; one process works too).

Whale (EPL, the framework M6 was trained with) annotates the model where it is written: data
parallel by default, the experts under ``split``::

    import whale as wh                      # moetrain
    wh.set_default_scope(wh.replica)        # with scope.set_default("replica"):
    ...                                     #     model = WhaleMoE(...)
    with wh.split():                        # with scope.split():
        expert_output = experts(dispatched) #     self.moe = MoELayer(...)

The model below is built under those scopes and nothing else: ``parallelize(model, parallel)`` with no
strategy reads them. Its attention-free blocks (a token-mixing ``Linear`` and an MoE FFN) are
replicated, the experts split over the ranks (expert parallel: each of 2 ranks holds 4 of the 8
experts, tokens travel by all-to-all). It prints the strategy the scopes gave, then trains a few
steps on the embedded byte corpus.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moe_lm import load_tiny_corpus, sample_batch
from moetrain import MoELayer, ParallelContext, parallelize, scope, strategy_from_scopes
from moetrain.parallel import init_distributed

VOCAB, WIDTH, SEQ = 256, 64, 32


class Block(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.mix_norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)  # the default scope: replica
        self.moe_norm = nn.LayerNorm(WIDTH)
        with scope.split():  # Whale: the experts' einsums under split
            self.moe = MoELayer(d_model=WIDTH, d_ff=128, num_experts=8, top_k=2, seed=seed)

    def forward(self, x_BSD):
        x_BSD = x_BSD + self.mix(self.mix_norm(x_BSD))
        return x_BSD + self.moe(self.moe_norm(x_BSD))


class WhaleMoE(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(seed=100 + i) for i in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.head(x_BSD)


def build() -> WhaleMoE:
    with scope.set_default("replica"):  # Whale: set_default_scope(replica)
        return WhaleMoE()


def main():
    launch = init_distributed()
    parallel = ParallelContext(ep_size=launch.world_size)
    torch.manual_seed(0)  # the same replicated weights on every rank
    model = build()
    if parallel.rank == 0:
        kinds = strategy_from_scopes(model, parallel)
        print("strategy from scopes:", ", ".join(f"{name}: {kind}" for name, kind in kinds.items()))
    trained = parallelize(model, parallel)  # no strategy: the scopes give it
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = load_tiny_corpus()
    stream = torch.Generator().manual_seed(parallel.data_index)
    for step in range(6):
        tokens, targets = sample_batch(corpus, 8, SEQ, stream)
        logits = trained(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        trained.reduce_gradients()  # the experts' gradients over their expert-data-parallel ranks
        trained.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if parallel.rank == 0 and step % 2 == 0:
            print(f"step {step} loss {loss.item():.3f}")
    if parallel.rank == 0:
        print(trained.summary())


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # after main(): see docs/expert_parallel.md, "Shutting down"
        torch.distributed.destroy_process_group()
