"""The planner's view of M6 (the registry's ``describe`` hook): this config's numbers and the
activation facts :mod:`moetrain.planner.activations` needs (full attention under a boolean
prefix-LM mask, dropout, logits for the targets only) and the terms saved outside its layers
(:func:`m6_outside`: token ids, text positions and segments, the image stem, the embedding dropout
mask, the routed-token mask, the final norm)."""

from __future__ import annotations

from m6_moe.config import M6Config
from m6_moe.model import M6Model
from moetrain.planner.activations import Workload, loss_tokens
from moetrain.planner.model import ModelArch, ModelDescription


def m6_outside(arch: ModelArch, work: Workload) -> tuple[dict[str, int], float]:
    """Saved bytes outside M6's layers before the head, and their forward FLOPs (the
    ``ModelArch.outside`` hook). T = B*S tokens (S: image patches + text), T_loss the targets':

    - ``embedding``: token ids and text positions (int64, ``2 * B*seq_len*8``) and the segment ids
      (``seq_len*8``);
    - ``image_stem``: the pixels and each conv's output twice (GELU input and output), ``b`` bytes;
    - ``embedding_dropout``: the dropout mask of the embeddings, ``T*D*m`` (m = 1 on CUDA, b on CPU);
    - ``token_mask``: the boolean mask of routed (real) tokens, T bytes, with MoE layers;
    - ``final_norm``: the final norm reads a slice of the last residual: its whole storage
      ``T*D*b`` is kept, with statistics for the ``T_loss`` tokens normed.

    FLOPs: the stem's 3x3 convolutions and the patch projection."""
    b, kernels, d, batch = work.itemsize, work.kernels, arch.d_model, work.batch
    tokens = batch * (arch.image_tokens + work.seq_len)
    stats = 4 if kernels == "cuda" else b
    text = batch * work.seq_len
    pixels = batch * arch.image_size**2
    stem = pixels * arch.image_channels * b + 2 * pixels * sum(arch.stem_channels) * b
    outside = {
        "embedding": text * 8 * 2 + work.seq_len * 8,  # token ids, text positions, segment ids
        "image_stem": stem if arch.image_tokens else 0,
        "embedding_dropout": tokens * d * (1 if kernels == "cuda" else b) if arch.dropout > 0 else 0,
        "token_mask": tokens if arch.moe_layers else 0,  # bool mask of routed (real) tokens
        # the final norm reads a slice of the last residual tensor: its whole storage is kept
        "final_norm": tokens * d * b + 2 * loss_tokens(arch, work) * stats,
    }
    flops = 0.0
    if arch.image_tokens:
        width = arch.image_channels
        for out in arch.stem_channels:
            flops += 2.0 * pixels * width * out * 9
            width = out
        flops += 2.0 * batch * arch.image_tokens * d * width * arch.patch_size**2
    return outside, flops


def describe_m6(config: M6Config, name: str = "m6") -> ModelDescription:
    """Image patches through a conv stem, a prefix-LM mask, dropout, MoE every ``moe_every``
    layers on real tokens only, logits for the targets."""
    arch = ModelArch(
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
        causal=False,  # a prefix-LM: the whole score matrix, under an explicit boolean mask
        attention_mask=True,
        targets_only=True,  # logits for the target text only
        outside=m6_outside,
    )
    # data.seq_len bounds the prefix and the target each (build_m6 checks that both fit max_text_len)
    return ModelDescription(
        name, arch, config, lambda: M6Model(config),
        seq_len_from_data=lambda n: 2 * n, target_len_from_data=lambda n: n,
    )  # fmt: skip
