"""M6 decoding speed with and without the key/value cache: greedy and beam search, in one run.

The tiny M6 preset with random weights captions a batch of random images (empty prefix) through
``m6_moe.generate``: ``greedy_search`` and ``beam_search`` (``--beams``), each with the cache
(``use_cache=True``: image and prefix encoded once, one token per step) and without it (the whole
sequence recomputed at every step). So that every run decodes the same number of tokens, eos is
switched off (the tokenizer's eos id is one no token has): every row generates exactly
``--new-tokens`` tokens. The cached and recomputed outputs must be identical (checked).

Measured per case, as the median over ``--rounds`` rounds that run the four decodes back to back
(so drift of the machine's speed hits them alike), after one warm-up round:

- ``tokens_per_s``: output tokens (``batch x new_tokens``; beam search's K beams count once) per
  second of wall time, image encoding included;
- ``cache_speedup``: time without the cache / time with it, per round, then the median.

Usage: python benchmarks/decode.py [--batch 8] [--new-tokens 40] [--beams 4] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from m6_moe.config import M6Config
from m6_moe.generate import beam_search, build_context, greedy_search
from m6_moe.model import M6Model
from m6_moe.tokenizer import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import output_path, positive_int, write_json  # noqa: E402


class NoEosTokenizer(ByteTokenizer):
    """The byte tokenizer with an eos id no token has, so decoding always runs to max_new_tokens."""

    def __init__(self):
        super().__init__()
        self.eos_id = -1


def decode(strategy: str, model, tokenizer, context: dict, new_tokens: int, beams: int, use_cache: bool):
    if strategy == "greedy":
        return greedy_search(model, tokenizer, context, new_tokens, use_cache=use_cache)
    return beam_search(model, tokenizer, context, new_tokens, num_beams=beams, use_cache=use_cache)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--batch", type=positive_int, default=8, help="images decoded together")
    parser.add_argument(
        "--new-tokens", type=positive_int, default=40, help="tokens per row (tiny.yaml's seq_len)"
    )
    parser.add_argument("--beams", type=positive_int, default=4)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=output_path, default=None)
    args = parser.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"argument --device: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda needs a GPU, but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = M6Config.preset("tiny")
    model = M6Model(config).to(device).eval()
    tokenizer = NoEosTokenizer()
    images = torch.randint(0, 256, (args.batch, 3, config.image_size, config.image_size), dtype=torch.uint8)
    context = build_context(model, tokenizer, images=images)

    def timed(strategy: str, use_cache: bool):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = decode(strategy, model, tokenizer, context, args.new_tokens, args.beams, use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, tokens

    cases = [(strategy, cache) for strategy in ("greedy", "beam") for cache in (True, False)]
    for strategy, cache in cases:  # warm-up, and the outputs must not depend on the cache
        timed(strategy, cache)
    for strategy in ("greedy", "beam"):
        with_cache, without = timed(strategy, True)[1], timed(strategy, False)[1]
        if with_cache != without:
            raise SystemExit(f"{strategy}: the cached and recomputed outputs differ")
        if any(len(tokens) != args.new_tokens for tokens in with_cache):
            raise SystemExit(f"{strategy}: a row stopped before {args.new_tokens} tokens")
    seconds = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            seconds[case].append(timed(*case)[0])

    output_tokens = args.batch * args.new_tokens
    results = []
    for strategy in ("greedy", "beam"):
        cached, recomputed = seconds[(strategy, True)], seconds[(strategy, False)]
        results.append(
            {
                "strategy": strategy if strategy == "greedy" else f"beam-{args.beams}",
                "cached_tokens_per_s": round(output_tokens / statistics.median(cached), 1),
                "recompute_tokens_per_s": round(output_tokens / statistics.median(recomputed), 1),
                "cached_s": round(statistics.median(cached), 4),
                "recompute_s": round(statistics.median(recomputed), 4),
                "cache_speedup": round(
                    statistics.median(r / c for r, c in zip(recomputed, cached, strict=True)), 2
                ),
            }
        )
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    print(
        f"M6 tiny preset, random weights, {args.batch} images, {args.new_tokens} new tokens each (eos off), "
        f"empty prefix, fp32, {machine['device']}, {args.threads} threads, median of {args.rounds}"
    )
    columns = list(results[0])
    print(" | ".join(f"{c:>22}" for c in columns))
    for row in results:
        print(" | ".join(f"{row[c]!s:>22}" for c in columns))
    print("outputs identical with and without the cache (checked)")
    if args.json:
        report = {"benchmark": "decode", "config": vars(args), "machine": machine, "results": results}
        write_json(args.json, report)


if __name__ == "__main__":
    main()
