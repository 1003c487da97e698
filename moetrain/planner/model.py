"""The model as the planner sees it: architecture numbers, and parameters counted on ``meta``.

:class:`ModelArch` holds what the activation, FLOP and communication formulas need. The parameter
counts are exact: the real model class is built on the ``meta`` device (no memory, no values) and
its modules are walked; expert parameters are those of every
:class:`~moetrain.layers.experts.GroupedExperts`, everything else is dense (held by every rank).
The model is built without expert parallelism (each GroupedExperts holds all ``E`` experts of its
layer); under EP a rank holds ``E / ep_size`` of them, so its share of a stacked expert weight
``[E, ...]`` is exactly ``numel / E * (E / ep_size)``.

Models are found through the registry (:mod:`moetrain.registry`): a model's ``describe`` hook
gives its :class:`ModelDescription`; a model without one is measured on ``meta``
(:mod:`moetrain.planner.generic`). The planner knows no model by name: a description states the
facts its formulas need (:class:`ModelArch`: sizes, which layers are MoE, causal attention or an
explicit mask, dropout, an image stem, logits for every position or the targets only) and may bring
the terms saved outside its layers (``ModelArch.outside``; see :mod:`moetrain.planner.activations`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from moetrain.config import MoEConfig
from moetrain.layers.experts import GroupedExperts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelArch:
    """Architecture numbers (legend: D model dim, H heads, V vocabulary, E experts, k choices).

    - ``moe_layers``: indices of the layers whose FFN is a MoELayer (the others: a dense FFN of
      hidden size ``dense_d_ff`` with ``moe.activation``).
    - ``image_tokens``: patch positions prepended to every sequence (0: text only);
      ``image_size``, ``image_channels``, ``patch_size``, ``stem_channels``: the conv stem.
    - ``dropout``: probability on each residual branch, the embeddings and the attention.
    - ``tied_head``: the output projection reuses the embedding matrix.
    - ``input_modules``: names of the modules and parameters used only before the first layer
      (embeddings, positions, an image stem): their gradients arrive after layer 0's backward,
      the other parameters' outside the layers (head, final norm) before the layers'.
    - ``causal``: attention is causal without a mask, so flash / memory-efficient kernels compute
      half the score matrix; False: the whole matrix.
    - ``attention_mask``: attention takes an explicit boolean ``[B, S, S]`` mask (a prefix-LM):
      saved as a float bias by each attention, and kept once by recomputed layers and attention
      blocks as their checkpoint input.
    - ``targets_only``: logits and loss for the target tokens only (``Workload.target_len``);
      False: for every position (a language model), and a plan refuses another ``target_len``.
    - ``outside``: ``outside(arch, work) -> (terms, flops)``, the bytes saved outside the layers
      before the head (inputs, an image stem, the final norm; named terms) and their forward FLOPs,
      for a model whose inputs differ from a decoder LM's; None: token ids and the final norm over
      every token (:func:`moetrain.planner.activations.activation_model` adds the head and loss).
    - ``measured``: a model without a describe hook only, the
      :class:`~moetrain.planner.generic.MeasuredModel` of a model without formulas (:attr:`generic`).
    """

    d_model: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_seq_len: int
    moe: MoEConfig
    moe_layers: tuple[int, ...]
    dense_d_ff: int | None = None
    dropout: float = 0.0
    image_tokens: int = 0
    image_size: int = 0
    image_channels: int = 0
    patch_size: int = 0
    stem_channels: tuple[int, ...] = ()
    tied_head: bool = False
    input_modules: tuple[str, ...] = ()
    causal: bool = True
    attention_mask: bool = False
    targets_only: bool = False
    outside: Callable | None = field(default=None, compare=False, repr=False)
    measured: object = field(default=None, compare=False, repr=False)

    @property
    def generic(self) -> bool:
        """A model measured on ``meta`` (no describe hook): its MoE layers by their own names, the
        rest as measured (:mod:`moetrain.planner.generic`)."""
        return self.measured is not None

    def __post_init__(self) -> None:
        if self.causal and self.attention_mask:
            raise ValueError(
                "attention_mask: an explicit mask is planned as full attention (causal = False), "
                "causal attention as masked by the kernel (attention_mask = False)"
            )

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def layer_module(self, index: int) -> str:
        """The module name of layer ``index``: ``blocks.<index>``; a generic model's MoE layers by
        their own names."""
        if self.generic:
            return self.measured.moe_modules[index]
        return f"blocks.{index}"


@dataclass(frozen=True)
class ParameterCount:
    """Exact parameter counts (elements) from walking the model built on ``meta``.

    ``dense``: every parameter outside GroupedExperts (counted once when tied). ``expert_stacks``:
    ``(numel, E)`` per GroupedExperts parameter, the stacked weight of all ``E`` experts."""

    dense: int
    expert_stacks: tuple[tuple[int, int], ...]

    @property
    def expert_total(self) -> int:
        return sum(numel for numel, _ in self.expert_stacks)

    @property
    def total(self) -> int:
        return self.dense + self.expert_total

    def expert_per_rank(self, ep_size: int) -> int:
        """Expert elements one rank holds: ``sum numel / E * (E / ep_size)``; ValueError when
        ``ep_size`` does not divide some layer's ``E``."""
        total = 0
        for numel, experts in self.expert_stacks:
            if experts % ep_size:
                raise ValueError(
                    f"ep_size = {ep_size} must divide num_experts = {experts} (each expert-parallel rank "
                    f"holds the same number of experts)"
                )
            total += numel // experts * (experts // ep_size)
        return total

    def per_rank(self, ep_size: int) -> int:
        return self.dense + self.expert_per_rank(ep_size)


@dataclass(frozen=True)
class ModelDescription:
    """A model for the planner: its name, architecture, config and how to build it (any device).
    ``seq_len_from_data``: the text tokens per sequence a training config's ``data.seq_len`` means
    for this model, when it is not ``data.seq_len`` itself (a model whose prefix and target may each
    be that long plans twice as many); ``target_len_from_data``: the most of them that get logits
    and a loss (a ``targets_only`` model's target; None: all of them)."""

    name: str
    arch: ModelArch
    config: object
    build: Callable[[], nn.Module] = field(repr=False, compare=False)
    seq_len_from_data: Callable[[int], int] | None = field(default=None, repr=False, compare=False)
    target_len_from_data: Callable[[int], int] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def meta_model(self) -> nn.Module:
        """The model built on ``meta`` (no memory), once: the planner only reads its structure
        (counts, split units, strategy matches), so every candidate layout shares it (building it
        for each of ``recommend``'s candidates was 80% of M6-1T's search)."""
        return build_on_meta(self.build)

    @cached_property
    def _counts(self) -> tuple[ParameterCount, tuple[ParameterCount, ...], int]:
        model = self.meta_model
        modules = dict(model.named_modules())
        layers = tuple(
            count_parameters(modules[self.arch.layer_module(i)]) for i in range(self.arch.num_layers)
        )
        prefixes = self.arch.input_modules
        inputs = sum(
            p.numel()
            for name, p in model.named_parameters()  # tied parameters once, under their first name
            if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)
        )
        return count_parameters(model), layers, inputs

    @property
    def params(self) -> ParameterCount:
        """Counted once (model built on ``meta``) and cached."""
        return self._counts[0]

    @property
    def layer_params(self) -> tuple[ParameterCount, ...]:
        """The parameters of each layer (module :meth:`ModelArch.layer_module`), counted with
        :attr:`params`."""
        return self._counts[1]

    @property
    def input_params(self) -> int:
        """Elements of the parameters of ``arch.input_modules`` (dense, counted with :attr:`params`)."""
        return self._counts[2]


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """Calls ``build()`` under ``torch.device("meta")``, so every parameter is created without
    memory; raises ValueError if a parameter still ends up elsewhere."""
    with torch.device("meta"):
        model = build()
    stray = [name for name, p in model.named_parameters() if p.device.type != "meta"]
    if stray:
        raise ValueError(f"building the model on meta left parameters on other devices: {stray[:3]}")
    return model


def count_parameters(model: nn.Module) -> ParameterCount:
    """Dense and expert parameter elements of ``model`` (each parameter once, tied ones once)."""
    expert_ids, stacks = set(), []
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for param in module.parameters(recurse=False):
                if id(param) not in expert_ids:
                    expert_ids.add(id(param))
                    stacks.append((param.numel(), module.num_experts))
    dense = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids)
    return ParameterCount(dense=dense, expert_stacks=tuple(stacks))


def describe(config, name: str | None = None, train_config=None) -> ModelDescription:
    """The planner's description of a model config object, from its registry entry: the entry's
    ``describe(config, name)`` hook when it has one (the repository's example models do), otherwise
    measured on ``meta`` through its builder (:mod:`moetrain.planner.generic`; ``train_config``: the
    run it belongs to, default: a :class:`~moetrain.config.TrainConfig` with this model and default
    settings)."""
    from moetrain.registry import spec_for_config

    spec = spec_for_config(config)
    name = name or spec.name
    if spec.describe is not None:
        return spec.describe(config, name)
    from moetrain.config import TrainConfig
    from moetrain.planner.generic import describe_generic

    return describe_generic(train_config or TrainConfig(model=config), spec, name)


def model_presets() -> dict[str, tuple]:
    """``--model`` preset names (``<model>-<preset>``, lower case) -> (registry spec, preset): every
    preset of every registered model, under the model's name and under its first word (``m6-1t``
    for the ``1T`` preset of ``m6_moe``)."""
    from moetrain.config import preset_names
    from moetrain.registry import registered_models

    presets = {}
    for spec in registered_models().values():
        for preset in preset_names(spec.config_class):
            for prefix in dict.fromkeys((spec.name, spec.name.split("_")[0])):
                presets[f"{prefix}-{preset}".lower()] = (spec, preset)
    return presets


def _preset_list(presets: dict[str, tuple]) -> str:
    shown = {f"{spec.name.split('_')[0]}-{preset}": None for spec, preset in presets.values()}
    return ", ".join(shown) or "none registered"


def resolve_model(spec: str) -> tuple[ModelDescription, dict]:
    """``--model`` of ``moetrain plan``: a registered model's preset (``m6-1T``, ``m6_moe-tiny``,
    ``m6:base``, case-insensitive) or a YAML/JSON file holding a training config (``model:`` with a
    ``name``; modules under ``imports:`` are imported as ``moetrain train`` does; its ``data``,
    ``parallel``, ``grad_accum`` and ``precision`` become default settings, returned as the second
    item; ``data.seq_len`` becomes the sequence length through the description's
    ``seq_len_from_data``) or a bare model config (a mapping with ``name``). Without a
    ``data`` section the sequence length is left to the settings (default: the model's maximum)."""
    path = Path(spec)
    if path.is_file():
        return _model_from_file(path)
    presets = model_presets()
    found = presets.get(spec.lower().replace(":", "-", 1))
    if found is None:
        raise ValueError(
            f"model must be a model preset ({_preset_list(presets)}) or an existing YAML/JSON config file, "
            f"got {spec!r}"
        )
    model_spec, preset = found
    config = model_spec.config_class.preset(preset)
    return describe(config, f"{model_spec.name.split('_')[0]}-{preset}"), {}


def train_seq_len(model: ModelDescription, data_seq_len: int) -> int:
    """Text tokens per sequence a training config's ``data.seq_len`` means: the description's
    ``seq_len_from_data(data.seq_len)`` when it has one, else ``data.seq_len`` itself; a generic
    model's measured tokens per sequence."""
    if model.arch.generic:
        return model.arch.max_seq_len  # measured from the model's own batches
    return data_seq_len if model.seq_len_from_data is None else model.seq_len_from_data(data_seq_len)


def run_batch_settings(train, model: ModelDescription) -> dict:
    """The :class:`~moetrain.planner.settings.PlanSettings` a training config's batch and precision
    give: ``micro_batch``, ``seq_len`` (:func:`train_seq_len`), ``precision`` and ``autocast``, and
    ``target_len`` (the description's ``target_len_from_data(data.seq_len)``) when it has one."""
    settings = {
        "micro_batch": train.data.micro_batch_size,
        "seq_len": train_seq_len(model, train.data.seq_len),
        "precision": train.precision,
        # the engine: fp32 weights with autocast compute, unless param_dtype stores them low
        "autocast": train.precision != "fp32" and train.param_dtype == "fp32",
    }
    if model.target_len_from_data is not None and not model.arch.generic:
        settings["target_len"] = model.target_len_from_data(train.data.seq_len)
    return settings


def run_recompute_settings(recompute_budget_mb: float | None) -> dict:
    """The recompute the engine applied for a training config's ``recompute_budget_mb``: None
    recomputes nothing (``"none"``), 0 the least memory reachable (``"full"``), else the cheapest
    blocks within that many MiB (``"budget"``). ``plan --calibrate`` plans what the run did;
    ``plan --model CONFIG`` keeps ``"auto"``, the planner's own choice."""
    if recompute_budget_mb is None:
        return {"recompute": "none"}
    if recompute_budget_mb == 0:
        return {"recompute": "full"}
    return {"recompute": "budget", "recompute_budget_bytes": int(recompute_budget_mb * 2**20)}


def strategy_from_marks(model: ModelDescription, tp_size: int, pp_size: int = 1) -> dict[str, str] | None:
    """The strategy the scopes of a model built under Whale's annotations give at ``tp_size``
    (:func:`moetrain.scope.strategy_from_scopes`, the model built on ``meta``), None when it has no
    marks. ``scope.auto()`` parts are planned replicated, with a warning: their split is decided at
    run time (``parallel.auto_gpu``), and ``moetrain plan --recommend`` searches it."""
    from types import SimpleNamespace

    from moetrain.scope import has_marks, strategy_from_scopes

    module = build_on_meta(model.build)
    if not has_marks(module):
        return None
    autos: list[str] = []

    def replicate(_module, _parallel, names):
        autos.extend(names)
        return {}

    layout = SimpleNamespace(tp_size=tp_size, pp_size=pp_size)
    strategy = strategy_from_scopes(module, layout, auto=replicate)
    if autos:
        log.warning(
            "%s: %d module(s) built under scope.auto() planned replicated (their split is decided at run "
            "time; --recommend searches it)", model.name, len(autos),
        )  # fmt: skip
    return strategy


def _model_from_file(path: Path) -> tuple[ModelDescription, dict]:
    from moetrain.config import config_from_dict, model_config_classes
    from moetrain.config.files import load_config_file

    data = load_config_file(str(path))  # as `moetrain train` reads it: YAML 1.2 numbers, no repeated key
    if "model" in data:
        from moetrain.config.files import build_train_config

        train = build_train_config(str(path), [])
        model = describe(train.model, path.stem, train)
        defaults = {
            **run_batch_settings(train, model),
            "grad_accum": train.grad_accum,
            "ep_size": train.parallel.ep_size,
            "all_to_all": train.parallel.all_to_all,
            "ep_layout": train.parallel.ep_layout,
            "comm_dtype": train.parallel.comm_dtype,
            "a2a_chunks": train.parallel.a2a_chunks,
            "offload": train.optim.name == "offload",
            "offload_apply_groups": train.optim.num_apply_groups,
            "optim_overlap": train.optim.overlap,
            "experts_init": train.experts_init,
            "async_checkpoint": train.async_checkpoint,
            "pp_size": train.parallel.pp_size,
            "pp_schedule": train.parallel.pp_schedule,
            "pp_virtual": train.parallel.pp_virtual,
        }
        if train.parallel.tp_size > 1:
            from moetrain.registry import spec_for_config

            hook = spec_for_config(train.model).strategy
            strategy = train.parallel.strategy or (hook(train) if hook is not None else None)
            if strategy is None:
                strategy = strategy_from_marks(model, train.parallel.tp_size, train.parallel.pp_size)
            defaults.update(tp_size=train.parallel.tp_size, strategy=strategy)
        return model, defaults
    classes = model_config_classes()
    if not isinstance(data.get("name"), str) or data["name"] not in classes:
        raise ValueError(
            f"model config {path}: 'name' must be one of {', '.join(map(repr, classes))}, "
            f"got {data.get('name')!r}"
        )
    body = {k: v for k, v in data.items() if k != "name"}
    return describe(config_from_dict(classes[data["name"]], body, "model"), path.stem), {}
