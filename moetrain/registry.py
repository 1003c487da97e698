"""The model registry: how the engine, the config parser, the planner, the checkpoint tools and the
``eval`` / ``generate`` commands find a model, by the ``name`` of a config's ``model`` section.

A model is registered with :func:`register_model`: a name, its config dataclass (validated in
``__post_init__``; presets through ``preset_names()`` / ``preset(name)`` if it has any) and a
builder ``builder(train_config, shard) -> (model, batches, loss_fn)``, where ``shard`` is this
rank's :class:`DataShard` (``index`` of ``count`` data streams; tensor-parallel ranks share one,
so their batches must be equal: seed the data from ``shard.index``, not from the rank):

- ``model``: an ``nn.Module`` built with no knowledge of the parallel layout (the engine applies
  the strategy with :func:`moetrain.parallelize` afterwards), called as ``model(inputs)`` or
  ``model(**inputs)``;
- ``batches``: ``next() -> (inputs, targets)``, ``probe(sequences, seed)``, ``state_dict()`` /
  ``load_state_dict()`` (the data position in checkpoints), ``reseed(seed, rank, step)``,
  ``tokens_per_batch``, a settable ``batch`` (sequences per micro-batch); optionally ``close()``
  (stops loader workers; the engine calls it when a run ends);
- ``loss_fn(output, targets) -> scalar`` (a mean), optionally with ``loss_units(targets)``.

Optional hooks: ``check(train_config)`` (raises ``ValueError``, one line naming the key, for a
config the builder cannot take: called by ``moetrain train`` before the run writes anything, so a
builder should call it too for users of the Python API), ``strategy(train_config) -> {pattern:
kind}`` (the model's default strategy, used
when the config gives none; without it: the marks of a model built under :mod:`moetrain.scope`,
else every ``MoELayer`` ``expert``, everything else replicated), ``describe`` (the planner's model
description, see ``moetrain.planner``), ``evaluate`` and ``generate`` (the ``moetrain eval`` /
``moetrain generate`` commands: each gets the parsed command-line arguments and the training config
and returns an exit code).

Installed packages register through the entry-point group ``moetrain.models`` (each entry point is
a callable taking no argument that calls :func:`register_model`); the repository's example models,
the byte-level language model ``moe_lm`` and ``m6_moe`` (``models/``), do so like any user model.
The core never imports a model package.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "moetrain.models"


@dataclass(frozen=True)
class DataShard:
    """Which data stream a rank reads: ``index`` in ``[0, count)``; ``group``: a process group of
    one rank per stream, in which this rank has rank ``index`` (None in a single process: for data
    loaders that agree on positions); ``rank`` / ``world_size``: the process in the world (for work
    done once per run or per rank, like preparing files)."""

    index: int = 0
    count: int = 1
    rank: int = 0
    world_size: int = 1
    group: object = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_class: type
    builder: Callable
    describe: Callable | None = None
    evaluate: Callable | None = None
    generate: Callable | None = None
    strategy: Callable | None = None
    check: Callable | None = None


_REGISTRY: dict[str, ModelSpec] = {}
_LOADED = {"entry_points": False}


def register_model(
    name: str,
    config_class: type,
    builder: Callable,
    *,
    describe: Callable | None = None,
    evaluate: Callable | None = None,
    generate: Callable | None = None,
    strategy: Callable | None = None,
    check: Callable | None = None,
) -> ModelSpec:
    """Registers (or replaces) model ``name``. Returns its :class:`ModelSpec`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"model name must be an identifier like 'my_model', got {name!r}")
    if not isinstance(config_class, type):
        raise ValueError(f"config_class of model {name!r} must be a class, got {config_class!r}")
    if not callable(builder):
        raise ValueError(f"builder of model {name!r} must be callable, got {builder!r}")
    for hook, value in (("strategy", strategy), ("check", check)):
        if value is not None and not callable(value):
            raise ValueError(f"{hook} hook of model {name!r} must be callable, got {value!r}")
    spec = ModelSpec(name, config_class, builder, describe, evaluate, generate, strategy, check)
    _REGISTRY[name] = spec
    return spec


def _load_registrations() -> None:
    """Every installed package's entry point (once per process)."""
    if _LOADED["entry_points"]:
        return
    _LOADED["entry_points"] = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()()
        except Exception as error:  # noqa: BLE001 - one broken plugin must not hide the others
            log.warning("model entry point %r (%s) failed to register: %s", entry.name, entry.value, error)


def registered_models() -> dict[str, ModelSpec]:
    """Every registered model by name."""
    _load_registrations()
    return dict(_REGISTRY)


def get_model(name: str) -> ModelSpec:
    """The spec of model ``name``; ``ValueError`` listing the registered names otherwise."""
    models = registered_models()
    if name not in models:
        raise ValueError(f"model.name must be one of {', '.join(map(repr, sorted(models)))}, got {name!r}")
    return models[name]


def spec_for_config(model_config) -> ModelSpec:
    """The spec whose config class ``model_config`` is an instance of."""
    for spec in registered_models().values():
        if isinstance(model_config, spec.config_class):
            return spec
    raise ValueError(f"model config {type(model_config).__name__} belongs to no registered model")
