"""The byte-level MoE language model: its config, a small decoder-only transformer whose FFNs are
MoELayers, its default parallel strategy and its loss.

Legend: B batch, S sequence, D model dim, V vocabulary. Pre-norm blocks: ``x + attn(norm(x))`` then
``x + moe(norm(x))``.

The parallel strategy is written twice, in the two forms :func:`moetrain.parallelize` takes, and they
agree (tested): Whale's annotations in the model code (:mod:`moetrain.scope`: ``parallelize(model,
mesh)`` reads them) and the pattern table :func:`default_lm_strategy` (the registry's strategy hook).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import MoEConfig, option
from moetrain.layers import MoELayer
from moetrain.layers.experts import derive_seed
from moetrain.pipeline import keep_layers, stack_layers
from moetrain.scope import pipeline, replica, split
from moetrain.validation import require_int


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = option(256, "token ids [0, vocab_size) (bytes: 256)")
    d_model: int = option(128, "model width")
    num_layers: int = option(2, "transformer blocks, each with an MoE FFN")
    num_heads: int = option(4, "attention heads (divide d_model)")
    max_seq_len: int = option(128, "longest sequence (learned positions)")
    moe: MoEConfig = field(
        default_factory=lambda: MoEConfig(d_model=128, d_ff=256, num_experts=4, top_k=2),
        metadata={"help": "the MoE FFN of every block (d_model inherited)"},
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len"):
            require_int(name, getattr(self, name), 1)
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads must divide d_model = {self.d_model}, got {self.num_heads}")
        if self.moe.d_model != self.d_model:
            raise ValueError(f"moe.d_model must equal d_model = {self.d_model}, got {self.moe.d_model}")


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with separate q / k / v projections (each can be split by
    columns over tensor-parallel ranks, heads staying whole) and an output projection (split by
    rows). The views count heads from the projections' local width: ``heads = width / head_dim``
    (``num_heads / tp_size`` on a tensor-parallel rank)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        with split():  # by columns: whole heads per tensor-parallel rank
            self.q = nn.Linear(d_model, d_model, bias=False)
            self.k = nn.Linear(d_model, d_model, bias=False)
            self.v = nn.Linear(d_model, d_model, bias=False)
        with split("row"):  # by rows: its input arrives sharded, its output is all-reduced
            self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x_BSD.shape
        q, k, v = (
            proj(x_BSD).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        attn_BHSd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attn_BHSd.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config: LMConfig, expert_seed: int | None = None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config.d_model, config.num_heads)
        self.ffn_norm = nn.LayerNorm(config.d_model)
        self.ffn = MoELayer(config.moe, seed=expert_seed)  # expert parallel (an MoE layer's default)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class MoETransformerLM(nn.Module):
    """Token ids ``[B, S]`` -> next-token logits ``[B, S, V]`` (a DTensor sharded over the
    vocabulary when the head is split with ``split.head``). Built without any parallel layout;
    :func:`moetrain.parallelize` applies one (:func:`default_lm_strategy`). ``seed``: the experts'
    initialisation (each layer's from :func:`~moetrain.layers.experts.derive_seed` of ``seed`` and
    its name), so a model built on ``meta`` and materialised has the CPU build's experts."""

    def __init__(self, config: LMConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        with split():  # vocabulary-parallel
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Parameter(torch.empty(config.max_seq_len, config.d_model))
        with pipeline(), replica():  # the stack cut into stages; each block one FSDP unit
            self.blocks = nn.ModuleList(
                TransformerBlock(config, derive_seed(seed, f"blocks.{i}.ffn"))
                for i in range(config.num_layers)
            )
        self.norm = nn.LayerNorm(config.d_model)
        with split("head"):  # logits sharded over the vocabulary, parallel cross-entropy
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The embedding and positions ``N(0, 0.02)`` (the model's own tensors; every submodule
        resets its own)."""
        if self.embed is not None:
            nn.init.normal_(self.embed.weight, std=0.02)
            nn.init.normal_(self.pos, std=0.02)

    def pipeline_stage(self, layers, first: bool, last: bool) -> None:
        """Keeps one pipeline stage (:mod:`moetrain.pipeline`): the blocks ``layers``, the embedding
        and positions when ``first``, the final norm and head when ``last``. Its forward then maps
        token ids ``[B, S]`` (first) or hidden states ``[B, S, D]`` to hidden states or logits."""
        self.blocks = keep_layers(self.blocks, layers)
        if not first:
            self.embed, self.pos = None, None
        if not last:
            self.norm, self.head = None, None

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        seq = tokens_BS.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len = {self.config.max_seq_len}")
        x_BSD = tokens_BS if self.embed is None else self.embed(tokens_BS) + self.pos[:seq]
        for block in stack_layers(self.blocks):
            x_BSD = block(x_BSD)
        return x_BSD if self.head is None else self.head(self.norm(x_BSD))


def default_lm_strategy(config: LMConfig, tp_size: int = 1, pp_size: int = 1) -> dict[str, str]:
    """``moe_lm``'s default strategy: every block's MoE FFN ``expert``; with ``tp_size > 1`` the
    attention's q / k / v ``split`` (by columns: whole heads per rank), its output projection
    ``split.row``, the head ``split.head`` (logits sharded over the vocabulary, parallel
    cross-entropy) and the embedding ``split`` (vocabulary-parallel); with ``pp_size > 1`` the
    block stack ``pipeline``; everything else replicated. The same strategy as the model's
    :mod:`moetrain.scope` marks for that mesh (``strategy_from_scopes(model, parallel)``)."""
    strategy = {"blocks.*.ffn": "expert"}
    if tp_size > 1:
        strategy.update(
            {
                "blocks.*.attn.[qkv]": "split",
                "blocks.*.attn.proj": "split.row",
                "head": "split.head",
                "embed": "split",
            }
        )
    strategy["blocks.*"] = "replica"  # one FSDP unit per block under replica: fsdp
    if pp_size > 1:
        strategy["blocks"] = "pipeline"
    return strategy


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32); ``logits`` may be a vocabulary-sharded DTensor, under
    ``torch.distributed.tensor.parallel.loss_parallel()``."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
