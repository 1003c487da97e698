"""Config files -> a validated :class:`TrainConfig`: reading YAML (1.2 numbers) or JSON, the
``--set KEY=VALUE`` overrides, and ``--strategy`` files; every error names the file or the key.
Shared by the ``moetrain`` command and the planner, which reads the same files."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import yaml

from moetrain.config.loading import config_from_dict, import_model_modules, short_repr, shorten_error
from moetrain.config.parallel import validate_strategy
from moetrain.config.train import TrainConfig

_INT_TAG = "tag:yaml.org,2002:int"
_ALLOWED_VALUES = "strings, numbers, true/false, null, lists and mappings"


class _Loader(yaml.SafeLoader):
    """YAML 1.2 numbers: ``1e-4`` is a float (PyYAML's YAML 1.1 rules read it as a string) and an
    integer is decimal even with leading zeros (``010`` is 10; ``0o17`` is octal, ``0x1f`` hex;
    no YAML 1.1 ``0b`` binary or ``1:30`` base 60). A key given twice in one mapping is an error."""

    def construct_mapping(self, node, deep=False):
        """The mapping of ``node``; raises ``ConstructorError`` naming a key given twice and its lines."""
        if isinstance(node, yaml.MappingNode):
            _reject_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _reject_duplicate_keys(loader: _Loader, node: yaml.MappingNode) -> None:
    """Raises ``ConstructorError`` when two scalar keys of ``node`` are equal (``<<`` merges, whose
    keys the mapping's own keys may override, are not counted)."""
    first_line = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if key in first_line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} on line {line} (first given on line {first_line[key]})"
            )
        first_line[key] = line


def _construct_int(loader: _Loader, node) -> int:
    """A YAML 1.2 integer: decimal (leading zeros allowed), ``0o`` octal or ``0x`` hex; ``_`` ignored."""
    text = loader.construct_scalar(node)
    digits = text.replace("_", "")
    sign = -1 if digits.startswith("-") else 1
    digits = digits[1:] if digits[:1] in ("-", "+") and digits else digits
    base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    try:
        return sign * int(digits if base == 10 else digits[2:], base)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not an integer (decimal, 0o octal or 0x hex)", node.start_mark
        ) from None


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _INT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_constructor(_INT_TAG, _construct_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    """``text`` parsed as YAML with :class:`_Loader` (YAML 1.2 numbers, no duplicate keys)."""
    return yaml.load(text, Loader=_Loader)


class _DuplicateJsonKey(ValueError):
    """A key given twice in one JSON object."""


def _json_mapping(pairs: list) -> dict:
    """A JSON object's pairs as a dict; raises :class:`_DuplicateJsonKey` naming a key given twice."""
    mapping = {}
    for key, value in pairs:
        if key in mapping:
            raise _DuplicateJsonKey(f"duplicate key {key!r}")
        mapping[key] = value
    return mapping


MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 100
_TOO_DEEP = "nested too deeply or refers to itself (an alias inside its own anchor)"


def reject_non_json_values(value, where: str = "") -> None:
    """Raises ``ValueError`` naming the key path (``out_dir``, ``optim.betas[0]``) of the first value
    in ``value`` that JSON cannot hold (what safe YAML makes of a date, ``!!binary`` or ``!!set``),
    or naming the top-level key where ``value`` nests deeper than ``MAX_CONFIG_DEPTH`` (an alias
    inside its own anchor nests forever) or where its values pass ``MAX_CONFIG_VALUES``. Values are
    counted as written out, every use of an alias counting its anchor's values again: YAML's loader
    shares an anchor's value between its aliases, so a few hundred bytes of nested aliases (an
    "alias bomb") stand for gigabytes, which copying the config (``json.dumps``) would build.
    Nothing is copied here, and the walk stops at the limit."""
    _reject_non_json(value, where, where, 0, [0])


def _reject_non_json(value, where: str, named: str, depth: int, count: list[int]) -> None:
    """:func:`reject_non_json_values` below key path ``where``; ``named``: the key the depth and size
    errors name (the top-level one); ``count[0]``: the values visited so far."""
    count[0] += 1
    if count[0] > MAX_CONFIG_VALUES:
        raise ValueError(
            f"{named or 'config'}: the config holds more than {MAX_CONFIG_VALUES} values (each use of a "
            "YAML alias counts its anchor's values again)"
        )
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"{named or 'config'}: {_TOO_DEEP}")
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise ValueError(f"{path}: {_non_json_reason(key)} (as a key)")
            _reject_non_json(item, path, named or path, depth + 1, count)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _reject_non_json(item, f"{where}[{index}]", named, depth + 1, count)
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise ValueError(f"{where or 'config'}: {_non_json_reason(value)}")


def _non_json_reason(value) -> str:
    """Why ``value`` may not stand in a config, and what to write instead."""
    if isinstance(value, datetime.date):
        return "a date is not allowed here; quote it to make a string"
    if isinstance(value, bytes):
        return f"binary data (!!binary) is not allowed here; allowed: {_ALLOWED_VALUES}"
    if isinstance(value, (set, frozenset)):
        return "a set (!!set) is not allowed here; write a list ([a, b])"
    return f"a {type(value).__name__} is not allowed here; allowed: {_ALLOWED_VALUES}"


def load_config_file(path: str) -> dict:
    """Reads a YAML (``.yaml``/``.yml``) or JSON file into nested dicts; errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read config {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"config {path} is not UTF-8 text (byte {error.start} is not valid UTF-8)") from None
    is_json = path.endswith(".json")
    try:
        data = json.loads(text, object_pairs_hook=_json_mapping) if is_json else parse_yaml(text)
    except (json.JSONDecodeError, _DuplicateJsonKey, yaml.YAMLError) as error:
        raise ValueError(
            f"config {path} is not valid {'JSON' if is_json else 'YAML'}: {' '.join(str(error).split())}"
        ) from None
    except RecursionError:  # the parsers recurse once per level of nesting
        raise ValueError(f"config {path}: {_TOO_DEEP}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must hold a mapping of keys to values")
    try:
        reject_non_json_values(data)
    except ValueError as error:
        raise ValueError(f"config {path}: {error}") from None
    except RecursionError:
        raise ValueError(f"config {path}: {_TOO_DEEP}") from None
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["optim.lr=1e-3"]`` -> ``data["optim"]["lr"] = 0.001`` (on a copy). A value JSON cannot hold
    (a date, ``!!binary``, ``!!set``) in ``data`` or an override, nesting too deep or too many values
    (:func:`reject_non_json_values`) is a ``ValueError`` naming its key."""
    try:
        reject_non_json_values(data)
        data = json.loads(json.dumps(data))
    except RecursionError:
        raise ValueError(f"config: {_TOO_DEEP}") from None
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
            reject_non_json_values(node[leaf], key)
        except yaml.YAMLError as error:
            reason = " ".join(str(error).split())
            raise ValueError(
                f"--set {key}: the value {short_repr(raw)} is not valid YAML ({reason})"
            ) from None
        except ValueError as error:
            raise ValueError(f"--set {error}") from None
        except RecursionError:
            raise ValueError(f"--set {key}: {_TOO_DEEP}") from None
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
    strategy = validate_strategy(f"strategy file {path}: strategy", data["strategy"])
    parallel = {} if data.get("parallel") is None else data["parallel"]
    if not isinstance(parallel, dict) or set(parallel) - set(STRATEGY_FILE_PARALLEL_KEYS):
        extra = (
            sorted(set(parallel) - set(STRATEGY_FILE_PARALLEL_KEYS))
            if isinstance(parallel, dict)
            else parallel
        )
        raise ValueError(
            f"strategy file {path}: 'parallel' may hold {', '.join(STRATEGY_FILE_PARALLEL_KEYS)}, "
            f"got {short_repr(extra)}"
        )
    return {"strategy": strategy, "parallel": parallel}


def build_train_config(
    config_path: str, overrides: list[str], strategy_file: str | None = None
) -> TrainConfig:
    """The validated config of a file, ``--set`` overrides and a ``--strategy`` file (its
    ``strategy`` and ``parallel`` sizes replace the config's). Modules named under ``imports`` are
    looked up next to the config file first (a user's model beside its config); the config's folder
    is on ``sys.path`` only while they import, and not at all for a config without ``imports``.
    An error message longer than ``MAX_ERROR_CHARS`` is shortened (:func:`shorten_error`)."""
    with shorten_error():
        data = apply_overrides(load_config_file(config_path), overrides)
        if strategy_file is not None:
            chosen = load_strategy_file(strategy_file)
            section = {} if data.get("parallel") is None else data["parallel"]
            if isinstance(section, dict):  # else config_from_dict names the key and what it holds
                data["parallel"] = {**section, **chosen["parallel"], "strategy": chosen["strategy"]}
        if data.get("imports"):
            import_model_modules(data["imports"], "imports", beside=str(Path(config_path).resolve().parent))
        return config_from_dict(TrainConfig, data)
