"""The byte-level MoE language model example: config, model, byte corpus data, planner description.

Installed as the top-level package ``moe_lm`` (from the folder ``models/moe_lm`` of the repository),
beside the M6 example ``m6_moe``. It registers itself with moetrain's model registry as ``moe_lm``
through the entry point ``moetrain.models`` (:func:`register`), like any user model; the engine then
builds it with :func:`build_moe_lm`. Modules: :mod:`moe_lm.model` (the transformer, its default
strategy and loss), :mod:`moe_lm.data` (the corpus and its batches), :mod:`moe_lm.planning` (the
registry's ``describe`` hook for ``moetrain plan``).
"""

from __future__ import annotations

from moe_lm.data import TextBatches, load_text_corpus, load_tiny_corpus, sample_batch
from moe_lm.model import (
    CausalSelfAttention,
    LMConfig,
    MoETransformerLM,
    TransformerBlock,
    default_lm_strategy,
    lm_loss,
)
from moe_lm.planning import describe_lm

BYTE_VALUES = 256  # token ids of the byte corpus: 0-255


def check_moe_lm(config) -> None:
    """The registry's check hook: ``ValueError`` (one line naming the key) for a ``TrainConfig`` the
    builder cannot take (a vocabulary smaller than the byte corpus, windows longer than the model's
    positions)."""
    if config.model.vocab_size < BYTE_VALUES:
        raise ValueError(
            f"model.vocab_size must be >= {BYTE_VALUES} (the byte corpus' ids 0-{BYTE_VALUES - 1}), got "
            f"{config.model.vocab_size}"
        )
    if config.data.seq_len > config.model.max_seq_len:
        raise ValueError(
            f"data.seq_len = {config.data.seq_len} exceeds model.max_seq_len = {config.model.max_seq_len}"
        )


def build_moe_lm(config, shard):
    """The registry builder of ``moe_lm``: (model, batches, loss function) for a ``TrainConfig``
    whose ``model`` is an :class:`LMConfig` (``data.source``: ``embedded`` or a UTF-8 text file);
    ``shard``: this rank's data stream (:class:`moetrain.registry.DataShard`)."""
    check_moe_lm(config)
    corpus = load_text_corpus(config.data.source, config.data.seq_len + 1)
    model = MoETransformerLM(config.model, seed=config.seed)
    batches = TextBatches(corpus, config.data.micro_batch_size, config.data.seq_len, config.seed, shard.index)
    return model, batches, lm_loss


def lm_strategy(config) -> dict[str, str]:
    """The registry's strategy hook: :func:`default_lm_strategy` for the run's ``tp_size``."""
    return default_lm_strategy(config.model, config.parallel.tp_size, config.parallel.pp_size)


def register() -> None:
    """Registers ``moe_lm`` with :mod:`moetrain.registry` (called through the entry point), with
    its planner description (:func:`moe_lm.planning.describe_lm`) and its default strategy."""
    from moetrain.registry import register_model

    register_model(
        "moe_lm", LMConfig, build_moe_lm, describe=describe_lm, strategy=lm_strategy, check=check_moe_lm
    )


__all__ = [
    "CausalSelfAttention",
    "LMConfig",
    "MoETransformerLM",
    "TextBatches",
    "TransformerBlock",
    "build_moe_lm",
    "default_lm_strategy",
    "describe_lm",
    "lm_loss",
    "lm_strategy",
    "load_text_corpus",
    "load_tiny_corpus",
    "register",
    "sample_batch",
]
