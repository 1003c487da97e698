"""M6-style multimodal MoE model: config and presets, model, data, pretraining tasks, generation.

Installed as the top-level package ``m6_moe`` (from the folder ``models/m6_moe`` of the repository).
It registers itself with moetrain's model registry as ``m6_moe`` through the entry point
``moetrain.models`` (:func:`register`); the engine then builds it with :func:`build_m6`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from m6_moe.config import PRESET_PARAMETER_TARGETS, PRESETS, M6Config, M6TaskConfig
from m6_moe.data import ManifestDataset, resolve_manifests
from m6_moe.loader import M6Batches
from m6_moe.manifest_index import ensure_index
from m6_moe.model import (
    TIED_PIPELINE_ERROR,
    M6Model,
    count_active_parameters,
    count_parameters,
    default_m6_strategy,
    prefix_lm_mask,
)
from m6_moe.synthetic import ensure_synthetic_dataset
from m6_moe.tasks import TaskSampler, m6_loss
from m6_moe.tokenizer import ByteTokenizer, JSONTokenizer, load_tokenizer
from moetrain.cpus import cpus_per_rank, default_num_workers

# The embedded dataset: fixed, so every run that says ``data.source: embedded`` sees the same data.
EMBEDDED_DATASET = {"seed": 0, "num_train": 2000, "num_heldout": 200, "size": 64}


def prepare_embedded_dataset(out_dir: str | Path, rank: int, world_size: int) -> Path:
    """``<out_dir>/data`` holding the synthetic dataset. Rank 0 writes it (temporary directory,
    then an atomic rename) while the other ranks wait at a barrier; then every rank checks it and
    writes its own copy only where it cannot see rank 0's (node-local ``out_dir``), race-free."""
    import torch.distributed as dist

    directory = Path(out_dir) / "data"
    if rank == 0:
        ensure_synthetic_dataset(directory, **EMBEDDED_DATASET)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
    return ensure_synthetic_dataset(directory, **EMBEDDED_DATASET)


def prepare_manifest_indexes(manifests: list[Path], rank: int, world_size: int, fallback_dir=None) -> None:
    """Builds the missing indexes of ``manifests`` before the ranks open them: rank ``r`` builds
    manifests ``r, r + world, ...`` (so a corpus of many shards is indexed in parallel), then all
    ranks meet at a barrier. A manifest whose index cannot be built (any error) is left for the
    dataset to report on every rank (an error here would leave the other ranks waiting at the
    barrier)."""
    import torch.distributed as dist

    for manifest in manifests[rank::world_size]:
        with contextlib.suppress(Exception):
            ensure_index(manifest, fallback_dir)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def check_m6(config):
    """The registry's check hook: ``ValueError`` (one line naming the key) for a ``TrainConfig`` the
    builder cannot take; returns the tokenizer it loaded to check the vocabulary."""
    model_config = config.model
    if not isinstance(model_config, M6Config):
        raise ValueError(f"model must be an M6Config, got {type(model_config).__name__}")
    data = config.data
    if 2 * data.seq_len > model_config.max_text_len:
        raise ValueError(
            f"data.seq_len = {data.seq_len} allows prefix + target = {2 * data.seq_len} text positions, "
            f"more than model.max_text_len = {model_config.max_text_len}"
        )
    tokenizer = load_tokenizer(model_config.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"model.vocab_size = {model_config.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} ids, tokenizer {model_config.tokenizer!r})"
        )
    if config.parallel.pp_size > 1 and model_config.tie_embeddings:
        raise ValueError(TIED_PIPELINE_ERROR)
    return tokenizer


def build_m6(config, shard):
    """Builds ``(model, batches, loss_fn)`` for the engine from a ``TrainConfig`` whose ``model``
    is an :class:`M6Config`. ``config.data``: ``source`` is ``"embedded"`` (the synthetic
    dataset, written once into ``<out_dir>/data``), a manifest path, or a list of manifest paths and
    glob patterns (their indexes are built first, split between the ranks);
    ``micro_batch_size`` samples per batch; ``seq_len`` the longest prefix and the longest target
    (bos / eos included), so ``2 * seq_len`` must fit in ``model.max_text_len``; ``num_workers``
    loader processes per rank (``"auto"``: :func:`moetrain.cpus.default_num_workers` of the rank's
    CPUs); with ``parallel.pp_size > 1`` every batch is padded to ``seq_len`` (one shape for the
    pipeline stages) and ``tie_embeddings`` is refused. ``shard``: this rank's data stream
    (:class:`moetrain.registry.DataShard`); the data is seeded by ``config.seed`` and the
    shard's index (tensor-parallel ranks read the same batches).
    The model is built whole; the engine parallelizes it (:func:`m6_strategy`)."""
    tokenizer = check_m6(config)
    model_config, data = config.model, config.data
    pipeline = config.parallel.pp_size > 1
    rank, world_size = shard.rank, shard.world_size
    if data.source == "embedded":
        manifests = [prepare_embedded_dataset(config.out_dir, rank, world_size) / "train.jsonl"]
    else:
        manifests = resolve_manifests(data.source)
    prepare_manifest_indexes(manifests, rank, world_size)
    dataset = ManifestDataset(
        manifests,
        model_config.image_size,
        model_config.image_channels,
        skip_bad_records=model_config.tasks.skip_bad_records,
        max_image_pixels=model_config.tasks.max_image_pixels,
        cache_images=data.source == "embedded",
    )
    sampler = TaskSampler(dataset, tokenizer, model_config.tasks, data.seq_len, seed=config.seed)
    workers = data.num_workers
    if workers == "auto":
        workers = default_num_workers(cpus_per_rank(world_size))
    batches = M6Batches(
        sampler, data.micro_batch_size, model_config.num_patches, rank=shard.index, world_size=shard.count,
        num_workers=workers, group=shard.group, fixed_length=pipeline,
    )  # fmt: skip
    model = M6Model(model_config, seed=config.seed)
    return model, batches, m6_loss


def m6_strategy(config) -> dict[str, str]:
    """The registry's strategy hook: :func:`m6_moe.model.default_m6_strategy` for the run's
    ``tp_size`` and ``pp_size``."""
    return default_m6_strategy(config.model, config.parallel.tp_size, config.parallel.pp_size)


def register() -> None:
    """Registers ``m6_moe`` with :mod:`moetrain.registry` (called through the entry point), with
    its planner description (:mod:`m6_moe.planning`) and its ``moetrain eval`` and ``moetrain
    generate`` commands (:mod:`m6_moe.eval_command`, :mod:`m6_moe.generate_command`)."""
    from m6_moe.eval_command import EvalCommand
    from m6_moe.generate_command import GenerateCommand
    from m6_moe.planning import describe_m6
    from moetrain.registry import register_model

    register_model(
        "m6_moe", M6Config, build_m6, describe=describe_m6, evaluate=EvalCommand(),
        generate=GenerateCommand(), strategy=m6_strategy, check=check_m6,
    )  # fmt: skip


__all__ = [
    "EMBEDDED_DATASET",
    "PRESETS",
    "PRESET_PARAMETER_TARGETS",
    "ByteTokenizer",
    "JSONTokenizer",
    "M6Batches",
    "M6Config",
    "M6Model",
    "M6TaskConfig",
    "ManifestDataset",
    "TaskSampler",
    "build_m6",
    "count_active_parameters",
    "count_parameters",
    "default_m6_strategy",
    "load_tokenizer",
    "m6_loss",
    "prefix_lm_mask",
    "prepare_embedded_dataset",
    "prepare_manifest_indexes",
    "m6_strategy",
    "register",
]
