"""Memory / communication / time planner for MoE training on large clusters.

    from moetrain.planner import (
        PlanSettings, cluster_preset, gbps_to_bytes, make_plan, recommend, resolve_model,
    )

    model, _ = resolve_model("m6-1T")
    cluster = cluster_preset("v100-32gb", nodes=60, inter_node_bandwidth=gbps_to_bytes(35))
    plan = make_plan(model, cluster, PlanSettings(ep_size=480, micro_batch=8, precision="fp16", offload=True))
    print(plan.format_table())  # or plan.to_dict() for JSON
    best = recommend(model, cluster, PlanSettings(precision="fp16")).best

Modules: ``hardware`` (GPU and cluster presets), ``settings`` (PlanSettings), ``model`` (architecture
and exact parameter counts on ``meta``), ``activations`` (analytic saved bytes and FLOPs per
layer), ``comm`` (bytes per collective and alpha-beta time), ``plan`` (make_plan, which runs the
stages ``plan_layout``, ``plan_memory``, ``plan_traffic``, ``plan_time`` and builds the Plan),
``search`` (recommend), ``report`` (tables), ``cli`` (``moetrain plan``). See ``docs/planner.md``.
"""

from moetrain.planner.hardware import GPU_PRESETS, ClusterSpec, GPUSpec, cluster_preset, gbps_to_bytes
from moetrain.planner.model import ModelArch, ModelDescription, ParameterCount, describe, resolve_model
from moetrain.planner.plan import Plan, make_plan
from moetrain.planner.search import Candidate, Recommendation, recommend
from moetrain.planner.settings import PlanSettings

__all__ = [
    "GPU_PRESETS",
    "Candidate",
    "ClusterSpec",
    "GPUSpec",
    "ModelArch",
    "ModelDescription",
    "ParameterCount",
    "Plan",
    "PlanSettings",
    "Recommendation",
    "cluster_preset",
    "describe",
    "gbps_to_bytes",
    "make_plan",
    "recommend",
    "resolve_model",
]
