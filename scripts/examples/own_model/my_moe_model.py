"""A user's own model, trained, checkpointed and planned by moetrain without editing moetrain.

Importing this module registers the model ``my_moe_classifier`` (a config names it under
``imports:``, see ``config.yaml`` beside this file). The task: a sequence of ``seq_len`` digits in
``[0, vocab)`` is classified by the range its digit sum falls in (``num_classes`` equal ranges of
``[0, seq_len * (vocab - 1)]``); the model embeds the digits, runs one MoE FFN over every position,
pools and classifies.

The three things the registry needs (see moetrain/registry.py):
1. a config dataclass, validated in ``__post_init__``;
2. a builder ``build(train_config, shard) -> (model, batches, loss_fn)``: the model built whole (the
   engine parallelizes it afterwards: the MoE layer becomes ``expert``), the batches seeded from
   ``shard.index`` (this rank's data stream);
3. a batches object: ``next()``, ``probe()``, ``state_dict()`` / ``load_state_dict()`` (the data
   position in checkpoints), ``reseed()``, ``tokens_per_batch`` and a settable ``batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoEConfig, MoELayer
from moetrain.registry import register_model
from moetrain.validation import require_int


@dataclass(frozen=True)
class DigitSumConfig:
    """``vocab`` digits, sequences of ``seq_len``, ``num_classes`` classes; the MoE FFN: ``moe``."""

    vocab: int = 10
    seq_len: int = 8
    num_classes: int = 10
    d_model: int = 32
    moe: MoEConfig = MoEConfig(d_model=32, d_ff=64, num_experts=4, top_k=2)

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "num_classes", "d_model"):
            require_int(name, getattr(self, name), 1)
        if self.moe.d_model != self.d_model:
            raise ValueError(f"moe.d_model must equal d_model = {self.d_model}, got {self.moe.d_model}")


class DigitSumClassifier(nn.Module):
    """digits ``[B, S]`` -> class logits ``[B, num_classes]``."""

    def __init__(self, config: DigitSumConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.position = nn.Parameter(torch.randn(config.seq_len, config.d_model) * 0.02)
        self.norm = nn.LayerNorm(config.d_model)
        self.ffn = MoELayer(config.moe)
        self.head = nn.Linear(config.d_model, config.num_classes)

    def forward(self, digits_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = self.embed(digits_BS) + self.position
        x_BSD = x_BSD + self.ffn(self.norm(x_BSD))
        return self.head(x_BSD.mean(dim=1))


class DigitSumBatches:
    """Random digit sequences and their labels, from a generator seeded per rank; its state is the
    data position saved in checkpoints."""

    def __init__(self, config: DigitSumConfig, batch: int, seed: int, stream: int):
        self.config, self.batch = config, batch
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + stream)

    def _draw(self, count: int, generator: torch.Generator):
        cfg = self.config
        digits = torch.randint(0, cfg.vocab, (count, cfg.seq_len), generator=generator)
        largest = cfg.seq_len * (cfg.vocab - 1)
        return digits, digits.sum(dim=1) * cfg.num_classes // (largest + 1)

    def next(self):
        return self._draw(self.batch, self.generator)

    def probe(self, sequences: int, seed: int):
        return self._draw(sequences, torch.Generator().manual_seed(seed))

    def reseed(self, seed: int, stream: int, step: int) -> None:
        self.generator.manual_seed((seed * 1_000_003 + stream) * 1_000_033 + step)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch * self.config.seq_len

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def build(train_config, shard):
    """The registry builder: (model, batches, loss function); ``shard``: this rank's data stream."""
    config = train_config.model
    model = DigitSumClassifier(config)
    batches = DigitSumBatches(config, train_config.data.micro_batch_size, train_config.seed, shard.index)
    return model, batches, lambda logits, labels: F.cross_entropy(logits.float(), labels)


register_model("my_moe_classifier", DigitSumConfig, build)
