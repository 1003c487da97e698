"""Models written with Whale's annotations (:mod:`moetrain.scope`), for the scope tests.

- :class:`StagedLM`: the byte-level LM with its blocks appended under ``scope.stage(i)`` (the
  pipeline's cut points in the model code). Importing this module registers it as ``staged_lm`` (a
  config's ``imports: [tests.helpers.scoped_lm]``); its registry entry has no strategy hook, so a run applies
  the scopes' marks.
- :func:`auto_lm`: the LM's modules with no scope inside, built under ``set_default("auto")``: the
  planner decides every unit. Registered as ``auto_lm`` (its describe hook is the LM's), for
  ``moetrain train`` with ``parallel.auto_gpu``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import nn

from moe_lm import (
    CausalSelfAttention,
    LMConfig,
    MoETransformerLM,
    TextBatches,
    TransformerBlock,
    lm_loss,
    load_text_corpus,
)
from moetrain import MoEConfig, scope
from moetrain.layers import MoELayer
from moetrain.layers.experts import derive_seed
from moetrain.registry import register_model


class StagedLM(MoETransformerLM):
    """The LM (same modules, same initialisation order, so the same weights from the same seed) with
    layer ``i`` in pipeline stage ``stage_of[i]``."""

    def __init__(self, config: LMConfig, stage_of, seed: int = 0):
        nn.Module.__init__(self)
        self.config = config
        with scope.split():
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Parameter(torch.empty(config.max_seq_len, config.d_model))
        self.blocks = nn.ModuleList()
        for i in range(config.num_layers):
            with scope.stage(stage_of[i]), scope.replica():
                self.blocks.append(TransformerBlock(config, derive_seed(seed, f"blocks.{i}.ffn")))
        self.norm = nn.LayerNorm(config.d_model)
        with scope.split("head"):
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()


class AutoAttention(CausalSelfAttention):
    def __init__(self, d_model: int, num_heads: int):
        nn.Module.__init__(self)
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))


class AutoBlock(TransformerBlock):
    def __init__(self, config: LMConfig, expert_seed: int):
        nn.Module.__init__(self)
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = AutoAttention(config.d_model, config.num_heads)
        self.ffn_norm = nn.LayerNorm(config.d_model)
        self.ffn = MoELayer(config.moe, seed=expert_seed)


class AutoLM(MoETransformerLM):
    """The LM's modules (names, types, initialisation order) with no scope of their own."""

    def __init__(self, config: LMConfig, seed: int = 0):
        nn.Module.__init__(self)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Parameter(torch.empty(config.max_seq_len, config.d_model))
        self.blocks = nn.ModuleList(
            AutoBlock(config, derive_seed(seed, f"blocks.{i}.ffn")) for i in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()


def auto_lm(config: LMConfig, seed: int = 0, default_scope: str = "auto") -> AutoLM:
    """:class:`AutoLM` built under ``scope.set_default(default_scope)``."""
    with scope.set_default(default_scope):
        return AutoLM(config, seed)


@dataclass(frozen=True)
class SmallLMKeys:
    """:class:`LMConfig`'s keys with small defaults, the base of the scoped models' configs."""

    vocab_size: int = 256
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 2
    max_seq_len: int = 16
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2))

    def lm(self) -> LMConfig:
        return LMConfig(**{f.name: getattr(self, f.name) for f in fields(LMConfig)})


def _text_run(model: nn.Module, config, shard):
    """``(model, batches, loss)`` of a registry builder: the config's text corpus, this shard's batches."""
    corpus = load_text_corpus(config.data.source, config.data.seq_len + 1)
    batches = TextBatches(corpus, config.data.micro_batch_size, config.data.seq_len, config.seed, shard.index)
    return model, batches, lm_loss


@dataclass(frozen=True)
class StagedLMConfig(SmallLMKeys):
    """:class:`LMConfig`'s keys and ``stages``: each layer's pipeline stage."""

    stages: tuple = (0, 1)


def build_staged_lm(config, shard):
    return _text_run(StagedLM(config.model.lm(), config.model.stages, seed=config.seed), config, shard)


register_model("staged_lm", StagedLMConfig, build_staged_lm)


@dataclass(frozen=True)
class AutoLMConfig(SmallLMKeys):
    """:class:`LMConfig`'s keys and ``default_scope``, the scope the model is built under (so its
    fields are not the LM's alone: a run directory's config names no model, and tools tell models
    apart by their fields), for :func:`auto_lm` registered as ``auto_lm``."""

    default_scope: str = "auto"


def build_auto_lm(config, shard):
    model = auto_lm(config.model.lm(), seed=config.seed, default_scope=config.model.default_scope)
    return _text_run(model, config, shard)


def describe_auto_lm(config: AutoLMConfig, name: str):
    import dataclasses

    from moe_lm import describe_lm

    build = lambda: auto_lm(config.lm(), default_scope=config.default_scope)  # noqa: E731
    return dataclasses.replace(describe_lm(config.lm(), name), build=build)


register_model("auto_lm", AutoLMConfig, build_auto_lm, describe=describe_auto_lm)
