"""``moetrain generate`` for M6: captions (from ``--image`` alone) or continuations (of
``--prefix``, with or without an image) from a trained checkpoint, with the library's strategies
(:func:`m6_moe.generate.generate`: greedy, sample with top-k / top-p / temperature, beam)::

    moetrain generate --config run.yaml --checkpoint runs/x/checkpoints --image a.jpg [--prefix TEXT]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from m6_moe.command_options import add_decoding_options, beam_options, check_seed
from m6_moe.data import decode_image_file
from m6_moe.generate import (
    STRATEGIES,
    check_new_tokens,
    check_sampling_options,
    generate,
    room_for_new_tokens,
)
from m6_moe.tokenizer import encode_prefix
from m6_moe.trained_model import load_trained_model, tokenizer_for

log = logging.getLogger(__name__)

# Every character str.splitlines() ends a line at, escaped, so that each input prints one line.
_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in _BREAKS})


def load_image_file(path: str | Path, model_config) -> torch.Tensor:
    """An image file as ``uint8 [C, image_size, image_size]``, opened, checked, converted and
    resized as training does (:func:`~m6_moe.data.decode_image_file`: a regular file in one of
    :data:`~m6_moe.data.IMAGE_FORMATS`); a missing, unreadable or oversized
    (``tasks.max_image_pixels``) file is a one-line ``ValueError``."""
    pixels, reason = decode_image_file(
        Path(path), model_config.image_size, model_config.image_channels, model_config.tasks.max_image_pixels
    )
    if pixels is None:
        raise ValueError(f"--{reason}")  # "image <path> ...": the option's name
    return pixels


class GenerateCommand:
    """``moetrain generate``: captions (from ``--image`` alone) or continuations (of ``--prefix``,
    with or without an image) of a trained checkpoint, with the library's strategies
    (:func:`m6_moe.generate.generate`)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--image",
            action="append",
            default=[],
            metavar="PATH",
            help="an image file (repeat for several: one output line each, in order)",
        )
        parser.add_argument(
            "--prefix",
            metavar="TEXT",
            help="text the output continues (the same for every image); <extra_id_N> is sentinel N, as in "
            "the denoise task",
        )
        parser.add_argument(
            "--strategy", choices=STRATEGIES, default="greedy", help="decoding (default greedy)"
        )
        parser.add_argument(
            "--top-k", type=int, help="--strategy sample: keep the k most likely tokens (0: all)"
        )
        parser.add_argument("--top-p", type=float, help="--strategy sample: nucleus mass in (0, 1]")
        parser.add_argument("--temperature", type=float, help="--strategy sample: logits / temperature (> 0)")
        parser.add_argument("--seed", type=int, help="--strategy sample: seed of the draws (default 0)")
        add_decoding_options(parser, "the config's data.seq_len, at most what fits after the prefix")

    def run(self, args, config) -> int:
        sampling = {
            "top_k": args.top_k,
            "top_p": args.top_p,
            "temperature": args.temperature,
            "seed": args.seed,
        }
        given = [f"--{name.replace('_', '-')}" for name, value in sampling.items() if value is not None]
        if args.strategy != "sample" and given:
            raise ValueError(f"only --strategy sample takes {', '.join(given)}")
        check_seed(args.seed)
        options = {"use_cache": not args.no_cache, **beam_options(args)}
        if not args.image and args.prefix is None:
            raise ValueError("give --image, --prefix or both")
        model_config = config.model
        tokenizer = tokenizer_for(model_config)
        prefix = args.prefix or ""
        prefix_len = len(encode_prefix(tokenizer, prefix))  # an unfaithful prefix stops here
        max_new_tokens = args.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = max(1, min(config.data.seq_len, room_for_new_tokens(model_config, prefix_len)))
        check_new_tokens(model_config, prefix_len, max_new_tokens)  # before the checkpoint is read
        chosen = {k: v for k, v in sampling.items() if k != "seed" and v is not None}
        check_sampling_options(**chosen)
        pixels = [load_image_file(path, model_config) for path in args.image]
        model, _ = load_trained_model(config, args.checkpoint)
        if args.strategy == "sample":
            seed = 0 if args.seed is None else args.seed
            device = next(model.parameters()).device
            options["generator"] = torch.Generator(device=device).manual_seed(seed)
            options.update(chosen)
        log.info(
            "%s decoding, at most %d new tokens, %s", args.strategy, max_new_tokens,
            "key/value cache" if options["use_cache"] else "no cache (full recompute)",
        )  # fmt: skip
        images = torch.stack(pixels) if pixels else None
        rows = len(pixels) or 1
        texts = generate(
            model, tokenizer, images=images, prefixes=[prefix] * rows, strategy=args.strategy,
            max_new_tokens=max_new_tokens, **options,
        )  # fmt: skip
        if args.json:
            outputs = [
                {"image": str(path) if path is not None else None, "prefix": prefix, "text": text}
                for path, text in zip(args.image or [None], texts, strict=True)
            ]
            report = {"strategy": args.strategy, "max_new_tokens": max_new_tokens, "outputs": outputs}
            print(json.dumps(report, ensure_ascii=False))
        else:
            for text in texts:
                print(text.translate(LINE_BREAKS))  # one line per input
        return 0
