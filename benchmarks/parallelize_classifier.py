"""Whale's showcase in miniature: a classifier with a large output layer, ``replica`` everywhere
against ``split`` on the head (``parallelize``), on 4 gloo ranks.

The model: a small feature extractor (``Linear(64, 256)``, GELU, ``Linear(256, 256)``, GELU) and a
102,400-class head (``Linear(256, 102400)``: 26.3M parameters, 105 MB in fp32; the extractor is
0.08M). One step = forward, cross-entropy, backward, gradient synchronisation and an AdamW step,
on a global batch of 32 samples in every layout:

- ``replica``: dp 4 (DDP), 8 samples per rank; every step all-reduces the head's gradient;
- ``split tp4``: the head split by classes over 4 ranks (``split.head``, the loss through the
  parallel cross-entropy, logits never gathered), the extractor replicated on the 4 ranks, which
  read the same 32 samples (one data stream);
- ``split tp2 x dp2``: the head split over 2 ranks, 2 data streams of 16 samples.

Measured in the same run, per step (median over the timed steps, after warm-up): the step time
(slowest rank) and the bytes communicated, counted as what the 4 processes wrote to their sockets
(``wchar`` of ``/proc/self/io`` summed over the ranks between the step's start and end: gloo's
TCP writes; nothing else is written during a step). The planner's alpha-beta model
(:mod:`moetrain.planner.split`, cluster preset ``v100-32gb``: the GPUs M6 was trained on) then
predicts the same two strategies at 8 nodes x 8 GPUs with the global batch scaled to 64 x 8
samples: bytes each GPU sends per step and the seconds of communication and compute.

Usage: ``python benchmarks/parallelize_classifier.py [--json PATH] [--steps N] [--warmup N]``.
The 4 ranks share this machine's cores and talk over loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import nonnegative_int, output_path, positive_int, write_json  # noqa: E402

WORLD = 4
GLOBAL_BATCH = 32
IN, HIDDEN, CLASSES = 64, 256, 102_400  # 100 Ki classes: divisible by every tp size used
LAYOUTS = {"replica": (1, {"*": "replica"}), "split tp4": (4, {"head": "split.head"}),
           "split tp2 x dp2": (2, {"head": "split.head"})}  # fmt: skip


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.features(x))


def written_bytes() -> int:
    """Bytes this process passed to write-like system calls (gloo's socket writes)."""
    with open("/proc/self/io") as stream:
        for line in stream:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def measure(layout: str, args) -> dict:
    from moetrain import ParallelConfig, ParallelContext, parallelize

    tp, strategy = LAYOUTS[layout]
    parallel = ParallelContext(ParallelConfig(tp_size=tp))
    torch.manual_seed(0)
    model = Classifier()
    trained = parallelize(model, parallel, strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_stream = GLOBAL_BATCH // parallel.data_count
    generator = torch.Generator().manual_seed(parallel.data_index)
    times, sent, losses = [], [], []
    for step in range(args.warmup + args.steps):
        x = torch.randn(per_stream, IN, generator=generator)
        labels = torch.randint(0, CLASSES, (per_stream,), generator=generator)
        dist.barrier()
        before, start = written_bytes(), time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = trained(x)
        with trained.loss_context(logits):
            loss = F.cross_entropy(logits, labels)
            loss.backward()
        trained.reduce_gradients()
        optimizer.step()
        elapsed, wrote = time.perf_counter() - start, written_bytes() - before
        stats = torch.tensor([elapsed, float(wrote)], dtype=torch.float64)
        slowest, total = stats.clone(), stats.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        if step >= args.warmup:
            times.append(float(slowest[0]))
            sent.append(float(total[1]))
            value = loss.detach()
            losses.append(float(value.full_tensor() if hasattr(value, "full_tensor") else value))
    head = model.head.weight
    return {
        "layout": layout,
        "tp_size": tp,
        "samples_per_rank": per_stream,
        "head_rows_per_rank": int(head.to_local().shape[0] if hasattr(head, "to_local") else head.shape[0]),
        "step_s": statistics.median(times),
        "bytes_per_step": statistics.median(sent),
        "loss": statistics.mean(losses),
    }


def worker(rank: int, args, out_path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    results = [measure(layout, args) for layout in LAYOUTS]
    if rank == 0:
        with open(out_path, "w") as stream:
            json.dump(results, stream)
    dist.destroy_process_group()


def predict(nodes: int = 8, gpus_per_node: int = 8) -> dict:
    """The planner's alpha-beta prediction for the same classifier on ``nodes x gpus_per_node``
    V100s, global batch 64 samples per GPU: per strategy, bytes each GPU sends per step (intra- and
    inter-node) and seconds of communication and compute (fp32, the planner's efficiency)."""
    from moetrain.planner.comm import all_reduce_traffic, group_layout
    from moetrain.planner.hardware import cluster_preset
    from moetrain.planner.settings import PlanSettings
    from moetrain.planner.split import HEAD_STATS, SplitUnit, unit_costs

    cluster = cluster_preset("v100-32gb", nodes, gpus_per_node=gpus_per_node)
    world = cluster.world_size
    settings = PlanSettings(micro_batch=64, precision="fp32")
    flops_per_s = cluster.gpu.flops_for("fp32") * settings.compute_efficiency
    head_weights = HIDDEN * CLASSES + CLASSES
    feature_weights = IN * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN
    head = SplitUnit("head", "head", {"head": "split.head"}, head_weights, 1, HIDDEN, 1, 2.0 * head_weights,
                     (CLASSES,), HEAD_STATS)  # fmt: skip
    out = {}
    for name, tp in (
        ("replica", 1),
        (f"split tp{gpus_per_node}", gpus_per_node),
        (f"split tp{world}", world),
    ):
        (cost,) = unit_costs([head], cluster, settings, tp, flops_per_s)
        dense = group_layout(list(range(0, world, tp)), cluster.gpus_per_node)
        features = all_reduce_traffic(cluster, "features", dense, feature_weights * 4, 25 * 2**20)
        head_grads = all_reduce_traffic(cluster, "head", dense, head_weights * 4 / tp, 25 * 2**20)
        sequences = settings.micro_batch * tp
        activations = {"intra": 0.0, "inter": 0.0}
        if tp > 1:
            group = group_layout(list(range(tp)), cluster.gpus_per_node)
            for payload in (sequences * HIDDEN * 4, *(sequences * 4,) * HEAD_STATS):
                t = all_reduce_traffic(cluster, "tp", group, payload, payload)
                activations["intra"] += t.intra_bytes
                activations["inter"] += t.inter_bytes
        feature_compute = 3 * 2.0 * feature_weights * sequences / flops_per_s
        head_s = cost.split_s if tp > 1 else cost.replica_s
        out[name] = {
            "intra_bytes": features.intra_bytes + head_grads.intra_bytes + activations["intra"],
            "inter_bytes": features.inter_bytes + head_grads.inter_bytes + activations["inter"],
            "step_s": head_s + features.seconds + feature_compute,
        }
    return {"cluster": f"{nodes} x {gpus_per_node} {cluster.gpu.name}", **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=output_path, help="write the results here")
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    args = parser.parse_args()
    from moetrain.launch import free_port

    port = free_port()  # below the ephemeral range: see its docstring
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(args, out_path, port), nprocs=WORLD, join=True)
        with open(out_path) as stream:
            measured = json.load(stream)
    replica = measured[0]
    print(f"classifier {IN}->{HIDDEN}->{HIDDEN} + head {HIDDEN}x{CLASSES} (fp32), {WORLD} gloo ranks, "
          f"global batch {GLOBAL_BATCH}, median of {args.steps} steps after {args.warmup}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")  # fmt: skip
    print(f"{'layout':>16} | {'samples/rank':>12} | {'head rows/rank':>14} | {'step ms':>8} | "
          f"{'MB sent/step':>12} | {'bytes: replica/this':>19} | {'time: replica/this':>18}")  # fmt: skip
    for r in measured:
        print(f"{r['layout']:>16} | {r['samples_per_rank']:>12} | {r['head_rows_per_rank']:>14} | "
              f"{1e3 * r['step_s']:>8.1f} | {r['bytes_per_step'] / 1e6:>12.2f} | "
              f"{replica['bytes_per_step'] / max(r['bytes_per_step'], 1):>19.1f} | "
              f"{replica['step_s'] / r['step_s']:>18.2f}")  # fmt: skip
    prediction = predict()
    print(
        f"alpha-beta prediction, {prediction['cluster']}, 64 samples per GPU (bytes sent per GPU per step):"
    )
    names = [k for k in prediction if k != "cluster"]
    for name in names:
        p = prediction[name]
        print(f"{name:>16} | intra {p['intra_bytes'] / 1e6:8.2f} MB | inter {p['inter_bytes'] / 1e6:8.2f} MB"
              f" | step {1e3 * p['step_s']:7.2f} ms")  # fmt: skip
    base = prediction[names[0]]
    for name in names[1:]:
        split = prediction[name]
        ratio = (base["intra_bytes"] + base["inter_bytes"]) / (split["intra_bytes"] + split["inter_bytes"])
        inter = base["inter_bytes"] / max(split["inter_bytes"], 1)
        print(f"predicted replica / {name}: bytes {ratio:.1f}x (inter-node {inter:.1f}x), "
              f"time {base['step_s'] / split['step_s']:.2f}x")  # fmt: skip
    if args.json:
        write_json(args.json, {"measured": measured, "prediction": prediction})


if __name__ == "__main__":
    main()
