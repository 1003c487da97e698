"""Forward hooks that measure one forward: the storages autograd saves, by innermost candidate
(:class:`_SavedTensorRecorder`), the bytes each MoELayer's routing replay would keep
(:func:`moe_replay_bytes`, :class:`_MoEReplayRecorder`) and each block's forward time
(:class:`_ForwardTimer`)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from moetrain.layers import MoELayer
from moetrain.layers.dispatch import AllToAllTokenDispatcher
from moetrain.layers.experts import local_tensor
from moetrain.layers.node_dispatch import NodeDedupTokenDispatcher

StorageKey = tuple[str, int, int]  # (device type, device index, data pointer)


def _storage_key(t: torch.Tensor) -> StorageKey:
    t = local_tensor(t)  # a DTensor (split or FSDP parameter) has no storage of its own: its shard has
    return (t.device.type, -1 if t.device.index is None else t.device.index, t.untyped_storage().data_ptr())


def _tensors_in(args, kwargs) -> list[torch.Tensor]:
    """The tensors in ``args`` and ``kwargs`` (looked into lists, tuples and dicts), in argument
    order."""
    found: list[torch.Tensor] = []
    stack = [*args, *kwargs.values()][::-1]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(item.values()))
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
    dispatcher communicates (:class:`AllToAllTokenDispatcher`; for :class:`NodeDedupTokenDispatcher`
    the replay keeps the rows of each of its round's row exchanges, counted from
    ``last_round_rows``)."""

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
            x = args[0] if args else kwargs["x"]  # MoELayer.forward(x, sequence_lengths=None)
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
