"""Profiling: one hooked forward and backward of an example batch measures, per candidate, the
bytes it saves, keeps when recomputed and its forward time (:func:`profile_activations`), and
enumerates each group's options; :func:`measure_saved_bytes` counts what a forward keeps saved."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence

import torch
from torch import nn

from moetrain.layers import MoELayer
from moetrain.recompute.apply import recomputed_modules
from moetrain.recompute.candidates import _is_inside, _resolve_candidates
from moetrain.recompute.recorders import (
    StorageKey,
    _ForwardTimer,
    _MoEReplayRecorder,
    _SavedTensorRecorder,
    _tensors_in,
)
from moetrain.recompute.results import ActivationProfile, BlockProfile, RecomputeOption
from moetrain.validation import require_int


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
    _check_profile_arguments(model, example_batch, loss_fn, timing_repeats)
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

        forward_ms = _time_forwards(
            model, example_batch, {n: blocks[n] for n in names}, synchronize, timing_repeats
        )
    return _assemble_profile(names, parent, live, recorder, replay.replay_bytes, forward_ms)


def _check_profile_arguments(model: nn.Module, example_batch, loss_fn, timing_repeats: int) -> None:
    """ValueError unless the arguments are usable and the model is plain (no recompute, no replay)."""
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


def _time_forwards(
    model: nn.Module,
    example_batch,
    blocks: dict[str, nn.Module],
    synchronize: Callable[[], None],
    timing_repeats: int,
) -> dict[str, float]:
    """Median forward time (ms) of each of ``blocks`` over ``timing_repeats`` model forwards."""
    names = list(blocks)
    timer = _ForwardTimer(blocks, synchronize)
    samples: dict[str, list[float]] = {n: [] for n in names}
    try:
        for _ in range(timing_repeats):
            timer.elapsed_ns = dict.fromkeys(names, 0)
            _call_model(model, example_batch)
            for n in names:
                samples[n].append(timer.elapsed_ns[n] / 1e6)
    finally:
        timer.remove()
    return {n: statistics.median(samples[n]) for n in names}


def _assemble_profile(
    names: list[str],
    parent: dict[str, str | None],
    live: dict[str | None, dict[StorageKey, int]],
    recorder: _SavedTensorRecorder,
    replay_bytes: dict[str, int],
    forward_ms: dict[str, float],
) -> ActivationProfile:
    """The profile of the called candidates ``names`` (``parent``: each one's innermost called
    ancestor) from the storages still saved after the forward (``live``, by innermost owner), the
    recorder's inputs and calls, and each MoELayer's replay bytes."""
    called = set(names)

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
            for m, b in replay_bytes.items()
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


def measure_saved_bytes(model: nn.Module, example_batch) -> int:
    """Unique bytes of the storages autograd keeps saved after one forward of ``model`` (parameters
    and buffers excluded). With recomputed blocks this counts their checkpoint inputs, not their
    insides; it does not see what a module keeps outside autograd (MoE routing replay records: add
    ``plan.profile.blocks[name].replay_bytes`` for those). The records this forward makes are
    dropped again (``set_recompute_replay(True)`` clears them), so it must not run between a
    training forward and its backward. RNG state and buffers (e.g. the routers' ``load_E``) are
    restored, as in :func:`profile_activations`."""
    _check_batch(example_batch)
    recorder = _SavedTensorRecorder(model, {})
    try:
        with _side_effect_free(model, _devices(model, example_batch)):
            with torch.enable_grad(), recorder.hooks():
                output = _call_model(model, example_batch)
            live = recorder.live_storages()
            del output
    finally:
        recorder.remove()
        for layer in model.modules():
            if isinstance(layer, MoELayer) and layer.recompute_replay:
                layer.set_recompute_replay(True)  # drop the record no backward will consume
    everything: dict[StorageKey, int] = {}
    for storages in live.values():
        everything.update(storages)
    return sum(everything.values())
