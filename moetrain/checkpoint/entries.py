"""What one rank saves: the flat DCP state dict of a model, its optimizer and the run's objects.

DCP keys (``<name>`` a name from ``model.named_parameters()`` / ``model.state_dict()``, ``<g>`` a
global expert index, ``<r>`` a rank at save time):

- ``model/<name>``: a dense parameter or buffer; replicated (every rank offers it, DCP keeps one
  copy: dense values must be equal on every rank, as data parallelism keeps them), or a DTensor
  (a split layer's shards, FSDP's): saved with its global shape, each rank writing its shard, so
  that DCP reshards it into any layout (a plain tensor at world 1 included);
- ``model/<name>.expert.<g>``: expert ``g`` of a ``GroupedExperts`` parameter (``w[g - first]``;
  under FSDP each rank writes the experts whose rows its shard holds);
- ``optim/<entry>/<key>``: optimizer state ``<key>`` (``step``, ``exp_avg``, ``exp_avg_sq``, and
  ``master`` for ``OffloadOptimizer``) of ``<entry>`` = ``<name>`` or ``<name>.expert.<g>``.
  A state tensor of the parameter's shape is split per expert; anything else (``step``) is
  stored per expert as is and must agree between the experts stacked into one parameter on load;
- ``optim/param_groups``: the param groups' options, ``params`` given as parameter names;
- ``scheduler``: ``scheduler.state_dict()``;
- ``extra_state/rank_<r>`` and ``rng/rank_<r>``: per-rank objects: the caller's ``extra_state``
  and the RNG states (``torch`` CPU, CUDA when CUDA is initialised, Python ``random``).

Values that are not tensors are stored as JSON objects (:mod:`moetrain.checkpoint.objects`).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from moetrain.checkpoint.objects import encode_object
from moetrain.layers.experts import GroupedExperts, local_rows, local_tensor


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (names without ``module.``)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def expert_params(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{parameter name: (first global expert, count, total experts)}`` of every GroupedExperts
    parameter (the stacked ``[E_local, ...]`` weights): the experts whose rows this rank holds
    (all its layer's local experts; under FSDP the rows of its shard) and the layer's total."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname, param in module.named_parameters(recurse=False):
                name = f"{prefix}.{pname}" if prefix else pname
                if param.shape[0] != module.num_experts:
                    raise ValueError(
                        f"expert parameter {name!r} must have num_experts = {module.num_experts} rows, "
                        f"got shape {tuple(param.shape)}"
                    )
                first_row, rows = local_rows(param)
                found[name] = (module.first_expert + first_row, rows, module.total_experts)
    return found


def expert_key(name: str, index: int | str) -> str:
    return f"{name}.expert.{index}"


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def model_entries(model: nn.Module, experts: dict[str, tuple[int, int]]) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        if name in experts:
            first, count, _ = experts[name]
            rows = local_tensor(value)
            for local in range(count):
                entries["model/" + expert_key(name, first + local)] = rows[local]
        else:
            entries["model/" + name] = value  # a DTensor (split, FSDP) is saved as one: DCP reshards it
    return entries


def optimizer_entries(
    optimizer: torch.optim.Optimizer, names: dict[int, str], experts: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    state_dict = optimizer.state_dict()
    by_index: dict[Any, tuple[str, torch.Tensor]] = {}
    groups = []
    for g, (saved, group) in enumerate(zip(state_dict["param_groups"], optimizer.param_groups, strict=True)):
        group_names = []
        for i, (index, param) in enumerate(zip(saved["params"], group["params"], strict=True)):
            if id(param) not in names:
                raise ValueError(f"optimizer param group {g}: param {i} is not a parameter of the model")
            by_index[index] = (names[id(param)], param)
            group_names.append(names[id(param)])
        options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        groups.append({**options, "params": group_names})
    entries: dict[str, Any] = {"optim/param_groups": groups}
    for index, state in state_dict["state"].items():
        name, param = by_index[index]
        if name in experts:
            first, count, _ = experts[name]
            for local in range(count):
                for key, value in state.items():
                    split = isinstance(value, torch.Tensor) and value.shape == param.shape
                    entries[f"optim/{expert_key(name, first + local)}/{key}"] = (
                        local_tensor(value)[local] if split else value
                    )
        else:
            for key, value in state.items():
                entries[f"optim/{name}/{key}"] = value
    return entries


def rng_state() -> dict[str, Any]:
    """torch CPU, CUDA (only when CUDA is initialised in this process) and Python ``random``."""
    return {
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any]) -> list[str]:
    """Restores what this process can; returns the names restored."""
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    restored = ["torch_cpu", "python"]
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
        restored.append("cuda")
    return restored


def encode_objects(entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``entries`` with every non-tensor value encoded as a JSON object (tensors kept as they are)."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in entries.items():
        if isinstance(value, torch.Tensor):
            flat[key] = value
        else:
            flat.update(encode_object(key, value))
    return flat


def non_finite_entries(entries: dict[str, Any], limit: int = 3) -> list[str]:
    """Keys of floating-point tensor entries holding inf or NaN (at most ``limit``). One device
    synchronisation per device when everything is finite."""
    floating = [
        (k, local_tensor(v))
        for k, v in entries.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in floating:
        by_device.setdefault(value.device, []).append((key, value))
    found = []
    for items in by_device.values():
        finite_K = torch.stack([value.isfinite().all() for _, value in items])
        if bool(finite_K.all()):
            continue
        found += [key for (key, _), ok in zip(items, finite_K.tolist(), strict=True) if not ok]
    return found[:limit]
