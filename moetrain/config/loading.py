"""Nested dicts (a parsed YAML/JSON file) -> config dataclasses: :func:`config_from_dict`, with the
model section resolved through the registry, model presets merged under the file's own keys and
the ``imports`` a config names imported first. Errors name the key path."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import MISSING, asdict, fields

from moetrain.config.moe import MoEConfig
from moetrain.config.options import short_repr
from moetrain.config.train import TrainConfig
from moetrain.validation import require_int

MAX_ERROR_CHARS = 1000  # an error line longer than this is shortened (shorten_error)


@contextlib.contextmanager
def shorten_error():
    """A ``ValueError`` raised inside the block whose message is longer than ``MAX_ERROR_CHARS``
    (a huge value in ``got ...``) comes out as a plain ``ValueError`` with the message's first 800
    and last 100 characters and how many were left out between them."""
    try:
        yield
    except ValueError as error:
        message = str(error)
        if len(message) <= MAX_ERROR_CHARS:
            raise
        left_out = len(message) - 900
        raise ValueError(
            f"{message[:800]} ... [{left_out} characters left out] ... {message[-100:]}"
        ) from None


def model_config_classes() -> dict[str, type]:
    """Model name (the ``model.name`` key of a training config) -> its config dataclass, for every
    model in the registry (:mod:`moetrain.registry`)."""
    from moetrain.registry import registered_models

    return {name: spec.config_class for name, spec in registered_models().items()}


def config_as_dict(config: TrainConfig) -> dict:
    """``config`` as a training config file holds it: every key, JSON values only, and the model
    section led by its ``name`` (which the dataclass does not carry), so that ``moetrain train
    --config`` and ``moetrain plan --model`` read the run's ``config.json`` back as the same run."""
    data = json.loads(json.dumps(asdict(config), default=str))
    names = [name for name, cls in model_config_classes().items() if type(config.model) is cls]
    names = names or [name for name, cls in model_config_classes().items() if isinstance(config.model, cls)]
    if names:
        data["model"] = {"name": names[0], **data["model"]}
    return data


def config_from_dict(cls: type, data, path: str = ""):
    """Builds dataclass ``cls`` from nested dicts (YAML/JSON), recursing into dataclass fields.

    Unknown keys and invalid values raise ``ValueError`` naming the key path (``optim.lr``) and
    what is allowed. ``MoEConfig`` under a model inherits the model's ``d_model`` when not given.
    """
    import typing
    from dataclasses import is_dataclass

    where = path or "config"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    if cls is TrainConfig:
        import_model_modules(data.get("imports", ()), _join(path, "imports"))
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"unknown key '{_join(path, unknown[0])}'; allowed keys there: {', '.join(sorted(names))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if cls is TrainConfig and key == "model":
            kwargs[key] = _model_config_from_dict(value, _join(path, key))
        elif isinstance(hint, type) and is_dataclass(hint):
            if hint is MoEConfig and isinstance(value, dict) and "d_model" not in value:
                parent_d_model = data.get("d_model", _field_default(cls, "d_model"))
                if parent_d_model is not None:
                    require_int(_join(path, "d_model"), parent_d_model, 1)  # the key given, before its copy's
                    value = {**value, "d_model": parent_d_model}
            kwargs[key] = config_from_dict(hint, value, _join(path, key))
        else:
            kwargs[key] = value
    if cls is TrainConfig and "model" not in kwargs:
        raise ValueError(f"missing key '{_join(path, 'model')}' (a mapping with a 'name')")
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ValueError(f"{where}: {error}") from None
    except ValueError as error:
        raise ValueError(_prefixed(path, str(error))) from None


def _prefixed(path: str, message: str) -> str:
    """``message`` with the key path in front, without repeating the part it already names:
    ("model.tasks", "tasks.x must ...") -> "model.tasks.x must ..."."""
    parts = path.split(".") if path else []
    for start in range(len(parts)):
        named = ".".join(parts[start:])
        if message.startswith(named) and message[len(named) : len(named) + 1] in (".", " ", ":", "["):
            return ".".join([*parts[:start], message])
    return _join(path, message)


def _model_config_from_dict(data, path: str):
    classes = model_config_classes()
    name = data.get("name") if isinstance(data, dict) else data
    if not isinstance(data, dict) or not isinstance(name, str) or name not in classes:
        raise ValueError(
            f"{path}.name must be one of {', '.join(map(repr, classes))}, got {short_repr(name)}"
        )
    cls = classes[data["name"]]
    body = {k: v for k, v in data.items() if k not in ("name", "preset")}
    if "preset" in data:
        body = _merge(preset_as_dict(cls, data["preset"], f"{path}.preset"), body)
    return config_from_dict(cls, body, path)


def import_model_modules(modules, where: str = "imports", beside: str | None = None) -> None:
    """Imports the modules a config names under ``imports`` (user models that register themselves
    with :func:`moetrain.registry.register_model` when imported), before its model is parsed.
    ``beside`` (the config file's folder) is searched first while they import, then taken off
    ``sys.path`` again, so no other import later finds a file there."""
    import importlib

    if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
        raise ValueError(f"{where} must be a list of module names, got {short_repr(modules)}")
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} must be a list of module names, got {short_repr(modules)}")
        try:
            with _first_on_path(beside):
                importlib.import_module(name)
        except ImportError as error:
            raise ValueError(
                f"{where}: cannot import {name!r} ({error}); the module must be installed, on PYTHONPATH, or "
                "next to the config file"
            ) from None


@contextlib.contextmanager
def _first_on_path(directory: str | None):
    """``directory`` first on ``sys.path`` inside the block (nothing changes for ``None``); the entry
    added is removed on the way out, whatever the block raised."""
    if directory is None:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        if directory in sys.path:
            sys.path.remove(directory)


def preset_names(cls: type) -> tuple[str, ...]:
    """The presets a model config class offers (``cls.preset_names()``; none when it has none)."""
    names = getattr(cls, "preset_names", None)
    return tuple(names()) if callable(names) else ()


def preset_as_dict(cls: type, name, where: str = "preset") -> dict:
    """Preset ``name`` of model config ``cls`` as the nested dict a config file would hold (what a
    file's own keys are merged over). Derived values (an MoE config's ``d_model``) are left out,
    so that they follow the file's own ``d_model``."""
    from dataclasses import asdict

    allowed = preset_names(cls)
    if name not in allowed:
        choices = ", ".join(map(repr, allowed)) if allowed else "none (this model has no presets)"
        raise ValueError(f"{where} must be one of {choices}, got {name!r}")
    preset = asdict(cls.preset(name))
    for value in preset.values():
        if isinstance(value, dict) and "d_model" in value and "d_ff" in value:
            value.pop("d_model")  # an MoEConfig: inherits the model's d_model
    return preset


def _merge(base: dict, override: dict) -> dict:
    """``override`` over ``base``, recursing into mappings present in both."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _field_default(cls: type, name: str):
    for f in fields(cls):
        if f.name == name:
            return None if f.default is MISSING else f.default
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
