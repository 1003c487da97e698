"""`make demo`: M6-style multimodal MoE pretraining end to end, on 2 CPU cores in a few minutes.

1. Generates the embedded dataset (coloured shapes at positions, captions in Chinese and English).
2. Pretrains the tiny M6 preset through the engine with 2 local ranks (torchrun, gloo), the
   experts split between them (ep_size 2), the three pretraining tasks mixed; saves a checkpoint.
3. Loads the checkpoint into a single process (the experts are resharded from 2 ranks to 1),
   captions the held-out images greedily, prints them beside the true captions, the caption
   accuracy beside that of always answering the most frequent training caption, and each MoE
   layer's share of tokens per expert while captioning.

Options: ``python scripts/demo.py --help`` (``--seed N`` for another run of the same config: the
weights' initialisation and the data stream, not the dataset, which is always the same one;
``--steps`` for a shorter or longer run, ``--set KEY=VALUE`` to change the config for training and
evaluation, ``--eval-limit`` to caption fewer held-out images). The evaluation routes as training
did: with ``model.moe.max_nodes_per_token`` set, each router is told the node count of the
training run (``ranks / parallel.local_world_size``). The accuracy it prints depends on the seed
and the machine (docs/m6.md, "The demo's accuracy over seeds").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import torch

from moetrain.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "models" / "m6_moe" / "demo.yaml"


def train(out_dir: Path, steps: int | None, ranks: int, overrides: list[str] = ()) -> None:
    """Runs `moetrain train` under torchrun; a fresh run each time (the dataset is kept)."""
    for stale in ("checkpoints", "metrics.jsonl"):
        path = out_dir / stale
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(free_port()),
        "-m",
        "moetrain.cli",
        "train",
        "--config",
        str(CONFIG),
        "--set",
        f"out_dir={out_dir}",
        "--set",
        f"parallel.ep_size={ranks}",
    ]
    for override in overrides:
        command += ["--set", override]
    if steps is not None:
        command += ["--set", f"steps={steps}", "--set", f"checkpoint_every={max(1, steps // 2)}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def evaluate(out_dir: Path, overrides: list[str] = (), ranks: int = 2, limit: int | None = None) -> None:
    from m6_moe import load_tokenizer
    from m6_moe.evaluate import evaluate_captioning
    from m6_moe.trained_model import load_trained_model
    from moetrain import MoELayer
    from moetrain.cli import build_train_config
    from moetrain.logs import configure_console

    configure_console("INFO")  # the captioning progress bar (a log record) on stderr

    # threads=null: the training ranks' one thread each is not imposed on the one evaluating process
    config = build_train_config(str(CONFIG), [f"out_dir={out_dir}", *overrides, "threads=null"])
    model, loaded = load_trained_model(config, out_dir / "checkpoints", device="cpu")
    if config.model.moe.max_nodes_per_token is not None:  # route as the training run's node layout did
        nodes = ranks // (config.parallel.local_world_size or ranks)
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.set_expert_nodes(nodes)
        print(f"routing as in training: experts over {nodes} nodes, max_nodes_per_token "
              f"{config.model.moe.max_nodes_per_token}")  # fmt: skip
    tokenizer = load_tokenizer(config.model.tokenizer)
    start = time.perf_counter()
    with torch.no_grad(), RoutingCounter(model) as routing:
        result = evaluate_captioning(model, tokenizer, out_dir / "data", limit=limit, num_examples=12)
    seconds = time.perf_counter() - start

    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    print(
        f"\ntrained {loaded['step']} steps (seed {config.seed}) on {loaded['saved_world_size']} ranks "
        f"(ep_size {loaded['saved_ep_size']}); loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}; "
        f"checkpoint loaded into 1 process (experts resharded)"
    )
    print(f"\nheld-out captions (greedy, {result['images']} images, {seconds:.0f} s):")
    print(f"  {'generated':<34} | true captions")
    for prediction, references in result["examples"]:
        mark = "ok" if prediction.split() in [r.split() for r in references] else "  "
        print(f"{mark} {_pad(prediction, 34)} | {' / '.join(references)}")
    print(f"\ncaption accuracy (exact match, held-out): {result['accuracy']:.1%}")
    print(f"always the most frequent training caption: {result['baseline_accuracy']:.1%}")
    print(f"token accuracy {result['token_accuracy']:.1%}, BLEU-4 {result['bleu4']:.1f}")
    attributes = ", ".join(f"{k} {v:.0%}" for k, v in result["attribute_accuracy"].items())
    print(f"per attribute: {attributes}")
    routing.print_table()


class RoutingCounter:
    """Adds up, over every forward while active, the routed slots each expert of each MoE layer
    received (``MoELayer.last_stats.routed_per_expert``)."""

    def __init__(self, model: torch.nn.Module):
        from moetrain import MoELayer

        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
        self.counts = [torch.zeros(m.config.num_experts, dtype=torch.float64) for _, m in self.layers]
        self.handles = []

    def __enter__(self) -> RoutingCounter:
        for index, (_, layer) in enumerate(self.layers):
            self.handles.append(layer.register_forward_hook(self._counter(index)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def _counter(self, index: int):
        def hook(layer, inputs, output) -> None:
            self.counts[index] += layer.last_stats.routed_per_expert.double().cpu()

        return hook

    def print_table(self) -> None:
        if not self.layers:
            return
        experts = len(self.counts[0])
        print(f"\nexpert token share while captioning (even = {1 / experts:.1%} each):")
        print(f"  {'MoE layer':<28}" + "".join(f"{f'expert {e}':>10}" for e in range(experts)))
        for (name, _), counts in zip(self.layers, self.counts, strict=True):
            shares = counts / counts.sum().clamp_min(1)
            print(f"  {name:<28}" + "".join(f"{share:>10.1%}" for share in shares.tolist()))


def _pad(text: str, columns: int) -> str:
    """``text`` cut or padded to ``columns`` terminal columns (CJK characters take two)."""
    out, used = [], 0
    for char in text:
        width = 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
        if used + width > columns:
            break
        out.append(char)
        used += width
    return "".join(out) + " " * (columns - used)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the run's seed: weights and data order (default: the config's, 0); the dataset stays the same",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (ep_size = ranks)")
    parser.add_argument("--out-dir", default=str(ROOT / "runs" / "demo"))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)"
    )
    parser.add_argument("--eval-limit", type=int, help="caption only the first N held-out images")
    args = parser.parse_args()
    out_dir = Path(args.out_dir).resolve()  # training runs from the repository root, evaluation here
    overrides = [*args.set, *([] if args.seed is None else [f"seed={args.seed}"])]
    start = time.perf_counter()
    train(out_dir, args.steps, args.ranks, overrides)
    trained = time.perf_counter()
    evaluate(out_dir, overrides, args.ranks, args.eval_limit)
    total = time.perf_counter() - start
    print(f"\nwall time {total:.0f} s ({trained - start:.0f} s training, then evaluation)")


if __name__ == "__main__":
    main()
