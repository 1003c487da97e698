"""Objects in a checkpoint without pickle: a tree of plain values stored as JSON plus tensors.

A checkpoint holds, besides the weights and optimizer tensors, small objects: the data position,
the loss scaler, the scheduler, the param groups' options, RNG states, the run's config. Pickling
them would let a crafted checkpoint run code when it is loaded, so an object ``value`` stored
under DCP key ``K`` becomes:

- ``K/#json``: a uint8 tensor holding the UTF-8 JSON of the tree, where each tensor leaf is replaced by
  ``{"__tensor__": i}``, a tuple by ``{"__tuple__": [...]}`` and a dict whose keys are not all
  strings by ``{"__dict__": [[key, value], ...]}``;
- ``K/#i``: tensor leaf ``i``.

Allowed in the tree: dicts, lists, tuples, str, int, float (inf and nan included), bool, None and
tensors. Anything else is a ``TypeError`` naming where it is; reading never constructs anything
but these types.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

LEAF_SEPARATOR = "/#"
JSON_SUFFIX = "/#json"
_MARKERS = ("__tensor__", "__tuple__", "__dict__", "__float__")


def leaf_key(key: str, index: int) -> str:
    return f"{key}{LEAF_SEPARATOR}{index}"


def json_key(key: str) -> str:
    return key + JSON_SUFFIX


def is_object_part(key: str) -> bool:
    """Whether DCP key ``key`` is part of an encoded object (its JSON or a tensor leaf)."""
    return LEAF_SEPARATOR in key


def encode_object(key: str, value: Any) -> dict[str, torch.Tensor]:
    """``{K/#json: json bytes, K/#i: tensor leaf i}`` for ``value`` (see the module docstring)."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return {"__tensor__": len(leaves) - 1}
        if node is None or isinstance(node, (bool, str)):
            return node
        if isinstance(node, int):
            return int(node)
        if isinstance(node, float):
            return node if math.isfinite(node) else {"__float__": repr(node)}
        if isinstance(node, tuple):
            return {"__tuple__": [walk(item, f"{where}[{i}]") for i, item in enumerate(node)]}
        if isinstance(node, list):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node) and not any(k in _MARKERS for k in node):
                return {k: walk(v, f"{where}[{k!r}]") for k, v in node.items()}
            return {
                "__dict__": [[walk(k, f"{where} key"), walk(v, f"{where}[{k!r}]")] for k, v in node.items()]
            }
        raise TypeError(
            f"{where}: a {type(node).__name__} cannot be stored in a checkpoint (allowed: dict, list, tuple, "
            "str, int, float, bool, None, torch.Tensor)"
        )

    tree = walk(value, key)
    text = json.dumps(tree, separators=(",", ":"), allow_nan=False)
    entries = {json_key(key): torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)}
    for index, tensor in enumerate(leaves):
        entries[leaf_key(key, index)] = tensor
    return entries


class _Malformed(ValueError):
    """A decoding error that already names the entry."""


def decode_object(key: str, entries: dict[str, Any]) -> Any:
    """The value stored under ``key`` by :func:`encode_object`, from the loaded ``entries``."""
    raw = entries[json_key(key)]
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError(f"checkpoint entry {key!r} is not an encoded object")
    try:
        tree = json.loads(bytes(raw.numpy().tobytes()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"checkpoint entry {key!r} is not an encoded object ({error})") from None

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        if set(node) == {"__tensor__"}:
            leaf = leaf_key(key, node["__tensor__"])
            if leaf not in entries:
                raise _Malformed(f"checkpoint entry {key!r} refers to a missing tensor {leaf!r}")
            return entries[leaf]
        if set(node) == {"__tuple__"}:
            return tuple(walk(item) for item in node["__tuple__"])
        if set(node) == {"__float__"}:
            return float(node["__float__"])
        if set(node) == {"__dict__"}:
            return {_hashable(walk(k)): walk(v) for k, v in node["__dict__"]}
        return {k: walk(v) for k, v in node.items()}

    try:
        return walk(tree)
    except _Malformed:
        raise
    except (TypeError, ValueError, KeyError, RecursionError) as error:  # a marker of the wrong form
        detail = f"{type(error).__name__}: {error}"
        raise ValueError(f"checkpoint entry {key!r} is not an encoded object ({detail})") from None


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def leaf_keys(key: str, saved_keys) -> list[str]:
    """The tensor leaves of object ``key`` among the checkpoint's ``saved_keys``."""
    prefix = key + LEAF_SEPARATOR
    return [k for k in saved_keys if k.startswith(prefix) and k[len(prefix) :].isdigit()]
