"""``moetrain plan``: memory, traffic and step time of a model on a cluster, or the best settings.

    moetrain plan --model m6-1T --cluster v100-32gb --nodes 60 --inter-node-gbps 35 \\
        --precision fp16 --ep-size 480 --offload --micro-batch 8
    moetrain plan --model m6-1T --cluster v100-32gb --nodes 60 --inter-node-gbps 35 --recommend
    moetrain plan --model configs/tiny_lm.yaml --cluster a100-80gb --nodes 2 --json

``--model``: an M6 preset (``m6-tiny``, ``m6-base``, ``m6-10B``, ``m6-100B``, ``m6-1T``) or a YAML/JSON
training config (its batch, precision, parallel and optimizer settings become the defaults) or a
bare model config with a ``name``. Exit status: 0 when the plan (or the best recommendation)
fits, 1 when it does not; invalid options raise ``ValueError`` (``moetrain`` prints it, status 2).
"""

from __future__ import annotations

import argparse
import json

from moetrain.planner.hardware import GPU_PRESETS, GiB, cluster_preset, gbps_to_bytes
from moetrain.planner.model import resolve_model
from moetrain.planner.plan import make_plan
from moetrain.planner.search import recommend
from moetrain.planner.settings import RECOMPUTE_MODES, PlanSettings


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``plan`` command to an ``argparse`` sub-parser set; ``args.run`` is :func:`run_plan`."""
    plan = subparsers.add_parser(
        "plan",
        help="memory / communication / step-time plan of a model on a cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--model", required=True, help="M6 preset (m6-1T, ...) or a YAML/JSON config file")
    plan.add_argument(
        "--cluster", required=True, choices=sorted(GPU_PRESETS), type=str.lower, help="GPU type"
    )
    plan.add_argument("--nodes", required=True, type=int)
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--inter-node-gbps", type=float, help="inter-node bandwidth per node, Gb/s")
    plan.add_argument("--intra-node-gbs", type=float, help="intra-node bandwidth per GPU and direction, GB/s")
    plan.add_argument("--host-memory-gib", type=float, help="host memory per node, GiB")
    plan.add_argument("--ep-size", type=int)
    plan.add_argument("--micro-batch", type=int, help="sequences per GPU per micro-step")
    plan.add_argument("--seq-len", type=int, help="text tokens per sequence")
    plan.add_argument("--grad-accum", type=int)
    plan.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), help="default: bf16 where the GPU has it, else fp16"
    )
    plan.add_argument("--autocast", action="store_true", help="fp32 weights with autocast compute")
    plan.add_argument("--offload", action="store_true", help="optimizer states in host memory")
    plan.add_argument("--recompute", choices=RECOMPUTE_MODES)
    plan.add_argument("--recompute-fraction", type=float)
    plan.add_argument("--recompute-budget-gib", type=float)
    plan.add_argument("--all-to-all", choices=("auto", "flat", "hierarchical"))
    plan.add_argument("--comm-dtype", choices=("bf16", "fp16"))
    plan.add_argument("--capacity-factor", type=float, help="0: dropless (default: the model's)")
    plan.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s reached (default 0.4)")
    plan.add_argument("--recommend", action="store_true", help="search ep_size, offload, micro-batch")
    plan.add_argument("--global-batch", type=int, help="with --recommend: sequences per step, fixed")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.set_defaults(run=run_plan)
    return plan


def settings_from_args(args, defaults: dict) -> PlanSettings:
    """PlanSettings from the command line over the config file's ``defaults``."""
    values = dict(defaults)
    options = {
        "ep_size": args.ep_size,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "precision": args.precision,
        "recompute": args.recompute,
        "recompute_fraction": args.recompute_fraction,
        "all_to_all": args.all_to_all,
        "comm_dtype": args.comm_dtype,
        "compute_efficiency": args.efficiency,
    }
    values.update({k: v for k, v in options.items() if v is not None})
    if args.autocast:
        values["autocast"] = True
    if args.offload:
        values["offload"] = True
    if args.capacity_factor is not None:
        values["capacity_factor"] = args.capacity_factor or None
    if args.recompute_budget_gib is not None:
        values["recompute_budget_bytes"] = int(args.recompute_budget_gib * GiB)
    return PlanSettings(**values)


def run_plan(args) -> int:
    """Runs ``moetrain plan``; prints a table (or JSON) and returns 0 if it fits, else 1."""
    model, defaults = resolve_model(args.model)
    overrides = {"gpus_per_node": args.gpus_per_node}
    if args.inter_node_gbps is not None:
        overrides["inter_node_bandwidth"] = gbps_to_bytes(args.inter_node_gbps)
    if args.intra_node_gbs is not None:
        overrides["intra_node_bandwidth"] = args.intra_node_gbs * 1e9
    if args.host_memory_gib is not None:
        overrides["host_memory_bytes"] = int(args.host_memory_gib * GiB)
    cluster = cluster_preset(args.cluster, args.nodes, **overrides)
    if args.precision is None and "precision" not in defaults:
        defaults = {**defaults, "precision": "bf16" if "bf16" in cluster.gpu.peak_flops else "fp16"}
    settings = settings_from_args(args, defaults)
    if args.global_batch is not None and not args.recommend:
        raise ValueError("--global-batch is only used with --recommend")
    if args.recommend:
        result = recommend(
            model,
            cluster,
            settings,
            ep_sizes=None if args.ep_size is None else [args.ep_size],
            offload=(True,) if args.offload else (False, True),
            micro_batches=None if args.micro_batch is None else [args.micro_batch],
            recompute=(settings.recompute,),
            global_batch=args.global_batch,
        )
        print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_table())
        return 0 if result.best is not None else 1
    plan = make_plan(model, cluster, settings)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.format_table())
    return 0 if plan.fits else 1
