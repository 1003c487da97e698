"""The planner's view of M6 (the registry's ``describe`` hook): the ``"m6"`` family of
:mod:`moetrain.planner.activations` with this config's numbers."""

from __future__ import annotations

from m6_moe.config import M6Config
from m6_moe.model import M6Model
from moetrain.planner.model import ModelArch, ModelDescription


def describe_m6(config: M6Config, name: str = "m6") -> ModelDescription:
    """Image patches through a conv stem, a prefix-LM mask, dropout, MoE every ``moe_every``
    layers on real tokens only, logits for the targets."""
    arch = ModelArch(
        family="m6",
        d_model=config.d_model,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        vocab_size=config.vocab_size,
        max_seq_len=config.max_text_len,
        moe=config.moe,
        moe_layers=tuple(i for i in range(config.num_layers) if config.is_moe_layer(i)),
        dense_d_ff=config.d_ff,
        dropout=float(config.dropout),
        image_tokens=config.num_patches,
        image_size=config.image_size,
        image_channels=config.image_channels,
        patch_size=config.patch_size,
        stem_channels=tuple(config.stem_channels),
        tied_head=bool(config.tie_embeddings),
        # the text embedding is the head's too when tied: its gradient then arrives first
        input_modules=("stem", "patch_pos", "text_pos", "segment_embed")
        + (() if config.tie_embeddings else ("text_embed",)),
    )
    # data.seq_len bounds the prefix and the target each (build_m6 checks that both fit max_text_len)
    return ModelDescription(name, arch, config, lambda: M6Model(config), seq_len_from_data=lambda n: 2 * n)
