"""The planner's view of the language model (the registry's ``describe`` hook): its architecture
numbers and activation facts for :mod:`moetrain.planner` (causal attention, logits for every
position, the planner's default terms outside the layers: token ids and the final norm)."""

from __future__ import annotations

from moe_lm.model import LMConfig, MoETransformerLM


def describe_lm(config: LMConfig, name: str = "moe_lm"):
    """The planner's description (:class:`moetrain.planner.model.ModelDescription`) of an
    :class:`LMConfig` model: every layer's FFN a MoELayer, causal attention without a mask, no
    dropout, logits and loss for every position. The planner is imported here, when a plan asks,
    never when a run registers the model."""
    from moetrain.planner.model import ModelArch, ModelDescription

    arch = ModelArch(
        d_model=config.d_model,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        vocab_size=config.vocab_size,
        max_seq_len=config.max_seq_len,
        moe=config.moe,
        moe_layers=tuple(range(config.num_layers)),
        input_modules=("embed", "pos"),
        causal=True,
        attention_mask=False,
        targets_only=False,
    )
    return ModelDescription(name, arch, config, lambda: MoETransformerLM(config))
