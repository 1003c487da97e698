"""Which modules may be recomputed: the default rule (:func:`default_candidates`), the check of an
explicit list, and the name test for nesting (a sub-block inside a block)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from moetrain.layers import MoELayer


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
