"""Configuration dataclasses, validated on construction: the tree of one training run.

Every invalid value raises ``ValueError`` naming the field, the value and what is allowed.

One module per section, each with one job (this package only re-exports them):

- :mod:`~moetrain.config.options`: ``option()``, the field that carries each key's meaning;
- :mod:`~moetrain.config.moe`: :class:`MoEConfig`, the options of one MoE layer;
- :mod:`~moetrain.config.parallel`: :class:`ParallelConfig`, the strategy mapping, pipeline rules;
- :mod:`~moetrain.config.data`: :class:`DataConfig`, the input data;
- :mod:`~moetrain.config.optim`: :class:`OptimConfig`, optimizer and learning-rate schedule;
- :mod:`~moetrain.config.balance`: :class:`BalanceConfig`, batch balancing between ranks;
- :mod:`~moetrain.config.metrics`: :class:`MetricsConfig`, where metrics go;
- :mod:`~moetrain.config.train`: :class:`TrainConfig`, one run and its cross-section checks;
- :mod:`~moetrain.config.loading`: nested dicts (a parsed file) -> these dataclasses, presets, imports;
- :mod:`~moetrain.config.files`: YAML/JSON config files, ``--set`` overrides and ``--strategy``
  files -> a validated :class:`TrainConfig` (the command's and the planner's way in).

The key reference ``moetrain train --help`` prints is :mod:`moetrain.config_reference`.
"""

from __future__ import annotations

from moetrain.config.balance import BalanceConfig
from moetrain.config.data import DataConfig
from moetrain.config.loading import (
    config_as_dict,
    config_from_dict,
    import_model_modules,
    model_config_classes,
    preset_as_dict,
    preset_names,
)
from moetrain.config.metrics import METRIC_SINKS, MetricsConfig
from moetrain.config.moe import ACTIVATIONS, KERNEL_CHOICES, SCORE_FUNCTIONS, MoEConfig
from moetrain.config.optim import OPTIM_OVERLAPS, OPTIMIZERS, OptimConfig
from moetrain.config.options import option
from moetrain.config.parallel import (
    ALL_TO_ALL_ALGORITHMS,
    AUTO_GPUS,
    COMM_DTYPES,
    EP_LAYOUTS,
    PP_SCHEDULES,
    REPLICA_MODES,
    STRATEGY_KINDS,
    ParallelConfig,
    check_pipeline_microbatches,
    check_pipeline_virtual,
    validate_strategy,
)
from moetrain.config.train import DEVICES, EXPERTS_INIT, PRECISIONS, RESUME_CHOICES, TrainConfig

# re-exported: models validate their own configs with the same helpers
from moetrain.validation import (
    is_int,
    require_bool,
    require_choice,
    require_fraction,
    require_int,
    require_nonneg_float,
    require_numbers,
    require_positive_float,
)

__all__ = [
    "ACTIVATIONS",
    "ALL_TO_ALL_ALGORITHMS",
    "COMM_DTYPES",
    "DEVICES",
    "EXPERTS_INIT",
    "EP_LAYOUTS",
    "KERNEL_CHOICES",
    "METRIC_SINKS",
    "OPTIMIZERS",
    "OPTIM_OVERLAPS",
    "PP_SCHEDULES",
    "PRECISIONS",
    "AUTO_GPUS",
    "REPLICA_MODES",
    "RESUME_CHOICES",
    "SCORE_FUNCTIONS",
    "STRATEGY_KINDS",
    "BalanceConfig",
    "DataConfig",
    "MetricsConfig",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_pipeline_microbatches",
    "check_pipeline_virtual",
    "config_as_dict",
    "config_from_dict",
    "import_model_modules",
    "is_int",
    "model_config_classes",
    "option",
    "preset_as_dict",
    "preset_names",
    "require_bool",
    "require_choice",
    "require_fraction",
    "require_int",
    "require_nonneg_float",
    "require_numbers",
    "require_positive_float",
    "validate_strategy",
]
