"""Any registered model the planner has no formulas for, measured on the ``meta`` device.

A model registered without a ``describe`` hook (see :mod:`moetrain.registry`) is built by its own
builder under ``torch.device("meta")`` (no memory, no values), and one forward and loss on a probe
batch of 1 and of 2 sequences, also on ``meta``, is watched:

- saved tensors (``torch.autograd.graph.saved_tensors_hooks``) outside every
  :class:`~moetrain.layers.moe_layer.MoELayer`, parameters and their views excluded, each tensor
  once: floating-point ones counted in elements (their bytes follow the plan's precision), the
  others in bytes;
- forward FLOPs outside the MoE layers (``torch.utils.flop_counter.FlopCounterMode``: matrix
  products and convolutions by shape);
- the tokens each MoE layer routes (its input's rows).

The difference between the two probes is the cost per sequence, the rest a constant, so
``bytes(B) = constant + B * per_sequence`` for a micro-batch of ``B`` sequences. The MoE layers
themselves (their saved tensors, rows, dispatch indices, replay records, all-to-all traffic and
FLOPs) are modelled by the same formulas as the built-in families, from each layer's
:class:`~moetrain.config.MoEConfig`. Assumptions: saved memory grows linearly with the number of
sequences, the sequence length is the one the model's data gives, every MoE layer shares one
``MoEConfig`` and routes the same number of tokens, and what ``meta`` saves is what the GPU saves
(it is what the CPU kernels save, except attention: ``meta`` takes the math path of
``scaled_dot_product_attention`` and counts its ``[B, H, S, S]`` probabilities, which the fused
CPU and CUDA kernels do not keep, so this errs high there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from moetrain._torch_compat import tree_map
from moetrain.layers.moe_layer import MoELayer
from moetrain.registry import DataShard

PROBE_SEED = 0


@dataclass(frozen=True)
class SavedCost:
    """What one forward + loss saves outside the MoE layers and computes there."""

    float_elements: int
    other_bytes: int
    flops: float

    def minus(self, other: SavedCost) -> SavedCost:
        return SavedCost(
            self.float_elements - other.float_elements,
            self.other_bytes - other.other_bytes,
            self.flops - other.flops,
        )


@dataclass(frozen=True)
class MeasuredModel:
    """The measured part of a generic model: ``constant`` + ``per_sequence`` x sequences (outside
    the MoE layers), ``moe_modules`` (names, in forward order), ``tokens_per_sequence`` each routes."""

    constant: SavedCost
    per_sequence: SavedCost
    moe_modules: tuple[str, ...]
    tokens_per_sequence: int
    module_rows: tuple[tuple[str, int], ...] = ()  # (name, rows per sequence) of Linear / Embedding
    output_module: str | None = None  # the module whose output is the model's output (its head)

    def saved_bytes(self, sequences: int, itemsize: int) -> int:
        elements = self.constant.float_elements + sequences * self.per_sequence.float_elements
        other = self.constant.other_bytes + sequences * self.per_sequence.other_bytes
        return max(0, elements * itemsize + other)

    def flops(self, sequences: int) -> float:
        return max(0.0, self.constant.flops + sequences * self.per_sequence.flops)


def _to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _call(model: nn.Module, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _measure(model: nn.Module, loss_fn, inputs, targets, moe_layers: dict[nn.Module, str]) -> tuple:
    """One forward + loss on meta: (SavedCost outside the MoE layers, tokens routed per MoE layer,
    rows through each Linear / Embedding outside them, the name of the module that produced the
    model's output)."""
    parameters = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    depth = [0]
    routed: dict[str, int] = {}
    totals = {"float": 0, "other": 0}

    def pack(tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor
        inside_moe = depth[0] > 0
        is_parameter = id(base) in parameters or id(tensor) in parameters
        if not inside_moe and not is_parameter and id(base) not in seen:
            seen.add(id(base))
            if base.is_floating_point():
                totals["float"] += base.numel()
            else:
                totals["other"] += base.numel() * base.element_size()
        return tensor

    def enter(module, args):
        depth[0] += 1
        x = args[0]
        routed[moe_layers[module]] = x.numel() // x.shape[-1]

    def leave(module, args, output):
        depth[0] -= 1

    rows: dict[str, int] = {}
    outputs: dict[int, str] = {}

    def watch(name):
        def hook(module, args, output):
            if depth[0] == 0:
                x = args[0]
                rows[name] = rows.get(name, 0) + (
                    x.numel() if isinstance(module, nn.Embedding) else x.numel() // x.shape[-1]
                )
                outputs[id(output)] = name

        return hook

    handles = [m.register_forward_pre_hook(enter) for m in moe_layers]
    handles += [m.register_forward_hook(leave) for m in moe_layers]
    handles += [
        m.register_forward_hook(watch(name))
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding))
    ]
    counter = FlopCounterMode(display=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), counter:
            output = _call(model, inputs)
            loss_fn(output, targets)
    finally:
        for handle in handles:
            handle.remove()
    flops = counter.get_flop_counts()
    moe_flops = sum(sum(flops.get(f"Global.{name}", {}).values()) for name in routed)
    outside = SavedCost(totals["float"], totals["other"], float(counter.get_total_flops() - moe_flops))
    return outside, routed, rows, outputs.get(id(output))


def measure_generic(model: nn.Module, batches, loss_fn) -> MeasuredModel:
    """Measures ``model`` (built on meta) on probe batches of 1 and 2 sequences from ``batches``
    (drawn on the CPU, then moved to meta). ValueError when it has no MoELayer."""
    moe_layers = {module: name for name, module in model.named_modules() if isinstance(module, MoELayer)}
    if not moe_layers:
        raise ValueError(f"the model {type(model).__name__} has no MoELayer: there is nothing to plan")
    costs, routed, rows = [], {}, []
    for sequences in (1, 2):
        inputs, targets = batches.probe(sequences, PROBE_SEED)
        cost, routed, module_rows, output_module = _measure(
            model, loss_fn, tree_map(_to_meta, inputs), tree_map(_to_meta, targets), moe_layers
        )
        costs.append(cost)
        rows.append(module_rows)
    per_sequence = costs[1].minus(costs[0])
    tokens = max(routed.values()) // 2 if routed else 0
    return MeasuredModel(
        constant=costs[0].minus(per_sequence),
        per_sequence=per_sequence,
        moe_modules=tuple(routed),
        tokens_per_sequence=tokens,
        module_rows=tuple((name, rows[1][name] - rows[0].get(name, 0)) for name in rows[1]),
        output_module=output_module,
    )


def describe_generic(train_config, spec, name: str):
    """A :class:`~moetrain.planner.model.ModelDescription` of ``train_config.model`` (registered as
    ``spec``) from its builder, run on meta."""
    from moetrain.planner.model import ModelArch, ModelDescription

    with torch.device("meta"):
        model, batches, loss_fn = spec.builder(train_config, DataShard())
    measured = measure_generic(model, batches, loss_fn)
    configs = {module.config for module in model.modules() if isinstance(module, MoELayer)}
    if len(configs) != 1:
        raise ValueError(
            f"model {spec.name!r}: its MoE layers have {len(configs)} different MoEConfigs; the generic "
            "planner models one shared config; register a describe hook (see moetrain.registry)"
        )
    moe = configs.pop()
    arch = ModelArch(
        d_model=moe.d_model,
        num_layers=len(measured.moe_modules),
        num_heads=1,
        vocab_size=0,
        max_seq_len=measured.tokens_per_sequence,
        moe=moe,
        moe_layers=tuple(range(len(measured.moe_modules))),
        measured=measured,
    )

    def build() -> nn.Module:
        return spec.builder(train_config, DataShard())[0]

    return ModelDescription(name, arch, train_config.model, build)
