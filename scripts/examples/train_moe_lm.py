"""A small MoE transformer language model trained on the embedded corpus (CPU), in one file.

Shows a progress bar (loss, aux loss, tokens/s, expert load) and ends with a table of the first
and last loss and each layer's per-expert token share. Options: ``--help``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from moe_lm import LMConfig, MoETransformerLM, load_tiny_corpus, sample_batch
from moetrain import MoEConfig, collect_moe_stats
from moetrain.logs import configure_console
from moetrain.progress import ProgressBar


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    configure_console("INFO")  # the progress bar is a log record: shown on stderr
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    corpus = load_tiny_corpus()
    moe = MoEConfig(d_model=128, d_ff=256, num_experts=args.experts, top_k=args.top_k, capacity_factor=1.25)
    model = MoETransformerLM(LMConfig(d_model=128, num_layers=2, num_heads=4, max_seq_len=args.seq, moe=moe))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1
    )
    generator = torch.Generator().manual_seed(args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"moetrain demo: {params / 1e6:.2f}M-parameter MoE LM, {args.experts} experts top-{args.top_k}, "
        f"{corpus.numel()} bytes of text, {args.steps} steps on {args.threads} CPU threads"
    )

    bar = ProgressBar(args.steps, "train")
    losses = []
    tokens_per_step = args.batch * args.seq
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = sample_batch(corpus, args.batch, args.seq, generator)
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the MoE aux losses are injected into this backward by the layers
        optimizer.step()
        schedule.step()
        stats = collect_moe_stats(model)
        losses.append(loss.item())
        load = stats.layers[-1].token_share
        bar.update(
            step,
            loss=loss.item(),
            aux=stats.aux_loss.item(),
            **{"tok/s": int(step * tokens_per_step / (time.perf_counter() - start))},
            load="/".join(f"{share:.2f}" for share in load.tolist()),
        )
    bar.close()

    final = collect_moe_stats(model)
    print(f"\n{'':>18} | {'first step':>10} | {'last step':>10}")
    print(f"{'loss (nats/byte)':>18} | {losses[0]:10.3f} | {losses[-1]:10.3f}")
    print(f"{'dropped tokens':>18} | {'':>10} | {final.dropped_fraction:10.3%}")
    print("\nper-expert token share (last step):")
    print(f"{'layer':>6} | " + " | ".join(f"expert {e}" for e in range(args.experts)))
    for index, layer in enumerate(final.layers):
        print(f"{index:>6} | " + " | ".join(f"{share:8.1%}" for share in layer.token_share.tolist()))


if __name__ == "__main__":
    main()
