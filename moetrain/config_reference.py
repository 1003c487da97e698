"""The reference of every config key, generated from the config dataclasses themselves (each field's
``option(default, help)``), so that ``moetrain train --help`` and the validation cannot drift apart.

``model.*`` keys depend on the model: one section per registered model (its config class, with
``moe.*`` for an MoE sub-config)."""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, fields, is_dataclass


def _type_name(hint) -> str:
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    return text or str(hint).replace("typing.", "")


def _default(item: Field) -> str:
    if item.default is not MISSING:
        value = item.default
        return "required" if value is MISSING else ("-" if is_dataclass(value) else repr(value))
    if item.default_factory is not MISSING:
        value = item.default_factory()
        return "-" if is_dataclass(value) else repr(value)
    return "required"


def config_keys(cls: type, prefix: str = "", skip: tuple[str, ...] = ()) -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, meaning)`` of every field of dataclass ``cls``, recursing into
    dataclass-typed fields (their own keys follow their section's line)."""
    hints = typing.get_type_hints(cls)
    rows = []
    for item in fields(cls):
        if item.name in skip:
            continue
        key = f"{prefix}{item.name}"
        hint = hints.get(item.name)
        rows.append((key, _type_name(hint), _default(item), item.metadata.get("help", "")))
        if isinstance(hint, type) and is_dataclass(hint):
            inherited = ("d_model",) if prefix.startswith("model.") or prefix == "model." else ()
            rows += config_keys(hint, f"{key}.", skip=inherited if hint.__name__ == "MoEConfig" else ())
    return rows


def format_keys(rows: list[tuple[str, str, str, str]]) -> str:
    width = max(len(key) for key, *_ in rows)
    lines = []
    for key, type_name, default, meaning in rows:
        lines.append(f"  {key:<{width}}  {type_name}, default {default}")
        if meaning:
            lines.append(f"  {'':<{width}}    {meaning}")
    return "\n".join(lines)


def train_config_reference() -> str:
    """Every key of a training config: the run's keys, then ``model.*`` per registered model."""
    from moetrain.config import TrainConfig
    from moetrain.registry import registered_models

    parts = ["config keys (YAML/JSON file, or --set KEY=VALUE):", format_keys(config_keys(TrainConfig))]
    for name, spec in sorted(registered_models().items()):
        parts.append(f"\nmodel.* of model.name = {name} ({spec.config_class.__name__}):")
        parts.append(format_keys(config_keys(spec.config_class, "model.")))
    return "\n".join(parts)
