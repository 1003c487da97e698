"""M6Model: one transformer over ``[image patches; text prefix; target text]`` with MoE FFNs.

Legend: B batch, C image channels, H/W image height/width, P patches per image, L prefix length,
T target length, S = P + L + T sequence length, D model dim, V vocabulary.

- Image stem: a few 3x3 convs (GELU) keep the resolution, then a patchify conv with kernel =
  stride = ``patch_size`` gives one feature per patch, then a LayerNorm: ``[B, C, H, W] ->
  [B, P, D]``. Without the norm the features' scale grows during training until the patch
  position embeddings are lost next to them (measured on the synthetic dataset: norm ~100 vs ~1
  after 3k steps, and the model did not learn where a shape is).
- Embeddings: text tokens, learned positions (patch positions ``[P, D]``; text positions
  ``[max_text_len, D]`` counted over each sample's real prefix then target tokens, so padding
  never shifts them), and segments (0 image, 1 prefix, 2 target).
- Prefix-LM attention (:func:`prefix_lm_mask`): image and prefix attend to each other both ways;
  target token t sees the whole image and prefix and targets ``<= t``; padding is never attended.
- Pre-norm blocks ``x + attn(norm(x))``, ``x + ffn(norm(x))``; the FFN is a ``MoELayer`` where
  ``config.is_moe_layer(i)``, else dense. MoE layers route only the real (non-padding) tokens.
- Output: logits ``[B, T, V]`` for the target positions only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m6_moe.config import M6Config
from moetrain.layers import MoELayer
from moetrain.layers.experts import DenseFFN

SEGMENT_IMAGE, SEGMENT_PREFIX, SEGMENT_TARGET = 0, 1, 2


def prefix_lm_mask(key_valid_BS: torch.Tensor, target_start: int) -> torch.Tensor:
    """Boolean attention mask ``[B, 1, S, S]`` (True = query q may attend to key k)::

        allowed[b, q, k] = key_valid[b, k] and (k < target_start or target_start <= k <= q)
                           or q == k

    Keys before ``target_start`` (image and prefix) are visible to every query; a target key only
    to target queries at or after it. The diagonal is always allowed so that no row (a padding
    query) is fully masked, which would make softmax produce NaN; padding outputs are ignored."""
    seq = key_valid_BS.shape[1]
    index_S = torch.arange(seq, device=key_valid_BS.device)
    q_S1, k_1S = index_S[:, None], index_S[None, :]
    structure_SS = (k_1S < target_start) | ((k_1S <= q_S1) & (q_S1 >= target_start))
    allowed_BSS = (key_valid_BS[:, None, :] & structure_SS) | (q_S1 == k_1S)
    return allowed_BSS[:, None]


class PatchStem(nn.Module):
    """Pixels ``[B, C, H, W]`` (normalised to about [-1, 1]) -> patch features ``[B, P, D]``."""

    def __init__(self, config: M6Config):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        width = config.image_channels
        for out in config.stem_channels:
            layers += [nn.Conv2d(width, out, kernel_size=3, padding=1), nn.GELU()]
            width = out
        self.convs = nn.Sequential(*layers)
        self.patchify = nn.Conv2d(
            width, config.d_model, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        expected = (cfg.image_channels, cfg.image_size, cfg.image_size)
        if images_BCHW.dim() != 4 or tuple(images_BCHW.shape[1:]) != expected:
            raise ValueError(
                f"images must be [B, {', '.join(map(str, expected))}], got {tuple(images_BCHW.shape)}"
            )
        features_BDhw = self.patchify(self.convs(images_BCHW))
        return self.norm(features_BDhw.flatten(2).transpose(1, 2))


class PrefixLMSelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention`` with a boolean mask."""

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        attn_BHSd = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS, dropout_p=p)
        return self.proj(attn_BHSd.transpose(1, 2).reshape(batch, seq, d_model))


class M6Block(nn.Module):
    """Pre-norm transformer block; the FFN is a MoELayer (``moe=True``) or a dense FFN."""

    def __init__(self, config: M6Config, moe: bool, parallel=None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = PrefixLMSelfAttention(config.d_model, config.num_heads, config.dropout)
        self.ffn_norm = nn.LayerNorm(config.d_model)
        self.is_moe = moe
        if moe:
            self.ffn = MoELayer(config.moe, parallel=parallel)
        else:
            self.ffn = DenseFFN(config.d_model, config.d_ff, config.moe.activation)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x_BSD: torch.Tensor, mask_B1SS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.dropout(self.attn(self.attn_norm(x_BSD), mask_B1SS))
        h_BSD = self.ffn_norm(x_BSD)
        if self.is_moe and h_BSD.device.type == "meta":  # no mask values: route every position (the most)
            y_BSD = self.ffn(h_BSD)
        elif self.is_moe:  # route only real tokens: padding takes no expert capacity, no aux loss
            routed_ND = self.ffn(h_BSD[valid_BS])  # the compute dtype under autocast
            y_BSD = routed_ND.new_zeros(h_BSD.shape).index_put((valid_BS,), routed_ND)
        else:
            y_BSD = self.ffn(h_BSD)
        return x_BSD + self.dropout(y_BSD)


class M6Model(nn.Module):
    """``model(**inputs) -> logits [B, T, V]`` for the target positions. ``parallel``: a
    ``ParallelContext`` for expert parallelism (each MoE layer then holds this rank's experts).

    Builds on the ``meta`` device for parameter counting::

        with torch.device("meta"):
            model = M6Model(M6Config.preset("1T"))
    """

    def __init__(self, config: M6Config, parallel=None):
        super().__init__()
        self.config = config
        self.stem = PatchStem(config)
        self.text_embed = nn.Embedding(config.vocab_size, config.d_model)
        self.patch_pos = nn.Parameter(torch.empty(config.num_patches, config.d_model))
        self.text_pos = nn.Parameter(torch.empty(config.max_text_len, config.d_model))
        self.segment_embed = nn.Embedding(3, config.d_model)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            M6Block(config, config.is_moe_layer(i), parallel) for i in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.head = (
            None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        for weight in (self.text_embed.weight, self.patch_pos, self.text_pos, self.segment_embed.weight):
            nn.init.normal_(weight, std=0.02)

    def forward(
        self,
        prefix_ids: torch.Tensor,
        target_ids: torch.Tensor,
        images: torch.Tensor | None = None,
        prefix_mask: torch.Tensor | None = None,
        target_mask: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Shapes: ``prefix_ids`` [B, L] (L may be 0), ``target_ids`` [B, T] (decoder inputs:
        bos then the target tokens), ``images`` [B, C, H, W] or None (no image in the batch);
        masks are bool, True = real: ``prefix_mask`` [B, L], ``target_mask`` [B, T] (None: all
        real), ``image_mask`` [B] (None: every sample has its image). Returns ``[B, T, V]``."""
        cfg = self.config
        batch, prefix_len = prefix_ids.shape
        target_len = target_ids.shape[1]
        if target_ids.shape[0] != batch or target_len < 1:
            raise ValueError(
                f"target_ids must be [B={batch}, T>=1], got {tuple(target_ids.shape)} (prefix_ids "
                f"{tuple(prefix_ids.shape)})"
            )
        if prefix_len + target_len > cfg.max_text_len:
            raise ValueError(
                f"prefix length {prefix_len} + target length {target_len} exceeds "
                f"max_text_len = {cfg.max_text_len}"
            )
        device = target_ids.device
        prefix_mask_BL = self._mask(prefix_mask, (batch, prefix_len), "prefix_mask", device)
        target_mask_BT = self._mask(target_mask, (batch, target_len), "target_mask", device)

        text_ids_BX = torch.cat([prefix_ids, target_ids], dim=1)
        text_valid_BX = torch.cat([prefix_mask_BL, target_mask_BT], dim=1)
        text_pos_BX = (text_valid_BX.long().cumsum(1) - 1).clamp(0, cfg.max_text_len - 1)
        segments_X = torch.cat(
            [
                torch.full((prefix_len,), SEGMENT_PREFIX, device=device),
                torch.full((target_len,), SEGMENT_TARGET, device=device),
            ]
        )
        x_BXD = self.text_embed(text_ids_BX) + self.text_pos[text_pos_BX] + self.segment_embed(segments_X)
        parts, valid = [x_BXD], [text_valid_BX]
        if images is not None:
            if images.shape[0] != batch:
                raise ValueError(f"images must have B = {batch} rows, got {tuple(images.shape)}")
            image_valid_B = self._mask(image_mask, (batch,), "image_mask", device)
            patches_BPD = self.stem(images) + self.patch_pos + self.segment_embed.weight[SEGMENT_IMAGE]
            parts.insert(0, patches_BPD.to(x_BXD.dtype))
            valid.insert(0, image_valid_B[:, None].expand(batch, cfg.num_patches))
        x_BSD = self.embed_dropout(torch.cat(parts, dim=1))
        valid_BS = torch.cat(valid, dim=1)
        target_start = x_BSD.shape[1] - target_len
        mask_B1SS = prefix_lm_mask(valid_BS, target_start)

        for block in self.blocks:
            x_BSD = block(x_BSD, mask_B1SS, valid_BS)
        h_BTD = self.norm(x_BSD[:, target_start:])
        if self.head is None:
            return F.linear(h_BTD, self.text_embed.weight.to(h_BTD.dtype))
        return self.head(h_BTD)

    @staticmethod
    def _mask(mask, shape: tuple, name: str, device) -> torch.Tensor:
        if mask is None:
            return torch.ones(shape, dtype=torch.bool, device=device)
        if tuple(mask.shape) != shape or mask.dtype != torch.bool:
            raise ValueError(
                f"{name} must be a bool tensor of shape {list(shape)}, got {mask.dtype} {tuple(mask.shape)}"
            )
        return mask


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` counted once each (tied weights once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(config: M6Config) -> int:
    """Parameters one token uses in a forward: everything except the experts it is not routed to,
    ``total - moe_layers * (E - k) * expert_size`` (experts are bias-free ``D x F`` and ``F x D``,
    ``D x 2F`` for SwiGLU), for a model built from ``config`` on the meta device."""
    with torch.device("meta"):
        total = count_parameters(M6Model(config))
    moe = config.moe
    expert = moe.d_model * moe.d_ff * (3 if moe.activation == "swiglu" else 2)
    return total - config.num_moe_layers * (moe.num_experts - moe.top_k) * expert
