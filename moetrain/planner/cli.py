"""``moetrain plan``: memory, traffic and step time of a model on a cluster, or the best settings.

    moetrain plan --model m6-1T --cluster v100-32gb --nodes 60 --inter-node-gbps 35 \\
        --precision fp16 --ep-size 480 --offload --micro-batch 8
    moetrain plan --model m6-1T --cluster v100-32gb --nodes 60 --inter-node-gbps 35 --recommend
    moetrain plan --model run.yaml --cluster a100-80gb --nodes 8 --recommend --json > plan.json
    moetrain plan --model configs/tiny_lm.yaml --cluster a100-80gb --nodes 2 --json
    moetrain plan --model m6-base --cluster v100-32gb --nodes 4 --mixed p100-16gb:4 --precision fp16

``--model``: a preset of a registered model, ``<model>-<preset>`` (the installed M6 example's:
``m6-tiny``, ``m6-base``, ``m6-10B``, ``m6-100B``, ``m6-1T``; an unknown name lists them all) or a
YAML/JSON training config (its batch, precision, parallel and optimizer settings become the
defaults) or a bare model config with a ``name``. Cluster figures default to the ``--cluster`` preset's and
each can be overridden (``--gpu-memory-gib``, ``--peak-tflops``, ``--intra-node-gbs``,
``--inter-node-gbps``, ``--intra-node-latency-us``, ``--inter-node-latency-us``,
``--host-memory-gib``, ``--gpus-per-node``). ``--seq-len`` defaults to the config's
``data.seq_len``, else the model's maximum. A plan fits when its GPU total is within the usable
memory, the capacity less ``--memory-headroom`` (default 0.1). Exit status: 0 when the plan (or the
best recommendation) fits, 1 when it does not; invalid options raise ``ValueError`` naming the flag
and its allowed range (``moetrain`` prints it, status 2).

``--mixed GPU:NODES[,GPU:NODES...]`` adds nodes of other GPU types to the ``--cluster`` ones and
prints the hardware-aware balancing of that mixed cluster instead (Whale: micro-batches by speed
within each GPU's memory, :func:`moetrain.planner.mixed.plan_mixed_cluster`) with the step time
against equal micro-batches; ``--global-batch`` is the sequences per micro-step over all GPUs
(default ``--micro-batch`` times the GPU count).

``--calibrate RUN_DIR`` plans a finished run's config (``--model`` optional) on the cluster given
(the one it ran on; its world size) and compares the plan with what the run measured
(:mod:`moetrain.planner.calibrate`): step time, phases and peak memory when logged, and the
``compute_efficiency`` and link bandwidths that make them agree.

``--recommend`` then also decides, for the best settings, which layers ``split`` (tensor
parallelism) pays off for and over how many ranks (:mod:`moetrain.planner.split`): with ``--json``
the output carries top-level ``parallel`` (``ep_size``, ``tp_size``) and ``strategy`` keys, so the
file is a strategy file ``moetrain train --config run.yaml --strategy plan.json`` accepts as is.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from moetrain.config import ALL_TO_ALL_ALGORITHMS, PP_SCHEDULES
from moetrain.planner.hardware import GPU_PRESETS, ClusterSpec, GiB, GPUSpec, cluster_preset, gbps_to_bytes
from moetrain.planner.model import resolve_model, run_recompute_settings
from moetrain.planner.plan import make_plan
from moetrain.planner.search import recommend
from moetrain.planner.settings import DEFAULT_MEMORY_HEADROOM, RECOMPUTE_MODES, PlanSettings
from moetrain.planner.split import recommend_split
from moetrain.validation import require_int, require_number

# Cluster flags: (argparse dest, flag, unit, zero allowed). Each must be a finite number > 0
# (>= 0 where zero is allowed); check_cluster_flags says which flag and range when not.
CLUSTER_FLAGS = (
    ("gpu_memory_gib", "--gpu-memory-gib", "GiB", False),
    ("peak_tflops", "--peak-tflops", "TFLOP/s", False),
    ("intra_node_gbs", "--intra-node-gbs", "GB/s", False),
    ("inter_node_gbps", "--inter-node-gbps", "Gb/s", False),
    ("intra_node_latency_us", "--intra-node-latency-us", "us", True),
    ("inter_node_latency_us", "--inter-node-latency-us", "us", True),
    ("host_memory_gib", "--host-memory-gib", "GiB", False),
    ("gpu_reserved_gib", "--gpu-reserved-gib", "GiB", True),
)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``plan`` command to an ``argparse`` sub-parser set; ``args.run`` is :func:`run_plan`."""
    plan = subparsers.add_parser(
        "plan",
        help="memory / communication / step-time plan of a model on a cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cluster_arguments(plan)
    _add_training_arguments(plan)
    _add_mode_arguments(plan)
    plan.set_defaults(run=run_plan)
    return plan


def _add_cluster_arguments(plan: argparse.ArgumentParser) -> None:
    """``--model`` and the cluster: GPU type and count, memory, FLOP/s, links."""
    plan.add_argument(
        "--model",
        help="a registered model's preset (<model>-<preset>: m6-1T, ...) or a YAML/JSON config file "
        "(required, except with --calibrate: the run's config)",
    )
    plan.add_argument(
        "--cluster", required=True, choices=sorted(GPU_PRESETS), type=str.lower, help="GPU type"
    )
    plan.add_argument("--nodes", required=True, type=int)
    plan.add_argument("--gpus-per-node", type=int, help="GPUs per node, >= 1 (default: the preset's, 8)")
    plan.add_argument("--gpu-memory-gib", type=float, help="memory per GPU, GiB > 0 (default: the preset's)")
    plan.add_argument(
        "--peak-tflops",
        type=float,
        help="dense peak TFLOP/s > 0 of one GPU in the training precision (default: the datasheet's)",
    )
    plan.add_argument("--inter-node-gbps", type=float, help="inter-node bandwidth per node, Gb/s > 0")
    plan.add_argument(
        "--intra-node-gbs", type=float, help="intra-node bandwidth per GPU and direction, GB/s > 0"
    )
    plan.add_argument(
        "--intra-node-latency-us",
        "--intra-latency-us",
        type=float,
        help="latency per intra-node message, microseconds >= 0 (default 10)",
    )
    plan.add_argument(
        "--inter-node-latency-us",
        "--inter-latency-us",
        type=float,
        help="latency per inter-node message, microseconds >= 0 (default 20)",
    )
    plan.add_argument("--host-memory-gib", type=float, help="host memory per node, GiB > 0")
    plan.add_argument(
        "--gpu-reserved-gib",
        type=float,
        help="GPU memory per GPU for the CUDA context, NCCL and fragmentation, GiB >= 0 "
        "(default: modelled per communicator and GPU type)",
    )
    plan.add_argument(
        "--memory-headroom",
        type=float,
        help=f"fraction of GPU memory kept free, in [0, 1) (default {DEFAULT_MEMORY_HEADROOM:g})",
    )


def _add_training_arguments(plan: argparse.ArgumentParser) -> None:
    """The training settings planned: parallel sizes, batch, precision, offload, recompute, all-to-all,
    routing."""
    plan.add_argument("--ep-size", type=int)
    plan.add_argument("--pp-size", type=int, help="pipeline stages (micro-batches: --grad-accum)")
    plan.add_argument("--pp-schedule", choices=PP_SCHEDULES)
    plan.add_argument("--pp-virtual", type=int, help="stages per rank (interleaved_1f1b)")
    plan.add_argument("--micro-batch", type=int, help="sequences per GPU per micro-step")
    plan.add_argument(
        "--seq-len", type=int, help="text tokens per sequence (default: the config's, else the model's max)"
    )
    plan.add_argument("--grad-accum", type=int)
    plan.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), help="default: bf16 where the GPU has it, else fp16"
    )
    plan.add_argument("--autocast", action="store_true", help="fp32 weights with autocast compute")
    plan.add_argument("--offload", action="store_true", help="optimizer states in host memory")
    plan.add_argument(
        "--optim-overlap",
        choices=("none", "delayed"),
        help="with --offload: 'delayed' runs the host optimizer of step t during step t+1 (one-step "
        "stale weights; default: the config's optim.overlap, else none; --recommend tries both)",
    )
    plan.add_argument(
        "--sync-checkpoint",
        action="store_true",
        help="checkpoints written synchronously: no host staging copy (default: a config's async_checkpoint)",
    )
    plan.add_argument("--recompute", choices=RECOMPUTE_MODES)
    plan.add_argument("--recompute-fraction", type=float)
    plan.add_argument("--recompute-budget-gib", type=float)
    plan.add_argument("--all-to-all", choices=ALL_TO_ALL_ALGORITHMS)
    plan.add_argument("--comm-dtype", choices=("bf16", "fp16"))
    plan.add_argument(
        "--a2a-chunks", help="chunks of the all-to-all overlapped with the experts: an integer >= 1 or 'auto'"
    )
    plan.add_argument("--capacity-factor", type=float, help="0: dropless (default: the model's)")
    plan.add_argument(
        "--max-nodes-per-token",
        type=int,
        help="node-limited routing: a token's experts on at most this many nodes of the EP group; the plan "
        "reports the nodes reached and inter-node bytes (0: no limit; default: the model's)",
    )


def _add_mode_arguments(plan: argparse.ArgumentParser) -> None:
    """What the command does besides the plan: --recommend, --mixed, --calibrate, and --json."""
    plan.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s reached (default 0.4)")
    plan.add_argument(
        "--recommend",
        action="store_true",
        help="search ep_size, offload, micro-batch; then the split strategy (with --json: a strategy file)",
    )
    plan.add_argument(
        "--global-batch", type=int, help="with --recommend or --mixed: sequences per step, fixed"
    )
    plan.add_argument(
        "--mixed",
        metavar="GPU:NODES[,GPU:NODES]",
        help="more nodes of other GPU types: print the balanced micro-batches and the speed-up",
    )
    plan.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="a moetrain train out_dir: its measured step time (and phases, peak memory when logged) "
        "against the plan of its config on this cluster, and the compute_efficiency / link constants "
        "that make them agree",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")


def cluster_and_settings(args, defaults: dict) -> tuple[ClusterSpec, PlanSettings]:
    """The cluster and the settings planned: the flags over the model's ``defaults``, the precision
    ``--precision``, else the config's, else bf16 where the GPU has it (fp16 otherwise)."""
    precision = args.precision or defaults.get("precision") or default_precision(GPU_PRESETS[args.cluster])
    return cluster_from_args(args, precision), settings_from_args(args, {"precision": precision, **defaults})


def settings_from_args(args, defaults: dict) -> PlanSettings:
    """PlanSettings from the command line over the config file's ``defaults``."""
    values = dict(defaults)
    if args.recompute is not None:  # the flag replaces the run's recompute (--calibrate)
        values.pop("recompute_budget_bytes", None)
    if args.seq_len is not None:  # the config's target length belongs to its own sequence length
        values.pop("target_len", None)
    options = {
        "ep_size": args.ep_size,
        "pp_size": args.pp_size,
        "pp_schedule": args.pp_schedule,
        "pp_virtual": args.pp_virtual,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "precision": args.precision,
        "recompute": args.recompute,
        "recompute_fraction": args.recompute_fraction,
        "all_to_all": args.all_to_all,
        "comm_dtype": args.comm_dtype,
        "a2a_chunks": _chunks_arg(args.a2a_chunks),
        "compute_efficiency": args.efficiency,
        "memory_headroom": args.memory_headroom,
    }
    values.update({k: v for k, v in options.items() if v is not None})
    if args.offload:
        values["offload"] = True
    if args.precision is not None:  # the engine's layout for it: fp32 weights with autocast compute,
        # unless the run stores its weights in its precision (param_dtype, with the offloaded optimizer)
        stored_low = defaults.get("precision", "fp32") != "fp32" and not defaults.get("autocast", False)
        values["autocast"] = args.precision != "fp32" and not (stored_low and values.get("offload"))
    if values.get("precision", "fp32") != "fp32" and not values.get("offload") and not args.recommend:
        values["autocast"] = True  # low-precision weights need the offloaded optimizer (--recommend:
        # the search sets it for each candidate without offload)
    if args.autocast:
        values["autocast"] = True
    if args.optim_overlap is not None and (values.get("offload") or not args.recommend):
        values["optim_overlap"] = args.optim_overlap  # --recommend: applied to its offloaded candidates
    if not values.get("offload") and args.recommend:
        values["optim_overlap"] = "none"
    if args.sync_checkpoint:
        values["async_checkpoint"] = False
    if args.capacity_factor is not None:
        values["capacity_factor"] = args.capacity_factor or None
    if args.max_nodes_per_token is not None:
        values["max_nodes_per_token"] = args.max_nodes_per_token or None
    if args.recompute_budget_gib is not None:
        values["recompute_budget_bytes"] = int(args.recompute_budget_gib * GiB)
    return PlanSettings(**values)


def _chunks_arg(value: str | None):
    """``--a2a-chunks``: None, ``"auto"`` or an integer (PlanSettings checks the range)."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--a2a-chunks must be an integer >= 1 or 'auto', got {value!r}") from None


def check_cluster_flags(args) -> None:
    """ValueError naming the flag and its allowed range for a cluster flag out of range (see
    ``CLUSTER_FLAGS``; ``--gpus-per-node``: an integer >= 1; ``--memory-headroom``: [0, 1))."""
    for dest, flag, unit, allow_zero in CLUSTER_FLAGS:
        if getattr(args, dest) is not None:
            require_number(flag, getattr(args, dest), low=0, low_open=not allow_zero, note=f"({unit})")
    if args.gpus_per_node is not None:
        require_int("--gpus-per-node", args.gpus_per_node, 1)
    if args.memory_headroom is not None:
        require_number(
            "--memory-headroom", args.memory_headroom, low=0, high=1, high_open=True,
            note="(fraction of GPU memory kept free)",
        )  # fmt: skip


def default_precision(gpu: GPUSpec) -> str:
    """``"bf16"`` where the GPU has a bf16 fast path, else ``"fp16"``."""
    return "bf16" if "bf16" in gpu.peak_flops else "fp16"


def gpu_from_args(args, precision: str) -> GPUSpec:
    """The ``--cluster`` GPU with ``--gpu-memory-gib`` (GiB -> bytes) and ``--peak-tflops`` (TFLOP/s
    -> FLOP/s, for ``precision``, the one the plan trains in) applied."""
    gpu = GPU_PRESETS[args.cluster]
    if args.gpu_memory_gib is not None:
        gpu = replace(gpu, memory_bytes=max(1, round(args.gpu_memory_gib * GiB)))
    if args.peak_tflops is not None:
        gpu = replace(gpu, peak_flops={**gpu.peak_flops, precision: args.peak_tflops * 1e12})
    return gpu


def cluster_from_args(args, precision: str) -> ClusterSpec:
    """The ``--cluster`` preset on ``--nodes`` nodes with every cluster flag given applied (units
    converted to bytes, bytes/s and seconds); flags checked by :func:`check_cluster_flags`."""
    check_cluster_flags(args)
    overrides = {"gpu": gpu_from_args(args, precision), **link_overrides(args)}
    return cluster_preset(args.cluster, args.nodes, **overrides)


def link_overrides(args) -> dict:
    """The cluster flags that are not about the GPU (node size, links, host memory), as
    ``cluster_preset`` keyword arguments."""
    overrides = {}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.inter_node_gbps is not None:
        overrides["inter_node_bandwidth"] = gbps_to_bytes(args.inter_node_gbps)
    if args.intra_node_gbs is not None:
        overrides["intra_node_bandwidth"] = args.intra_node_gbs * 1e9
    if args.intra_node_latency_us is not None:
        overrides["intra_node_latency"] = args.intra_node_latency_us * 1e-6
    if args.inter_node_latency_us is not None:
        overrides["inter_node_latency"] = args.inter_node_latency_us * 1e-6
    if args.host_memory_gib is not None:
        overrides["host_memory_bytes"] = round(args.host_memory_gib * GiB)
    if args.gpu_reserved_gib is not None:
        overrides["gpu_reserved_bytes"] = round(args.gpu_reserved_gib * GiB)
    return overrides


def parse_mixed(text: str) -> list[tuple[str, int]]:
    """``"p100-16gb:4,a100-80gb:2"`` -> ``[("p100-16gb", 4), ("a100-80gb", 2)]``; ValueError
    naming ``--mixed`` and the GPU presets for anything else."""
    parts = []
    for item in text.split(","):
        gpu, _, nodes = item.strip().lower().partition(":")
        if gpu not in GPU_PRESETS or not nodes.isdigit() or int(nodes) < 1:
            presets = ", ".join(sorted(GPU_PRESETS))
            raise ValueError(
                f"--mixed takes GPU:NODES pairs separated by commas, GPU one of {presets} and NODES an "
                f"integer >= 1; got {item.strip()!r}"
            )
        parts.append((gpu, int(nodes)))
    return parts


def run_mixed(args, model, settings: PlanSettings) -> int:
    """``--mixed``: the balanced plan of ``--cluster`` x ``--nodes`` plus the listed nodes."""
    from moetrain.planner.mixed import plan_mixed_cluster

    if args.recommend:
        raise ValueError("--mixed and --recommend cannot be combined: pick the settings, then balance")
    if args.gpu_memory_gib is not None or args.peak_tflops is not None:
        raise ValueError(
            "--gpu-memory-gib and --peak-tflops describe one GPU type; --mixed uses the presets'"
        )
    parts = [(args.cluster, args.nodes), *parse_mixed(args.mixed)]
    overrides = link_overrides(args)
    gpus = sum(nodes for _, nodes in parts) * overrides.get("gpus_per_node", 8)
    global_batch = args.global_batch or settings.micro_batch * gpus
    result = plan_mixed_cluster(model, parts, settings, global_batch, **overrides)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_table())
    return 0


def run_calibrate(args) -> int:
    """``--calibrate RUN_DIR`` (:mod:`moetrain.planner.calibrate`): prints the comparison; 0."""
    from moetrain.planner.calibrate import calibrate, read_run, run_model

    if args.recommend or args.mixed is not None:
        raise ValueError(
            "--calibrate compares one plan with a run: it cannot be combined with --recommend or --mixed"
        )
    run = read_run(args.calibrate)
    model, defaults = resolve_model(args.model) if args.model is not None else run_model(run)
    # the plan recomputes what the run did
    defaults = {**defaults, **run_recompute_settings(run.config.get("recompute_budget_mb"))}
    cluster, settings = cluster_and_settings(args, defaults)
    result = calibrate(model, cluster, settings, run)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_table())
    return 0


def run_plan(args) -> int:
    """Runs ``moetrain plan``; prints a table (or JSON) and returns 0 if it fits, else 1."""
    if args.calibrate is not None:
        return run_calibrate(args)
    if args.model is None:
        raise ValueError("--model is required (a preset or a config file), except with --calibrate RUN_DIR")
    model, defaults = resolve_model(args.model)
    cluster, settings = cluster_and_settings(args, defaults)
    if args.mixed is not None:  # the flags were checked by cluster_from_args
        return run_mixed(args, model, settings)
    if args.global_batch is not None and not args.recommend:
        raise ValueError("--global-batch is only used with --recommend or --mixed")
    if args.recommend:
        result = recommend(
            model,
            cluster,
            settings,
            ep_sizes=None if args.ep_size is None else [args.ep_size],
            offload=(True,) if args.offload else (False, True),
            optim_overlaps=("none", "delayed") if args.optim_overlap is None else (args.optim_overlap,),
            micro_batches=None if args.micro_batch is None else [args.micro_batch],
            recompute=(settings.recompute,),
            global_batch=args.global_batch,
        )
        split = None
        if result.best is not None:
            best = result.best
            split = recommend_split(
                model,
                cluster,
                best.settings,
                best.activations.forward_flops / best.settings.micro_batch,
                model.params.dense,
            )
        if args.json:
            out = result.to_dict()
            if split is not None:  # the strategy file `moetrain train --strategy` reads, and its reasons
                out.update(split.strategy_file(), split=split.to_dict())
            print(json.dumps(out, indent=2))
        else:
            print(result.format_table() + ("" if split is None else "\n\n" + split.format_table()))
        return 0 if result.best is not None else 1
    plan = make_plan(model, cluster, settings)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.format_table())
    return 0 if plan.fits else 1
