"""One model, written once, parallelized afterwards: run with
``moetrain launch --nproc-per-node 4 scripts/examples/parallelize.py`` (CPU/gloo or GPU/nccl).

The language model is built on the ``meta`` device (no memory) with no knowledge of the ranks;
``parallelize`` then lays it out on a 4-rank mesh of dp 1 x ep 2 x tp 2: its MoE layers
expert-parallel (each rank keeps 2 of the 4 experts), attention q/k/v split by columns and the
projection by rows, the embedding split by vocabulary, the head split by vocabulary with the loss
computed by the parallel cross-entropy, everything else replicated. ``materialize`` allocates and
initialises this rank's share (experts from their per-expert seeds: the same values a CPU build
would have). Each tensor-parallel pair reads one data stream.
"""

import torch

from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy, lm_loss
from moetrain import MoEConfig, ParallelConfig, ParallelContext, parallelize
from moetrain.parallel import init_distributed


def main():
    init_distributed()
    parallel = ParallelContext(ParallelConfig(ep_size=2, tp_size=2))
    moe = MoEConfig(d_model=64, d_ff=128, num_experts=4, top_k=2)
    config = LMConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, max_seq_len=32, moe=moe)
    torch.manual_seed(0)  # the same seed on every rank
    with torch.device("meta"):
        model = MoETransformerLM(config, seed=0)
    trained = parallelize(model, parallel, default_lm_strategy(config, tp_size=2))
    trained.materialize("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = torch.Generator().manual_seed(parallel.data_index)  # tp ranks share their data
    for step in range(6):
        tokens = torch.randint(0, 256, (4, 33), generator=stream)
        logits = trained(tokens[:, :-1])  # a DTensor sharded over the vocabulary
        with trained.loss_context(logits):  # loss_parallel(): the logits are never gathered
            loss = lm_loss(logits, tokens[:, 1:])
            loss.backward()
        trained.reduce_gradients()  # experts over their expert-data-parallel ranks
        norm = trained.clip_grad_norm_(1.0)  # every element counted once, DTensor shards included
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if parallel.rank == 0 and step % 2 == 0:
            print(f"step {step} loss {loss.full_tensor().item():.3f} grad-norm {float(norm):.3f}")
    if parallel.rank == 0:
        print(trained.summary())


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # after main(): see docs/expert_parallel.md, "Shutting down"
        torch.distributed.destroy_process_group()
