"""Turn the FFNs of an existing model into MoELayers, optionally upcycled from their weights.

:func:`moefy` replaces every matched FFN module with a :class:`~moetrain.MoELayer` of the same
``d_model`` and hidden size. With ``upcycle=True`` (sparse upcycling) every expert starts as a copy
of the dense FFN, weights and biases: with the gates of each token normalised to sum to 1 and no
token dropped (dropless, the default here), the layer's output at step 0 is exactly the dense
FFN's, whatever the router says, ``sum_j g_j * FFN(x) = FFN(x)``.

FFN shapes it reads (duck-typed, so no model library is imported):

- ``nn.Sequential(nn.Linear(D, F), activation, nn.Linear(F, D)[, nn.Dropout])``, activation
  ``nn.ReLU`` or ``nn.GELU`` (exact or ``approximate="tanh"``);
- Hugging Face GPT-2's MLP: ``c_fc`` / ``c_proj`` (``Conv1D``, weights stored ``[in, out]``, with
  biases), ``act`` (``gelu_new``: the tanh GELU), ``dropout``;
- Llama / Mistral / Qwen-style gated MLPs: ``gate_proj``, ``up_proj``, ``down_proj``
  (``nn.Linear``, biases if present) and a SiLU ``act_fn``: SwiGLU experts.

A trailing dropout is kept after the MoE layer (``nn.Sequential(moe, dropout)``).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import MoEConfig, config_from_dict
from moetrain.layers.moe_layer import MoELayer

log = logging.getLogger(__name__)

_GELU_TANH_CLASSES = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
_GELU_CLASSES = {"GELUActivation"}
_SILU_CLASSES = {"SiLU", "SiLUActivation"}


@dataclass
class DenseWeights:
    """An FFN as ``act(x @ w1_DH + b1_H) @ w2_FD + b2_D``; for SwiGLU ``H = 2F``, the gate's columns
    first, then the up projection's (``silu(h[:, :F]) * h[:, F:]``). ``after``: a module applied to
    the output (a dropout), kept."""

    w1_DH: torch.Tensor
    b1_H: torch.Tensor | None
    w2_FD: torch.Tensor
    b2_D: torch.Tensor | None
    activation: str
    after: nn.Module | None = None

    @property
    def d_model(self) -> int:
        return self.w1_DH.shape[0]

    @property
    def d_ff(self) -> int:
        return self.w2_FD.shape[0]


def _activation_name(module, gated: bool = False) -> str | None:
    name = type(module).__name__
    if gated:
        return "swiglu" if name in _SILU_CLASSES or module is torch.nn.functional.silu else None
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if name in _GELU_TANH_CLASSES:
        return "gelu_tanh"
    if name in _GELU_CLASSES:
        return "gelu"
    return None


def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [in, out], bias [out] or None)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.weight.detach().t(), None if module.bias is None else module.bias.detach()
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    return None


def read_dense_ffn(module: nn.Module) -> DenseWeights | None:
    """The weights of a supported FFN (see the module docstring); None for anything else."""
    if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        gate, up, down = _linear(module.gate_proj), _linear(module.up_proj), _linear(module.down_proj)
        activation = _activation_name(module.act_fn, gated=True)
        if None in (gate, up, down) or activation is None:
            return None
        biases = (gate[1], up[1])
        b1 = (
            None
            if all(b is None for b in biases)
            else torch.cat([_or_zeros(b, w) for b, (w, _) in zip(biases, (gate, up), strict=True)])
        )
        return DenseWeights(torch.cat([gate[0], up[0]], dim=1), b1, down[0], down[1], activation)
    if all(hasattr(module, name) for name in ("c_fc", "c_proj", "act")):
        fc, proj, activation = _linear(module.c_fc), _linear(module.c_proj), _activation_name(module.act)
        if None in (fc, proj) or activation is None:
            return None
        return DenseWeights(fc[0], fc[1], proj[0], proj[1], activation, getattr(module, "dropout", None))
    if isinstance(module, nn.Sequential) and len(module) in (3, 4):
        fc, proj, activation = _linear(module[0]), _linear(module[2]), _activation_name(module[1])
        after = module[3] if len(module) == 4 else None
        if (
            None in (fc, proj)
            or activation is None
            or (after is not None and not isinstance(after, nn.Dropout))
        ):
            return None
        return DenseWeights(fc[0], fc[1], proj[0], proj[1], activation, after)
    return None


def _or_zeros(bias: torch.Tensor | None, weight_DF: torch.Tensor) -> torch.Tensor:
    return bias if bias is not None else weight_DF.new_zeros(weight_DF.shape[1])


def _matcher(match) -> Callable[[str, nn.Module], bool]:
    if isinstance(match, str):
        return lambda name, module: fnmatch.fnmatchcase(name, match)
    if isinstance(match, type) or (isinstance(match, tuple) and all(isinstance(t, type) for t in match)):
        return lambda name, module: isinstance(module, match)
    if callable(match):
        return match
    raise ValueError(
        f"match must be a module name pattern (str), a module type or tuple of types, or a callable "
        f"(name, module) -> bool, got {match!r}"
    )


def upcycle_into(layer: MoELayer, dense: DenseWeights) -> None:
    """Copies the dense FFN into every (local) expert of ``layer``."""
    experts = layer.experts
    with torch.no_grad():
        experts.w1_EDF.copy_(dense.w1_DH.unsqueeze(0).expand_as(experts.w1_EDF))
        experts.w2_EFD.copy_(dense.w2_FD.unsqueeze(0).expand_as(experts.w2_EFD))
        if experts.b1_EF is not None:
            experts.b1_EF.copy_(_or_zeros(dense.b1_H, dense.w1_DH).unsqueeze(0).expand_as(experts.b1_EF))
            b2 = dense.b2_D if dense.b2_D is not None else dense.w2_FD.new_zeros(dense.d_model)
            experts.b2_ED.copy_(b2.unsqueeze(0).expand_as(experts.b2_ED))


def moefy(
    model: nn.Module,
    *,
    match,
    num_experts: int,
    top_k: int = 2,
    upcycle: bool = True,
    **moe_options,
) -> list[str]:
    """Replaces the FFNs of ``model`` that ``match`` selects with MoELayers, in place; returns their
    names.

    ``match``: a glob over module names (``"transformer.h.*.mlp"``), a module type (or a tuple of
    types), or ``callable(name, module) -> bool``. Each matched module must be a supported FFN (see
    the module docstring). ``num_experts``, ``top_k`` and any other :class:`~moetrain.MoEConfig`
    option (``moe_options``) configure the layers; ``d_model``, ``d_ff``, ``activation`` and
    ``expert_bias`` come from the FFN. Defaults that differ from MoEConfig's: dropless routing
    (``capacity_factor=None``) and, with ``upcycle``, normalised gates (``normalize_gates=True``,
    which the step-0 equality needs; with ``top_k=1`` the gate is then 1 and the router learns
    through the aux loss only). The new layers hold every expert and take the FFN's device and
    dtype; expert parallelism is applied afterwards (:func:`moetrain.parallelize` with
    ``expert``, or :func:`moetrain.shard_experts`).
    """
    accepts = _matcher(match)
    chosen = [(name, module) for name, module in model.named_modules() if name and accepts(name, module)]
    if not chosen:
        raise ValueError(f"match {match!r} selects no module of {type(model).__name__}")
    replaced = []
    for name, module in chosen:
        dense = read_dense_ffn(module)
        if dense is None:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) is not a supported FFN: nn.Sequential(Linear, "
                "ReLU/GELU, Linear[, Dropout]), a GPT-2 MLP (c_fc, act, c_proj) or a gated MLP (gate_proj, "
                "up_proj, down_proj, SiLU act_fn)"
            )
        options = {"capacity_factor": None, **({"normalize_gates": True} if upcycle else {}), **moe_options}
        has_bias = dense.b1_H is not None or dense.b2_D is not None
        config = config_from_dict(
            MoEConfig,
            {
                "d_model": dense.d_model,
                "d_ff": dense.d_ff,
                "num_experts": num_experts,
                "top_k": top_k,
                "activation": dense.activation,
                "expert_bias": has_bias,
                **options,
            },
            "moefy",
        )
        layer = MoELayer(config).to(device=dense.w1_DH.device, dtype=dense.w1_DH.dtype)
        if upcycle:
            upcycle_into(layer, dense)
        replacement = layer if dense.after is None else nn.Sequential(layer, dense.after)
        model.set_submodule(name, replacement)
        replaced.append(name)
    log.info(
        "moefy: %d FFN(s) replaced by MoELayers of %d experts (upcycled: %s)",
        len(replaced),
        num_experts,
        upcycle,
    )
    return replaced
