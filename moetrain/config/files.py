"""Config files -> a validated :class:`TrainConfig`: reading YAML (1.2 numbers) or JSON, the
``--set KEY=VALUE`` overrides, and ``--strategy`` files; every error names the file or the key.
Shared by the ``moetrain`` command and the planner, which reads the same files."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from moetrain.config.loading import config_from_dict
from moetrain.config.train import TrainConfig


class _Loader(yaml.SafeLoader):
    """YAML 1.2 numbers: ``1e-4`` is a float (PyYAML's YAML 1.1 rules read it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def load_config_file(path: str) -> dict:
    """Reads a YAML (``.yaml``/``.yml``) or JSON file into nested dicts; errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read config {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"config {path} is not UTF-8 text (byte {error.start} is not valid UTF-8)") from None
    try:
        data = json.loads(text) if path.endswith(".json") else parse_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ValueError(
            f"config {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
            f"{' '.join(str(error).split())}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must hold a mapping of keys to values")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["optim.lr=1e-3"]`` -> ``data["optim"]["lr"] = 0.001`` (on a copy)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE with a dotted key (optim.lr=1e-3), got {item!r}")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: '{part}' is not a section")
        try:
            node[leaf] = parse_yaml(raw)
        except yaml.YAMLError as error:
            reason = " ".join(str(error).split())
            raise ValueError(f"--set {key}: the value {raw!r} is not valid YAML ({reason})") from None
    return data


STRATEGY_FILE_PARALLEL_KEYS = ("ep_size", "tp_size", "ep_layout", "replica")


def load_strategy_file(path: str) -> dict:
    """A strategy file (``moetrain train --strategy FILE``): a JSON or YAML mapping with
    ``strategy`` (module-name patterns -> kinds) and optionally ``parallel`` (the sizes it was made
    for: any of ``STRATEGY_FILE_PARALLEL_KEYS``). Other top-level keys are the figures of the
    report that ``moetrain plan --recommend --json`` writes beside them, and are not read.
    Returns ``{"strategy": ..., "parallel": ...}``."""
    data = load_config_file(path)
    if "strategy" not in data:
        raise ValueError(
            f"strategy file {path} has no 'strategy' key (a mapping of module patterns to kinds)"
        )
    parallel = data.get("parallel") or {}
    if not isinstance(parallel, dict) or set(parallel) - set(STRATEGY_FILE_PARALLEL_KEYS):
        extra = (
            sorted(set(parallel) - set(STRATEGY_FILE_PARALLEL_KEYS))
            if isinstance(parallel, dict)
            else parallel
        )
        raise ValueError(
            f"strategy file {path}: 'parallel' may hold {', '.join(STRATEGY_FILE_PARALLEL_KEYS)}, "
            f"got {extra!r}"
        )
    return {"strategy": data["strategy"], "parallel": parallel}


def build_train_config(
    config_path: str, overrides: list[str], strategy_file: str | None = None
) -> TrainConfig:
    """The validated config of a file, ``--set`` overrides and a ``--strategy`` file (its
    ``strategy`` and ``parallel`` sizes replace the config's). Modules named under ``imports`` are
    looked up next to the config file first (a user's model beside its config)."""
    directory = str(Path(config_path).resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    data = apply_overrides(load_config_file(config_path), overrides)
    if strategy_file is not None:
        chosen = load_strategy_file(strategy_file)
        section = data.get("parallel") or {}
        data["parallel"] = {**section, **chosen["parallel"], "strategy": chosen["strategy"]}
    return config_from_dict(TrainConfig, data)
