"""What one rank reads: the DCP requests for a model and optimizer, checked before anything is read,
and the optimizer state dict put together afterwards.

Every entry the current model and optimizer need is checked first (missing expert -> ``ValueError``
naming the key; shape mismatch -> ``ValueError`` naming the parameter; optimizer state saved by
another kind of optimizer -> ``ValueError`` naming its keys); only then is anything read.
Experts are read into views of one stacked buffer per parameter, so that a rank reads exactly the
experts it holds now, under any world size or ``ep_size``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.checkpoint.entries import expert_key
from moetrain.checkpoint.objects import decode_object, is_object_part, json_key, leaf_keys
from moetrain.checkpoint.ranks import CheckpointError
from moetrain.grad_sync import is_dtensor
from moetrain.layers.experts import local_tensor
from moetrain.validation import is_int


class Request:
    """The DCP state dict one rank reads (``entries``: tensor targets) and the stacked expert
    buffers that per-expert targets are views of (``assembled``). Objects are requested as their
    JSON tensor and tensor leaves and decoded by :meth:`value`."""

    def __init__(self, saved: dict[str, Any], path: Path, stored: dict[str, int] | None = None):
        self.saved = saved  # DCP key -> TensorStorageMetadata
        self.path = path
        self.stored = stored  # DCP key -> bytes of its records in the data files (None: unchecked)
        self.entries: dict[str, Any] = {}
        self.assembled: dict[str, torch.Tensor] = {}
        self.objects: set[str] = set()
        self.metadata = None  # the DCP Metadata read (by :meth:`of`), handed on to the reader

    @classmethod
    def of(cls, metadata, path: Path) -> Request:
        """The request over DCP ``metadata``: its entries and the bytes stored for each."""
        stored: dict[str, int] = {}
        for index, info in (metadata.storage_data or {}).items():
            length = getattr(info, "length", 0)
            stored[index.fqn] = stored.get(index.fqn, 0) + (length if isinstance(length, int) else 0)
        request = cls(metadata.state_dict_metadata, path, stored)
        request.metadata = metadata
        return request

    def tensor(self, key: str, shape, what: str, out: torch.Tensor | None = None) -> None:
        """Requests tensor entry ``key`` of ``shape`` into ``out`` (default: a new CPU tensor of the
        saved dtype); ValueError naming ``what`` when it is missing or has another shape."""
        md = self.saved.get(key)
        if md is None:
            raise ValueError(f"{what}: checkpoint {self.path} has no entry {key!r}")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{what}: entry {key!r} of checkpoint {self.path} is not a tensor")
        if tuple(md.size) != tuple(shape):
            raise ValueError(
                f"{what}: shape {tuple(shape)} here, {tuple(md.size)} in checkpoint {self.path} "
                f"(entry {key!r})"
            )
        self.entries[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if out is None else out

    def as_saved(self, key: str, what: str) -> None:
        """Requests ``key`` whatever it holds: a tensor (new, of the saved shape) or an object."""
        if key in self.saved:
            if not isinstance(self.saved[key], TensorStorageMetadata):
                raise CheckpointError(
                    f"{self.path}: entry {key!r} is a pickled object; moetrain checkpoints hold only tensors "
                    "and pickled objects are never loaded"
                )
            self.tensor(key, self._saved_size(key), what)
            return
        if json_key(key) not in self.saved:
            raise ValueError(f"{what}: checkpoint {self.path} has no entry {key!r}")
        self.objects.add(key)
        for part in (json_key(key), *leaf_keys(key, self.saved)):
            if not isinstance(self.saved[part], TensorStorageMetadata):
                raise CheckpointError(f"{self.path}: entry {part!r} of object {key!r} is not a tensor")
            self.tensor(part, self._saved_size(part), what)

    def _saved_size(self, key: str) -> tuple[int, ...]:
        """The metadata's size of tensor entry ``key``, which nothing here bounds: CheckpointError
        when a dimension is negative or its bytes (numel x element size) exceed the bytes stored
        for it (a crafted size would otherwise allocate them)."""
        md = self.saved[key]
        size = tuple(md.size)
        if any(not is_int(dim) or dim < 0 for dim in size):
            raise CheckpointError(f"{self.path}: entry {key!r} has a negative or non-integer size {size}")
        if self.stored is not None:
            nbytes = math.prod(size) * md.properties.dtype.itemsize
            if nbytes > self.stored.get(key, 0):
                raise CheckpointError(
                    f"{self.path}: entry {key!r} of size {size} ({nbytes} bytes) exceeds the "
                    f"{self.stored.get(key, 0)} bytes stored for it"
                )
        return size

    def value(self, key: str) -> Any:
        """A requested entry after the read: the tensor, or the decoded object."""
        if key in self.objects:
            try:
                return decode_object(key, self.entries)
            except ValueError as error:
                raise ValueError(f"checkpoint {self.path}: {error}") from None
        return self.entries[key]

    def has(self, key: str) -> bool:
        return key in self.saved or json_key(key) in self.saved


def _as_param_layout(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``buffer`` (this rank's rows) as a DTensor laid out like ``like`` when that is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return buffer
    return DTensor.from_local(
        buffer, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def request_model(
    request: Request, model: nn.Module, experts, manifest, ep_size: int, stage: bool = False
) -> None:
    """Checks and requests every entry of ``model.state_dict()``: dense ones into new tensors of
    the model's dtype (DTensors keep their layout: DCP reads this rank's shard), experts into views
    of one stacked buffer per parameter (this rank's rows). ``stage``: the model is one pipeline
    stage, the checkpoint may hold the other stages' entries too."""
    for name, (first, count, total) in experts.items():
        saved_count = manifest["experts"].get(name, 0)
        for local in range(count):
            key = "model/" + expert_key(name, first + local)
            if key not in request.saved:
                raise ValueError(
                    f"checkpoint {request.path} has no entry {key!r} (expert {first + local} of parameter "
                    f"{name!r}; the checkpoint holds {saved_count} experts of it, this model {total})"
                )
        if saved_count != total:
            raise ValueError(
                f"expert parameter {name!r}: the checkpoint {request.path} holds {saved_count} experts, this "
                f"model has {total} (ep_size {ep_size})"
            )
    expected = set()
    for name, value in model.state_dict().items():
        what = f"parameter {name!r}"
        if name in experts:
            first, count, _ = experts[name]
            local = local_tensor(value)
            buffer = torch.empty(local.shape, dtype=value.dtype, device=local.device)
            for row in range(count):
                key = "model/" + expert_key(name, first + row)
                request.tensor(key, value.shape[1:], f"{what} (expert {first + row})", out=buffer[row])
            request.assembled[name] = _as_param_layout(buffer, value)
            continue
        key = "model/" + name
        expected.add(key)
        if isinstance(value, torch.Tensor):
            request.tensor(key, value.shape, what, out=torch.empty_like(value))
        else:
            request.as_saved(key, what)
    if stage:
        return
    lacking = sorted(set(manifest["experts"]) - set(experts))
    if lacking:
        raise ValueError(f"checkpoint {request.path} has expert parameters this model lacks: {lacking[:5]}")
    expert_prefixes = tuple("model/" + expert_key(name, "") for name in experts)
    unexpected = sorted(
        k
        for k in request.saved
        if k.startswith("model/")
        and not is_object_part(k)
        and k not in expected
        and not k.startswith(expert_prefixes)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {request.path} has model entries this model lacks: {unexpected[:5]}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )


@dataclass
class StatePlan:
    """How one parameter's optimizer state is put together after the read."""

    name: str
    entries: list[str]  # "optim/<entry>": one (dense parameter) or one per local expert
    keys: list[str]  # state keys saved for it (empty: no state)
    stacked: dict[str, torch.Tensor]  # state key -> stacked buffer (split expert state)


def _state_keys_index(saved) -> dict[str, list[str]]:
    """``{"optim/<entry>": sorted state keys}`` of every optimizer entry saved (tensors and objects
    alike): keys are ``optim/<entry>/<key>`` and parameter names hold no ``/``. One pass."""
    index: dict[str, set[str]] = {}
    for key in saved:
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] == "optim":
            index.setdefault(f"optim/{parts[1]}", set()).add(parts[2])
    return {entry: sorted(keys) for entry, keys in index.items()}


def request_optimizer(request: Request, optimizer, names: dict[int, str], experts) -> list[StatePlan]:
    """Requests the state of every optimizer parameter, in param-group order."""
    if not request.has("optim/param_groups"):
        raise ValueError(f"optimizer: checkpoint {request.path} has no entry 'optim/param_groups'")
    request.as_saved("optim/param_groups", "optimizer param groups")
    state_keys = _state_keys_index(request.saved)
    fitting: dict[tuple[int, int], tuple[set[str] | None, set[str] | None]] = {}
    plans = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise ValueError(f"optimizer param group {g}: param {i} is not a parameter of the model")
            name = names[id(param)]
            if name in experts:
                first, count, _ = experts[name]
                rows = [f"optim/{expert_key(name, first + local)}" for local in range(count)]
                # a rank holding none of its rows (FSDP with fewer rows than shards) still takes the
                # state keys and the unsplit values (the step) of the parameter: expert 0's
                entries = rows or [f"optim/{expert_key(name, 0)}"]
            else:
                rows = entries = [f"optim/{name}"]
            key_sets = [state_keys.get(e, []) for e in entries]
            for entry, keys in zip(entries, key_sets, strict=True):
                if keys != key_sets[0]:
                    raise ValueError(
                        f"optimizer state of parameter {name!r}: {entry!r} has entries {keys}, "
                        f"{entries[0]!r} has {key_sets[0]} in checkpoint {request.path}"
                    )
            _check_state_keys(optimizer, g, param, name, key_sets[0], request.path, fitting)
            plan = StatePlan(name, entries, key_sets[0], {})
            for key in plan.keys:
                what = f"optimizer state {key!r} of parameter {name!r}"
                md = request.saved.get(f"{entries[0]}/{key}")
                per_expert = (
                    name in experts
                    and isinstance(md, TensorStorageMetadata)
                    and tuple(md.size) == tuple(param.shape[1:])
                )
                if per_expert:
                    buffer = torch.empty(tuple(local_tensor(param).shape), dtype=md.properties.dtype)
                    for local, entry in enumerate(rows):
                        request.tensor(f"{entry}/{key}", param.shape[1:], what, out=buffer[local])
                    plan.stacked[key] = _as_param_layout(buffer, param)
                elif (
                    is_dtensor(param)
                    and isinstance(md, TensorStorageMetadata)
                    and tuple(md.size) == tuple(param.shape)
                ):  # state laid out like its DTensor parameter: read this rank's shard
                    target = torch.empty_like(param.detach(), dtype=md.properties.dtype)
                    request.tensor(f"{entries[0]}/{key}", param.shape, what, out=target)
                else:
                    for entry in entries:
                        request.as_saved(f"{entry}/{key}", what)
            plans.append(plan)
    return plans


def _check_state_keys(
    optimizer, g: int, param, name: str, keys: list[str], path: Path, fitting: dict
) -> None:
    """ValueError when the state ``keys`` saved for parameter ``name`` (none: fresh state, fits
    any optimizer) lack a key this optimizer's state of it needs, or hold one it refuses (another
    kind of optimizer saved them). ``fitting``: ``{(g, ndim): (needed, allowed)}`` found so far."""
    if not keys:
        return
    if (g, param.dim()) not in fitting:
        fitting[g, param.dim()] = _optimizer_state_keys(optimizer, g, param.dim())
    needed, allowed = fitting[g, param.dim()]
    if needed is None:
        return
    if not needed <= set(keys) or (allowed is not None and not set(keys) <= allowed):
        inner = getattr(optimizer, "optimizer", optimizer)  # GroupwiseApply wraps one
        raise ValueError(
            f"optimizer: checkpoint {path} state keys {keys} of parameter {name!r} do not fit "
            f"{type(inner).__name__} (it needs {sorted(needed)}"
            + (f", allows {sorted(allowed)})" if allowed is not None else ")")
        )


def _optimizer_state_keys(optimizer, g: int, ndim: int) -> tuple[set[str] | None, set[str] | None]:
    """``(needed, allowed)`` state keys of a parameter of ``ndim`` dimensions in param group ``g``
    (``allowed`` None: any more keys are kept as they are). For torch-style optimizers ``needed``
    is what one step of a fresh optimizer of the same class and options creates for a tensor of
    ones of that rank on the CPU; (None, None) when such an optimizer cannot be built or stepped."""
    from moetrain.offload.groupwise import GroupwiseApply
    from moetrain.offload.optimizer import OffloadOptimizer
    from moetrain.offload.optimizer_state import PENDING_KEY, STATE_KEYS

    if isinstance(optimizer, GroupwiseApply):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, OffloadOptimizer):  # its load_state_dict checks these (master optional)
        return {"step", "exp_avg", "exp_avg_sq"}, {*STATE_KEYS, PENDING_KEY}
    cls = type(optimizer)
    group = optimizer.param_groups[g]
    try:
        accepted = inspect.signature(cls.__init__).parameters
        options = {k: v for k, v in group.items() if k in accepted and k != "params"}
        probe = torch.ones((1,) * ndim, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        stepped = cls([probe], **options)
        stepped.step()
    except Exception:  # noqa: BLE001 - an optimizer this cannot probe: its keys are not checked
        return None, None
    return set(stepped.state[probe]), None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def optimizer_state_dict(
    request: Request, plans: list[StatePlan], optimizer, path: Path, stage: bool = False
) -> dict[str, Any]:
    """A torch-style optimizer state dict (params numbered in this optimizer's order). ``stage``:
    the optimizer holds one pipeline stage's parameters, a part of each saved group's."""
    state = {}
    for index, plan in enumerate(plans):
        if not plan.keys:
            continue
        values = {}
        for key in plan.keys:
            if key in plan.stacked:
                values[key] = plan.stacked[key]
                continue
            candidates = [request.value(f"{entry}/{key}") for entry in plan.entries]
            if any(not _same(c, candidates[0]) for c in candidates):
                raise ValueError(
                    f"optimizer state {key!r} of parameter {plan.name!r}: the experts stacked into it on "
                    f"this rank have different values in checkpoint {path}"
                )
            values[key] = candidates[0]
        state[index] = values
    saved_groups = request.value("optim/param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        count = len(saved_groups) if isinstance(saved_groups, list) else "no"
        raise ValueError(
            f"optimizer: {len(optimizer.param_groups)} param groups here, {count} in checkpoint {path}"
        )
    # State is keyed by parameter name, so a parameter may change groups (a newer version's
    # grouping applies); the parameters of all groups together must be the checkpoint's.
    names_in_order = [plan.name for plan in plans]
    here, saved_names = set(names_in_order), {name for saved in saved_groups for name in saved["params"]}
    if (not here <= saved_names) if stage else here != saved_names:
        missing, extra = sorted(here - saved_names), sorted(saved_names - here)
        raise ValueError(
            f"optimizer: parameters differ from checkpoint {path}: not in the checkpoint's param groups: "
            f"{missing[:5]}, only in the checkpoint's: {extra[:5]}"
        )
    groups, index = [], 0
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        count = len(group["params"])
        # the saved options; one the checkpoint lacks (another kind of optimizer saved it, one
        # without state) keeps this optimizer's value
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        options.update((k, v) for k, v in saved.items() if k != "params")
        groups.append({**options, "params": list(range(index, index + count))})
        index += count
    return {"state": state, "param_groups": groups}


def take_offload_masters(
    state_dict: dict[str, Any], plans: list[StatePlan], optimizer, path: Path
) -> list[tuple[Any, torch.Tensor]]:
    """Removes ``OffloadOptimizer``'s own state keys, ``master`` (fp32, the param's shape) and
    ``pending``, from ``state_dict`` (made by :func:`optimizer_state_dict` from ``plans``) when
    ``optimizer`` is another kind (a ``GroupwiseApply`` counts as the one it wraps) whose own state
    of that param has no such key. Returns ``[(param, master)]`` of the params whose ``pending`` is
    not 0 (``overlap="delayed"``: the saved weight lacks the last update, which ``master`` holds):
    each master is to be written, cast to the param's dtype, into its param. Elsewhere the saved
    weight already is the cast master. ValueError naming the param when such a master's shape is
    not its param's.
    """
    from moetrain.offload.groupwise import GroupwiseApply
    from moetrain.offload.optimizer import OffloadOptimizer
    from moetrain.offload.optimizer_state import PENDING_KEY

    inner = optimizer.optimizer if isinstance(optimizer, GroupwiseApply) else optimizer
    if isinstance(inner, OffloadOptimizer):
        return []
    offload_keys = {"master", PENDING_KEY}
    params = [(g, param) for g, group in enumerate(optimizer.param_groups) for param in group["params"]]
    own: dict[tuple[int, int], set[str]] = {}  # (group, ndim) -> this optimizer's state keys
    masters = []
    for index, values in state_dict["state"].items():
        if not offload_keys & set(values):
            continue
        g, param = params[index]
        if (g, param.dim()) not in own:
            own[g, param.dim()] = _optimizer_state_keys(optimizer, g, param.dim())[0] or set()
        if offload_keys & own[g, param.dim()]:
            continue  # keys of this optimizer's own
        master = values.pop("master", None)
        pending = values.pop(PENDING_KEY, None)
        where = f"parameter {plans[index].name!r} in checkpoint {path}"
        if pending is not None and not (isinstance(pending, torch.Tensor) and pending.numel() == 1):
            raise ValueError(f"optimizer state {PENDING_KEY!r} of {where}: must be a 1-element tensor")
        if master is None or pending is None or float(pending) == 0.0:
            continue
        if not isinstance(master, torch.Tensor) or tuple(master.shape) != tuple(param.shape):
            shape = tuple(master.shape) if isinstance(master, torch.Tensor) else type(master).__name__
            raise ValueError(
                f"optimizer state 'master' of {where}: shape {shape}, the parameter's is {tuple(param.shape)}"
            )
        masters.append((param, master))
    return masters
