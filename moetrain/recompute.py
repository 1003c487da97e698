"""Automatic activation checkpointing ("recompute") under a memory budget.

:func:`auto_checkpoint` profiles one training step of a model, chooses which blocks to recompute in
the backward pass so that the activations saved for backward fit a byte budget at the least extra
forward time, and wraps those blocks with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Terms (one name each, everywhere):

- *candidate*: a module that may be recomputed. Default rule (:func:`default_candidates`): every
  child of an outermost ``nn.ModuleList`` (a *layer*), and each direct child of a layer that is a
  :class:`~moetrain.MoELayer` or an attention module (``nn.MultiheadAttention`` or a class whose
  name ends in ``Attention``). Candidates nest: a candidate inside another is its *sub-block*.
- *group*: a top-level candidate with all its sub-blocks. Within a group at most one of any
  candidate and its ancestors is recomputed, so a layer offers the *options*
  {none, attn, ffn, attn+ffn, whole layer}.
- *saved bytes*: the unique storages that autograd saves for backward during the forward
  (``saved_tensors_hooks``), storage ``nbytes``, parameters and buffers excluded.
- *kept bytes* of a recomputed block: what must survive until its backward, namely its inputs
  (the checkpoint boundary) plus, for every MoELayer inside it, the routing/all-to-all replay
  (``T*k*8 + (N_received + N_returned) * D * itemsize``, rows only under expert parallelism;
  see :func:`moe_replay_bytes`).

Memory model, for a set R of recomputed blocks (upper bound of the true union; exact when no
storage is shared between two groups)::

    activation_bytes(R) = outside + sum_g bytes(g, R)
    bytes(g, R) = |storages saved in g outside recomputed blocks  U  kept storages of R in g|

``outside`` is what is saved outside every candidate (embedding, final norm, head); storages
already counted there are free for the groups. Cost model: ``recompute_ms(R) = sum_{b in R}
forward_ms(b)``, the measured forward time of each block (median of ``timing_repeats`` forwards).

The choice is exact: a multiple-choice knapsack (one option per group, minimise time subject to
``activation_bytes <= budget``) solved by dynamic programming over the Pareto frontier of
(bytes, ms) pairs, which needs no discretisation of the byte axis (:func:`solve_recompute`).

MoE rule: a recomputed MoELayer must not re-route nor re-communicate, so every MoELayer inside a
recomputed block gets ``set_recompute_replay(True)``: its first forward records the routing decision
and the all-to-all outputs and the recompute replays them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.layers import MoELayer
from moetrain.layers.dispatch import AllToAllTokenDispatcher
from moetrain.layers.experts import local_tensor
from moetrain.layers.node_dispatch import NodeDedupTokenDispatcher
from moetrain.validation import require_bool, require_int, require_number

log = logging.getLogger(__name__)

StorageKey = tuple[str, int, int]  # (device type, device index, data pointer)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockProfile:
    """One candidate, measured over the profiled forward (all its calls summed).

    ``saved_bytes``: unique storages saved for backward inside it (sub-blocks included), not
    recomputed. ``input_bytes``: unique storages of its tensor inputs. ``replay_bytes``: MoE replay
    kept when it is recomputed. ``kept_bytes = input_bytes + replay_bytes`` (before de-duplication
    against the rest of its group). ``forward_ms``: its forward time, the cost of recomputing it.
    """

    name: str
    parent: str | None
    calls: int
    saved_bytes: int
    input_bytes: int
    replay_bytes: int
    forward_ms: float

    @property
    def kept_bytes(self) -> int:
        return self.input_bytes + self.replay_bytes


@dataclass(frozen=True)
class RecomputeOption:
    """One way to treat a group: the blocks recomputed, the group's activation bytes, the cost."""

    recomputed: tuple[str, ...]
    activation_bytes: int
    recompute_ms: float


@dataclass(frozen=True)
class ActivationProfile:
    """What :func:`profile_activations` measured.

    ``baseline_bytes``: saved bytes of the whole forward without recompute (exact union).
    ``outside_bytes``: saved outside every candidate. ``groups[i]``: the options of the i-th
    top-level candidate (option 0 recomputes nothing). ``blocks``: every candidate, by name.
    """

    baseline_bytes: int
    outside_bytes: int
    blocks: dict[str, BlockProfile]
    groups: tuple[tuple[RecomputeOption, ...], ...]

    @property
    def min_activation_bytes(self) -> int:
        """The least activation memory any choice reaches."""
        return self.outside_bytes + sum(min(o.activation_bytes for o in g) for g in self.groups)

    def cost_of(self, recomputed: Sequence[str]) -> tuple[int, float]:
        """``(activation_bytes, recompute_ms)`` of recomputing exactly ``recomputed``, by the model
        above. Raises ValueError if the set is not one option per group (e.g. a block and its
        sub-block together, or an unknown name)."""
        wanted = set(recomputed)
        total_bytes, total_ms = self.outside_bytes, 0.0
        for options in self.groups:
            names = {n for o in options for n in o.recomputed}
            match = [o for o in options if set(o.recomputed) == wanted & names]
            if not match:
                raise ValueError(
                    "recomputed must name at most one of a block and its sub-blocks, "
                    f"got {sorted(wanted & names)}"
                )
            total_bytes += match[0].activation_bytes
            total_ms += match[0].recompute_ms
        unknown = wanted - set(self.blocks)
        if unknown:
            raise ValueError(
                f"recomputed must name profiled candidates {sorted(self.blocks)}, got {sorted(unknown)}"
            )
        return total_bytes, total_ms


@dataclass(frozen=True)
class RecomputePlan:
    """The blocks to recompute and what that buys.

    ``activation_bytes``: estimated saved bytes with the plan (<= ``memory_budget_bytes``);
    ``saved_bytes = baseline_bytes - activation_bytes``; ``recompute_ms``: expected extra forward
    time per step; ``moe_replay``: MoELayers switched to routing replay.
    """

    recomputed: tuple[str, ...]
    memory_budget_bytes: int
    activation_bytes: int
    baseline_bytes: int
    min_activation_bytes: int
    recompute_ms: float
    moe_replay: tuple[str, ...]
    profile: ActivationProfile = field(repr=False)

    @property
    def saved_bytes(self) -> int:
        return self.baseline_bytes - self.activation_bytes

    def summary(self) -> str:
        """The plan as printed by :func:`auto_checkpoint`."""
        lines = [
            f"auto_checkpoint: budget {format_bytes(self.memory_budget_bytes)}; activations "
            f"{format_bytes(self.baseline_bytes)} without recompute -> {format_bytes(self.activation_bytes)} "
            f"with this plan (saves {format_bytes(self.saved_bytes)}; minimum possible "
            f"{format_bytes(self.min_activation_bytes)})",
            f"  recompute {len(self.recomputed)} block(s), expected +{self.recompute_ms:.3f} ms per step",
        ]
        width = max((len(n) for n in self.recomputed), default=0)
        for name in self.recomputed:
            block = self.profile.blocks[name]
            replay = f" + {format_bytes(block.replay_bytes)} MoE replay" if block.replay_bytes else ""
            lines.append(
                f"    {name:<{width}}  keeps {format_bytes(block.input_bytes)} input{replay} "
                f"instead of {format_bytes(block.saved_bytes)}, recompute {block.forward_ms:.3f} ms"
            )
        return "\n".join(lines)


def format_bytes(num_bytes: float) -> str:
    """``1536 -> '1.50 KiB'`` (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention")


def default_candidates(model: nn.Module) -> list[str]:
    """Names of the default candidates: each child of an outermost ``nn.ModuleList`` (a layer; a
    child that is itself a ModuleList is looked into instead), and each direct child of a layer that
    is a MoELayer or attention (``nn.MultiheadAttention``, or a class name ending in ``Attention``)."""
    names: list[str] = []
    layers: list[str] = []
    for list_name, module_list in model.named_modules():
        if not isinstance(module_list, nn.ModuleList):
            continue
        if any(list_name.startswith(layer + ".") for layer in layers):
            continue  # a ModuleList inside a layer: the layer is the unit
        for child_name, child in module_list.named_children():
            if isinstance(child, nn.ModuleList):
                continue
            layer = f"{list_name}.{child_name}" if list_name else child_name
            layers.append(layer)
            names.append(layer)
            for sub_name, sub in child.named_children():
                if isinstance(sub, MoELayer) or _is_attention(sub):
                    names.append(f"{layer}.{sub_name}")
    return names


def _is_inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name.startswith(ancestor + ".")


def _resolve_candidates(model: nn.Module, candidates: Sequence[str] | None) -> dict[str, nn.Module]:
    explicit = candidates is not None
    if explicit and (isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates)):
        raise ValueError(f"candidates must be a list of module names (str), got {candidates!r}")
    names = list(candidates) if explicit else default_candidates(model)
    if not names:
        raise ValueError(
            "candidates: the model has no default candidate (children of an nn.ModuleList and their "
            "attention / MoELayer children); pass candidates=[module names]"
        )
    modules = dict(model.named_modules())
    resolved: dict[str, nn.Module] = {}
    seen: dict[int, str] = {}
    for name in names:
        if name not in modules:
            raise ValueError(f"candidates must name submodules of the model, got {name!r}")
        module = modules[name]
        if id(module) in seen:
            raise ValueError(
                f"candidates must be distinct modules, got {seen[id(module)]!r} and {name!r} (same module)"
            )
        seen[id(module)] = name
        resolved[name] = module
    return resolved


# ---------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> StorageKey:
    t = local_tensor(t)  # a DTensor (split or FSDP parameter) has no storage of its own: its shard has
    return (t.device.type, -1 if t.device.index is None else t.device.index, t.untyped_storage().data_ptr())


def _tensors_in(args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


class _SavedHolder:
    """What the pack hook returns: lives exactly as long as autograd keeps the saved tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _SavedTensorRecorder:
    """Records every tensor saved for backward during a forward, with the innermost module of
    ``owners`` running at the time. ``live_storages()`` lists the storages still saved."""

    def __init__(self, model: nn.Module, owners: dict[str, nn.Module]):
        self.static_keys = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.stack: list[str] = []
        self.entries: list[tuple[StorageKey, int, str | None, object]] = []
        self.inputs: dict[str, dict[StorageKey, int]] = {name: {} for name in owners}
        self.calls: dict[str, int] = dict.fromkeys(owners, 0)
        self._alive: list[torch.Tensor] = []  # keeps input storages from being reused mid-forward
        self._handles = []
        for name, module in owners.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name), always_call=True))

    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            self.stack.append(name)
            self.calls[name] += 1
            for t in _tensors_in(args, kwargs):
                key = _storage_key(t)
                if key not in self.static_keys:
                    self._alive.append(t)
                    self.inputs[name][key] = t.untyped_storage().nbytes()

        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            popped = self.stack.pop()
            if popped != name:
                raise RuntimeError(f"module hooks out of order: left {name!r} while in {popped!r}")

        return hook

    def pack(self, tensor: torch.Tensor) -> _SavedHolder:
        holder = _SavedHolder(tensor)
        key = _storage_key(tensor)
        if key not in self.static_keys:
            owner = self.stack[-1] if self.stack else None
            self.entries.append((key, tensor.untyped_storage().nbytes(), owner, weakref.ref(holder)))
        return holder

    @staticmethod
    def unpack(holder: _SavedHolder) -> torch.Tensor:
        return holder.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def live_storages(self) -> dict[str | None, dict[StorageKey, int]]:
        """Storages still saved, by owner (``None``: outside every owner)."""
        by_owner: dict[str | None, dict[StorageKey, int]] = {}
        for key, nbytes, owner, ref in self.entries:
            if ref() is not None:
                by_owner.setdefault(owner, {})[key] = nbytes
        return by_owner

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._alive.clear()


def moe_replay_bytes(
    num_tokens: int,
    top_k: int,
    received_rows: int,
    returned_rows: int,
    d_model: int,
    itemsize: int,
    copy_rows: int = 0,
    gate_bytes: int = 0,
) -> int:
    """Bytes one call of a MoELayer with ``set_recompute_replay(True)`` keeps until its recompute:
    ``T*k*8`` (the int64 expert ids) ``+ (N_received + N_returned + copies) * D * itemsize`` (the
    rows each all-to-all delivered, in the experts' compute dtype; 0 without expert parallelism)
    ``+ gate_bytes``. ``copy_rows``, ``gate_bytes``: ``all_to_all="node_dedup"`` also records the
    token copies it received and the partial rows it got back, and the gates it received. The
    dispatch plan in the record is not counted: the autograd graph holds it with or without replay."""
    rows = received_rows + returned_rows + copy_rows
    return num_tokens * top_k * 8 + rows * d_model * itemsize + gate_bytes


class _MoEReplayRecorder:
    """Per MoELayer, the replay bytes its calls would keep (:func:`moe_replay_bytes`), summed.

    ``N_received`` = rows the local experts computed; ``N_returned`` = slots of this rank's tokens
    kept by the capacity cut (``last_stats.kept_per_expert``); rows only count when the layer's
    dispatcher communicates (:class:`AllToAllTokenDispatcher`; :class:`NodeDedupTokenDispatcher`
    records the rows of its round's four exchanges, ``last_round_rows``)."""

    def __init__(self, moe_layers: dict[str, MoELayer]):
        self.replay_bytes: dict[str, int] = dict.fromkeys(moe_layers, 0)
        self._pending: dict[str, dict] = {}
        self._handles = []
        for name, layer in moe_layers.items():
            self._handles += [
                layer.register_forward_pre_hook(self._layer_pre(name), with_kwargs=True),
                layer.experts.register_forward_pre_hook(self._experts_pre(name)),
                layer.register_forward_hook(self._layer_post(name)),
            ]

    def _layer_pre(self, name):
        def hook(layer, args, kwargs):
            (x,) = _tensors_in(args, kwargs)[:1]
            self._pending[name] = {"tokens": x.numel() // x.shape[-1]}

        return hook

    def _experts_pre(self, name):
        def hook(experts, args):
            x_ND = args[0]
            self._pending[name].update(
                received=x_ND.shape[0], d_model=x_ND.shape[1], itemsize=x_ND.element_size()
            )

        return hook

    def _layer_post(self, name):
        def hook(layer, args, output):
            call = self._pending.pop(name)
            if "received" not in call:  # the chunked exchange computes the experts without the module
                call["received"], call["d_model"], call["itemsize"] = layer.dispatcher.last_received
            communicates = isinstance(layer.dispatcher, AllToAllTokenDispatcher)
            received = call["received"] if communicates else 0
            returned = int(layer.last_stats.kept_per_expert.sum()) if communicates else 0
            copies = gates = 0
            if isinstance(layer.dispatcher, NodeDedupTokenDispatcher):
                sent, copies_received, returned = layer.dispatcher.last_round_rows
                received, copies = call["received"], sent + copies_received
                gates = copies_received * layer.config.top_k * (8 if call["itemsize"] == 8 else 4)
            self.replay_bytes[name] += moe_replay_bytes(
                call["tokens"], layer.config.top_k, received, returned, call["d_model"], call["itemsize"],
                copies, gates,
            )  # fmt: skip

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _ForwardTimer:
    """Per module, wall time of its forward calls in one model forward (device synchronised)."""

    def __init__(self, modules: dict[str, nn.Module], synchronize: Callable[[], None]):
        self.synchronize = synchronize
        self.elapsed_ns: dict[str, int] = dict.fromkeys(modules, 0)
        self._start: dict[str, list[int]] = {name: [] for name in modules}
        self._handles = []
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name):
        def hook(module, args):
            self.synchronize()
            self._start[name].append(time.perf_counter_ns())

        return hook

    def _post(self, name):
        def hook(module, args, output):
            self.synchronize()
            self.elapsed_ns[name] += time.perf_counter_ns() - self._start[name].pop()

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _call_model(model: nn.Module, example_batch):
    if isinstance(example_batch, dict):
        return model(**example_batch)
    return model(example_batch) if isinstance(example_batch, torch.Tensor) else model(*example_batch)


def _check_batch(example_batch) -> None:
    if not isinstance(example_batch, (torch.Tensor, tuple, list, dict)):
        raise ValueError(
            "example_batch must be a tensor (model(batch)), a tuple/list of arguments (model(*batch)) "
            f"or a dict of keyword arguments (model(**batch)), got {type(example_batch).__name__}"
        )


def _default_loss(output) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise ValueError(
            f"loss_fn: the model returns {type(output).__name__}, not a tensor; pass loss_fn=output -> scalar"
        )
    return output.float().pow(2).mean()


def _devices(model: nn.Module, example_batch) -> list[torch.device]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [example_batch] if isinstance(example_batch, torch.Tensor) else _tensors_in(example_batch, {})
    return sorted({t.device for t in tensors}, key=str)


def _synchronizer(devices: list[torch.device]) -> Callable[[], None]:
    accelerators = [d for d in devices if d.type != "cpu"]
    if not accelerators:
        return lambda: None
    return torch.accelerator.synchronize


@contextlib.contextmanager
def _side_effect_free(model: nn.Module, devices: list[torch.device]):
    """Restores the RNG streams and every buffer (e.g. BatchNorm statistics) after profiling."""
    accelerators = [d for d in devices if d.type != "cpu"]
    device_type = accelerators[0].type if accelerators else "cuda"
    indices = [
        d.index if d.index is not None else torch.accelerator.current_device_index() for d in accelerators
    ]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=indices, device_type=device_type):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _group_options(
    root: str,
    children: dict[str, list[str]],
    direct: dict[str, dict[StorageKey, int]],
    kept: dict[str, dict[StorageKey, int]],
    forward_ms: dict[str, float],
    free: dict[StorageKey, int],
) -> tuple[RecomputeOption, ...]:
    """All options of one group: recompute the root, or combine its children's options; bytes are the
    unique storages kept (those in ``free``, already counted outside, cost nothing)."""

    def options(node: str) -> list[tuple[tuple[str, ...], dict[StorageKey, int]]]:
        combos: list[tuple[tuple[str, ...], dict[StorageKey, int]]] = [((), dict(direct.get(node, {})))]
        for child in children[node]:
            combos = [
                (names + child_names, {**kept_a, **kept_b})
                for names, kept_a in combos
                for child_names, kept_b in options(child)
            ]
        return [*combos, ((node,), dict(kept[node]))]

    result = []
    for names, storages in options(root):
        nbytes = sum(n for key, n in storages.items() if key not in free)
        result.append(RecomputeOption(names, nbytes, sum(forward_ms[n] for n in names)))
    return tuple(result)


def profile_activations(
    model: nn.Module,
    example_batch,
    *,
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    candidates: Sequence[str] | None = None,
    timing_repeats: int = 3,
) -> ActivationProfile:
    """Measures, for every candidate, the bytes it saves for backward, its input bytes, its MoE replay
    bytes and its forward time, and enumerates the options of each group.

    One forward of ``example_batch`` under saved-tensor hooks, then ``loss_fn(output).backward``
    computed with ``torch.autograd.grad`` (``.grad`` is untouched) as a warm-up, then
    ``timing_repeats`` timed forwards (median per candidate). RNG state and buffers are restored;
    MoELayer ``last_stats`` are left from the last profiled forward. Profile in the mode you train
    in (``model.train()``): capacity and dropout depend on it. Default candidates that the forward
    never calls are left out; an explicit candidate that is never called is a ValueError.
    """
    _check_batch(example_batch)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable (output -> scalar tensor) or None, got {loss_fn!r}")
    require_int("timing_repeats", timing_repeats, 1)
    wrapped = recomputed_modules(model)
    if wrapped:
        raise ValueError(f"model already recomputes {wrapped}; call remove_recompute(model) before profiling")
    replaying = [n for n, m in model.named_modules() if isinstance(m, MoELayer) and m.recompute_replay]
    if replaying:
        raise ValueError(f"MoELayers {replaying} have recompute replay on; turn it off before profiling")
    blocks = _resolve_candidates(model, candidates)
    names = list(blocks)
    parent = {n: max((a for a in names if a != n and _is_inside(n, a)), key=len, default=None) for n in names}
    moe_layers = {n: m for n, m in model.named_modules() if isinstance(m, MoELayer)}
    devices = _devices(model, example_batch)
    synchronize = _synchronizer(devices)
    loss_fn = loss_fn or _default_loss

    with _side_effect_free(model, devices), torch.enable_grad():
        recorder = _SavedTensorRecorder(model, blocks)
        replay = _MoEReplayRecorder(moe_layers)
        try:
            with recorder.hooks():
                output = _call_model(model, example_batch)
            live = recorder.live_storages()
        finally:
            recorder.remove()
            replay.remove()
        loss = loss_fn(output)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise ValueError("loss_fn must return a scalar tensor that requires grad")
        params = [p for p in model.parameters() if p.requires_grad]
        if params:
            torch.autograd.grad(loss, params, allow_unused=True)
        del output, loss

        called = {n for n in names if recorder.calls[n]}
        if candidates is not None and len(called) < len(names):
            missing = [n for n in names if n not in called]
            raise ValueError(f"candidates must run in the forward of example_batch; never called: {missing}")
        names = [n for n in names if n in called]
        parent = {n: p if p in called else None for n, p in parent.items() if n in called}

        timer = _ForwardTimer({n: blocks[n] for n in names}, synchronize)
        samples: dict[str, list[float]] = {n: [] for n in names}
        try:
            for _ in range(timing_repeats):
                timer.elapsed_ns = dict.fromkeys(names, 0)
                _call_model(model, example_batch)
                for n in names:
                    samples[n].append(timer.elapsed_ns[n] / 1e6)
        finally:
            timer.remove()
    forward_ms = {n: statistics.median(samples[n]) for n in names}

    # Attribute each saved storage to its innermost *called* candidate (None: outside all).
    def innermost(owner: str | None) -> str | None:
        while owner is not None and owner not in called:
            owner = parent.get(owner)
        return owner

    direct: dict[str | None, dict[StorageKey, int]] = {}
    for owner, storages in live.items():
        direct.setdefault(innermost(owner), {}).update(storages)
    children = {n: [c for c in names if parent[c] == n] for n in names}

    def subtree(n: str) -> list[str]:
        return [n, *(d for c in children[n] for d in subtree(c))]

    kept: dict[str, dict[StorageKey, int]] = {}
    profiles: dict[str, BlockProfile] = {}
    for n in names:
        saved: dict[StorageKey, int] = {}
        for d in subtree(n):
            saved.update(direct.get(d, {}))
        replay_storages = {
            ("moe-replay:" + m, 0, 0): b
            for m, b in replay.replay_bytes.items()
            if b and (m == n or _is_inside(m, n))
        }
        kept[n] = {**recorder.inputs[n], **replay_storages}
        profiles[n] = BlockProfile(
            name=n,
            parent=parent[n],
            calls=recorder.calls[n],
            saved_bytes=sum(saved.values()),
            input_bytes=sum(recorder.inputs[n].values()),
            replay_bytes=sum(replay_storages.values()),
            forward_ms=forward_ms[n],
        )
    outside = direct.get(None, {})
    everything: dict[StorageKey, int] = {}
    for storages in direct.values():
        everything.update(storages)
    groups = tuple(
        _group_options(root, children, direct, kept, forward_ms, outside)
        for root in names
        if parent[root] is None
    )
    return ActivationProfile(
        baseline_bytes=sum(everything.values()),
        outside_bytes=sum(outside.values()),
        blocks=profiles,
        groups=groups,
    )


# ---------------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------------


def solve_recompute(groups: Sequence[Sequence[RecomputeOption]], capacity_bytes: int) -> list[int] | None:
    """Exact multiple-choice knapsack: one option index per group minimising the total
    ``recompute_ms`` subject to ``sum activation_bytes <= capacity_bytes``; ``None`` if infeasible.

    Dynamic programming over groups keeping the Pareto frontier of partial choices (bytes strictly
    increasing, ms strictly decreasing; partial sums above the capacity dropped). A partial choice
    dominated by another (no fewer bytes and no less time) can never complete to a better plan, so
    the frontier's last point after the final group is optimal. Ties in time go to fewer bytes.
    """
    frontier: list[tuple[int, float]] = [(0, 0.0)]
    back: list[list[tuple[int, int]]] = []
    for options in groups:
        extended = [
            (nbytes + o.activation_bytes, ms + o.recompute_ms, i, j)
            for i, (nbytes, ms) in enumerate(frontier)
            for j, o in enumerate(options)
            if nbytes + o.activation_bytes <= capacity_bytes
        ]
        if not extended:
            return None
        extended.sort(key=lambda e: (e[0], e[1]))
        frontier, steps, best = [], [], math.inf
        for nbytes, ms, i, j in extended:
            if ms < best:
                best = ms
                frontier.append((nbytes, ms))
                steps.append((i, j))
        back.append(steps)
    choice: list[int] = []
    index = len(frontier) - 1
    for steps in reversed(back):
        index, option = steps[index]
        choice.append(option)
    return choice[::-1]


def _moe_layers_in(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def plan_recompute(
    profile: ActivationProfile, memory_budget_bytes: int, model: nn.Module | None = None
) -> RecomputePlan:
    """The cheapest plan (least ``recompute_ms``) whose ``activation_bytes <= memory_budget_bytes``.

    Raises ValueError naming the minimum achievable activation memory when no plan fits.
    ``model`` (optional) only fills ``moe_replay`` with the MoELayers inside recomputed blocks.
    """
    require_number("memory_budget_bytes", memory_budget_bytes, low=0, note="(bytes)")
    budget = int(memory_budget_bytes)
    minimum = profile.min_activation_bytes
    if profile.baseline_bytes <= budget:
        choice = [0] * len(profile.groups)
    else:
        choice = solve_recompute(profile.groups, budget - profile.outside_bytes)
    if choice is None:
        raise ValueError(
            f"memory_budget_bytes = {budget} ({format_bytes(budget)}) is below the minimum achievable "
            f"activation memory {minimum} bytes ({format_bytes(minimum)}, every group recomputed as "
            f"cheaply as possible; without recompute: {format_bytes(profile.baseline_bytes)}, of which "
            f"{format_bytes(profile.outside_bytes)} outside every candidate); raise memory_budget_bytes "
            f"to at least {minimum} or add candidates"
        )
    chosen = [options[j] for options, j in zip(profile.groups, choice, strict=True)]
    recomputed = tuple(n for o in chosen for n in o.recomputed)
    if any(j for j in choice):
        activation = profile.outside_bytes + sum(o.activation_bytes for o in chosen)
    else:
        activation = profile.baseline_bytes
    moe_replay = ()
    if model is not None:
        modules = dict(model.named_modules())
        moe_replay = tuple(
            n
            for n, m in modules.items()
            if isinstance(m, MoELayer) and any(_is_inside(n, r) or n == r for r in recomputed)
        )
    return RecomputePlan(
        recomputed=recomputed,
        memory_budget_bytes=budget,
        activation_bytes=activation,
        baseline_bytes=profile.baseline_bytes,
        min_activation_bytes=minimum,
        recompute_ms=sum(o.recompute_ms for o in chosen),
        moe_replay=moe_replay,
        profile=profile,
    )


# ---------------------------------------------------------------------------------------------
# Wrapping
# ---------------------------------------------------------------------------------------------


class RecomputedForward:
    """Installed as ``module.forward`` (an instance attribute, so parameter names, state_dict keys,
    ``named_modules`` and ``isinstance`` are unchanged): runs the original forward under
    ``checkpoint(use_reentrant=False)`` when grad is enabled, plainly otherwise. RNG state is
    preserved, so dropout and router jitter draw the same numbers in the recompute."""

    def __init__(self, forward: Callable, previous: Callable | None, moe_layers: list[MoELayer]):
        self.forward = forward
        self.previous = previous  # the instance-level forward this replaced, if any
        self.moe_layers = moe_layers

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def recomputed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` currently wrapped for recompute."""
    return [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), RecomputedForward)]


def apply_recompute_plan(model: nn.Module, plan: RecomputePlan | Sequence[str]) -> list[str]:
    """Wraps each block of ``plan`` (or a list of names) for recompute and turns on routing replay
    (``set_recompute_replay(True)``) for every MoELayer inside one. Returns the MoELayer names."""
    names = list(plan.recomputed) if isinstance(plan, RecomputePlan) else list(plan)
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"plan must name submodules of the model, got {unknown}")
    already = recomputed_modules(model)
    if already:
        raise ValueError(f"model already recomputes {already}; call remove_recompute(model) first")
    for a in names:
        for b in names:
            if a != b and _is_inside(b, a):
                raise ValueError(f"plan must not nest recomputed blocks, got {a!r} and its sub-block {b!r}")
    replayed = []
    for name in names:
        module = modules[name]
        layers = _moe_layers_in(module)
        for layer in layers:
            layer.set_recompute_replay(True)
        replayed += [n for n, m in modules.items() if isinstance(m, MoELayer) and m in layers]
        module.forward = RecomputedForward(module.forward, module.__dict__.get("forward"), layers)
    return replayed


def remove_recompute(model: nn.Module) -> list[str]:
    """Undoes :func:`apply_recompute_plan`: restores each wrapped forward and turns routing replay
    off. Returns the names that were wrapped."""
    names = recomputed_modules(model)
    for name in names:
        module = model.get_submodule(name)
        wrapper = module.__dict__["forward"]
        for layer in wrapper.moe_layers:
            layer.set_recompute_replay(False)
        if wrapper.previous is None:
            del module.forward
        else:
            module.forward = wrapper.previous
    return names


def auto_checkpoint(
    model: nn.Module,
    example_batch,
    memory_budget_bytes: int,
    *,
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    candidates: Sequence[str] | None = None,
    verbose: bool = True,
    timing_repeats: int = 3,
) -> RecomputePlan:
    """Profiles ``model`` on ``example_batch``, picks the blocks to recompute so that the activations
    saved for backward fit ``memory_budget_bytes`` at the least expected recompute time, wraps them
    and returns the plan (logged when ``verbose``).

    ``example_batch``: a tensor (``model(batch)``) or tuple of arguments (``model(*batch)``).
    ``loss_fn(output) -> scalar`` (default ``output.float().pow(2).mean()``) drives the warm-up
    backward. ``candidates``: module names to choose from (default: :func:`default_candidates`).
    Raises ValueError, naming the minimum achievable bytes, when no choice fits the budget.
    """
    require_bool("verbose", verbose)
    profile = profile_activations(
        model, example_batch, loss_fn=loss_fn, candidates=candidates, timing_repeats=timing_repeats
    )
    plan = plan_recompute(profile, memory_budget_bytes, model)
    apply_recompute_plan(model, plan)
    if verbose:
        log.info("%s", plan.summary())
    return plan


def measure_saved_bytes(model: nn.Module, example_batch) -> int:
    """Unique bytes of the storages autograd keeps saved after one forward of ``model`` (parameters
    and buffers excluded). With recomputed blocks this counts their checkpoint inputs, not their
    insides; it does not see what a module keeps outside autograd (MoE routing replay records: add
    ``plan.profile.blocks[name].replay_bytes`` for those). The records this forward makes are
    dropped again (``set_recompute_replay(True)`` clears them), so it must not run between a
    training forward and its backward."""
    _check_batch(example_batch)
    recorder = _SavedTensorRecorder(model, {})
    try:
        with torch.enable_grad(), recorder.hooks():
            output = _call_model(model, example_batch)
        live = recorder.live_storages()
    finally:
        recorder.remove()
        for layer in model.modules():
            if isinstance(layer, MoELayer) and layer.recompute_replay:
                layer.set_recompute_replay(True)  # drop the record no backward will consume
    del output
    everything: dict[StorageKey, int] = {}
    for storages in live.values():
        everything.update(storages)
    return sum(everything.values())
