"""M6Model: one transformer over ``[image patches; text prefix; target text]`` with MoE FFNs.

Legend: B batch, C image channels, H/W image height/width, P patches per image, L prefix length,
T target length, S = P + L + T sequence length, D model dim, V vocabulary.

- Image stem: a few 3x3 convs (GELU) keep the resolution, then a patchify conv with kernel =
  stride = ``patch_size`` gives one feature per patch, then a LayerNorm: ``[B, C, H, W] ->
  [B, P, D]``. Without the norm the features' scale grows during training until the patch
  position embeddings are lost next to them (measured on the synthetic dataset: norm ~100 vs ~1
  after 3k steps, and the model did not learn where a shape is).
- Embeddings: text tokens, learned positions (patch positions ``[P, D]``, initialised at the
  patch features' unit scale; text positions ``[max_text_len, D]`` counted over each sample's
  real prefix then target tokens, so padding never shifts them), and segments (0 image, 1
  prefix, 2 target).
- Prefix-LM attention (:func:`prefix_lm_mask`): image and prefix attend to each other both ways;
  target token t sees the whole image and prefix and targets ``<= t``; padding is never attended.
- Pre-norm blocks ``x + attn(norm(x))``, ``x + ffn(norm(x))``; the FFN is a ``MoELayer`` where
  ``config.is_moe_layer(i)``, else dense. MoE layers route only the real (non-padding) tokens.
- Output: logits ``[B, T, V]`` for the target positions only.
- Parallel layout, written in the model as Whale does (:mod:`moetrain.scope`; ``parallelize(model,
  mesh)`` reads it) and as the pattern table :func:`default_m6_strategy` (the registry's hook): the
  two agree (tested).

Decoding with a key/value cache (:meth:`M6Model.start_decoding`, :meth:`M6Model.decode_step`):
image and prefix never attend to targets, so their keys and values are computed once; each new
target token then attends to the cached keys / values of the context and of the targets before
it, and the MoE layers route that token only. With dropless evaluation (``eval_capacity_factor``
None) a token's expert output does not depend on the other tokens, so the logits equal those of
:meth:`M6Model.forward` on the whole sequence (tested, fp32); under a capacity cut they would not,
and the cache is refused.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from m6_moe.config import M6Config
from moetrain.layers import MoELayer
from moetrain.layers.experts import DenseFFN, derive_seed
from moetrain.pipeline import keep_layers, stack_layers
from moetrain.scope import pipeline, replica, split
from moetrain.validation import require_int

SEGMENT_IMAGE, SEGMENT_PREFIX, SEGMENT_TARGET = 0, 1, 2
PATCH_POSITION_STD = 1.0  # the patch features' scale after the stem's LayerNorm (reset_parameters)
TIED_PIPELINE_ERROR = (
    "model.tie_embeddings: true shares the text embedding (first pipeline stage) with the output "
    "projection (last stage), which parallel.pp_size > 1 cannot do: set model.tie_embeddings: false"
)


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


class KVCache:
    """Keys and values of every attention layer for the positions decoded so far, preallocated
    for ``capacity`` positions (legend: N layers, B rows, H heads, S positions, d head dim).

    - ``keys_NBHSd`` / ``values_NBHSd``: positions ``[0, length)`` hold the context (image patches
      then prefix, as :meth:`M6Model.forward` orders them) followed by the target tokens fed so far;
    - ``key_valid_BS``: which cached positions are real (padding is never attended);
    - ``next_text_pos_B``: the text position of each row's next target token (its real prefix
      tokens plus the targets fed so far, as in :meth:`M6Model.forward`).

    Memory: ``2 * N * B * H * S * d`` elements, e.g. 4 layers x 16 rows x 128 wide x 60
    positions = 3.9 MB in fp32 for the tiny preset."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device):
        self.num_layers, self.batch, self.capacity = num_layers, batch, capacity
        self.keys_NBHSd: torch.Tensor | None = None  # allocated by the first append (its dtype)
        self.values_NBHSd: torch.Tensor | None = None
        self.key_valid_BS = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.next_text_pos_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0

    def append(self, layer: int, k_BHsd: torch.Tensor, v_BHsd: torch.Tensor):
        """Writes layer ``layer``'s keys / values of ``s`` new positions after the ``length``
        cached ones; returns that layer's keys and values ``[B, H, length + s, d]``.
        :meth:`advance` moves ``length`` once every layer has appended."""
        end = self.length + k_BHsd.shape[2]
        if end > self.capacity:
            raise ValueError(f"the key/value cache holds {self.capacity} positions, {end} were asked for")
        if self.keys_NBHSd is None:
            batch, heads, _, head_dim = k_BHsd.shape
            shape = (self.num_layers, batch, heads, self.capacity, head_dim)
            self.keys_NBHSd = k_BHsd.new_zeros(shape)
            self.values_NBHSd = v_BHsd.new_zeros(shape)
        self.keys_NBHSd[layer, :, :, self.length : end] = k_BHsd
        self.values_NBHSd[layer, :, :, self.length : end] = v_BHsd
        return self.keys_NBHSd[layer, :, :, :end], self.values_NBHSd[layer, :, :, :end]

    def advance(self, positions: int) -> None:
        self.length += positions

    def reorder(self, rows_R: torch.Tensor) -> None:
        """Keeps row ``rows_R[r]`` of the cache as row ``r`` (``R`` may differ from ``B``: beam
        search repeats each input's rows once per beam, then follows the surviving beams)."""
        if self.keys_NBHSd is not None:
            self.keys_NBHSd = self.keys_NBHSd.index_select(1, rows_R)
            self.values_NBHSd = self.values_NBHSd.index_select(1, rows_R)
        self.batch = rows_R.shape[0]
        self.key_valid_BS = self.key_valid_BS.index_select(0, rows_R)
        self.next_text_pos_B = self.next_text_pos_B.index_select(0, rows_R)


class PrefixLMSelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention`` with a boolean mask.
    With a :class:`KVCache`, the keys / values of the ``S`` input positions are appended to layer
    ``layer``'s cache and the queries attend to every cached position (the mask is then
    ``[B, 1, S, cached + S]``)."""

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        with split():  # by columns: whole heads per tensor-parallel rank
            self.q = nn.Linear(d_model, d_model, bias=False)
            self.k = nn.Linear(d_model, d_model, bias=False)
            self.v = nn.Linear(d_model, d_model, bias=False)
        with split("row"):
            self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x_BSD: torch.Tensor, mask_B1SK: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        """Heads are counted from the projections' width (``num_heads / tp_size`` when q / k / v
        are split by columns over tensor-parallel ranks)."""
        batch, seq, _ = x_BSD.shape
        q, k, v = (
            proj(x_BSD).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        if cache is not None:
            k, v = cache.append(layer, k, v)
        p = self.dropout if self.training else 0.0
        attn_BHSd = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SK, dropout_p=p)
        return self.proj(attn_BHSd.transpose(1, 2).reshape(batch, seq, -1))


class M6Block(nn.Module):
    """Pre-norm transformer block; the FFN is a MoELayer (``moe=True``) or a dense FFN."""

    def __init__(self, config: M6Config, moe: bool, expert_seed: int | None = None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = PrefixLMSelfAttention(config.d_model, config.num_heads, config.dropout)
        self.ffn_norm = nn.LayerNorm(config.d_model)
        self.is_moe = moe
        if moe:
            self.ffn = MoELayer(config.moe, seed=expert_seed)  # expert parallel (an MoE layer's default)
        else:  # Megatron's MLP split; SwiGLU's side-by-side gate and up cannot be: replicated
            swiglu = config.moe.activation == "swiglu"
            with contextlib.nullcontext() if swiglu else split():
                self.ffn = DenseFFN(config.d_model, config.d_ff, config.moe.activation)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x_BSD: torch.Tensor,
        mask_B1SK: torch.Tensor,
        valid_BS: torch.Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """``valid_BS``: the real positions of ``x_BSD`` (None: all real); ``cache`` / ``layer``:
        see :class:`PrefixLMSelfAttention`."""
        x_BSD = x_BSD + self.dropout(self.attn(self.attn_norm(x_BSD), mask_B1SK, cache, layer))
        h_BSD = self.ffn_norm(x_BSD)
        if self.is_moe and valid_BS is not None and h_BSD.device.type != "meta":
            # route only real tokens: padding takes no expert capacity, no aux loss (on meta there
            # are no mask values: every position is routed, the most a batch can take); the
            # sequence-level balance loss balances within each sample's real tokens
            lengths_B = valid_BS.sum(dim=1) if self.ffn.config.seq_aux_loss_coef else None
            routed_ND = self.ffn(h_BSD[valid_BS], sequence_lengths=lengths_B)  # compute dtype under autocast
            y_BSD = routed_ND.new_zeros(h_BSD.shape).index_put((valid_BS,), routed_ND)
        else:
            y_BSD = self.ffn(h_BSD)
        return x_BSD + self.dropout(y_BSD)


class M6Model(nn.Module):
    """``model(**inputs) -> logits [B, T, V]`` for the target positions (a vocabulary-sharded
    DTensor when the head is split with ``split.head``). Built with no knowledge of the parallel
    layout: :func:`moetrain.parallelize` applies one (:func:`default_m6_strategy`). ``seed``: the
    experts' initialisation (each MoE layer's from ``derive_seed(seed, "blocks.<i>.ffn")``), so a
    model built on ``meta`` and materialised has the CPU build's experts.

    Builds on the ``meta`` device for parameter counting::

        with torch.device("meta"):
            model = M6Model(M6Config.preset("1T"))

    Decoding token by token with a key/value cache (eval mode, no gradients)::

        cache = model.start_decoding(prefix_ids, images=images, max_target_len=20)
        logits_BV = model.decode_step(cache, bos_B)  # then decode_step(cache, next_tokens_B) ...
    """

    def __init__(self, config: M6Config, *, seed: int = 0):
        super().__init__()
        self.config = config
        stem = PatchStem(config)
        with replica():  # the image stem, as one FSDP unit (registered here: its layers stay unmarked)
            self.stem = stem
        # tied embeddings: the head is this matrix, and splitting one without the other is not possible
        tied = config.tie_embeddings
        with contextlib.nullcontext() if tied else split():  # vocabulary-parallel
            self.text_embed = nn.Embedding(config.vocab_size, config.d_model)
        self.patch_pos = nn.Parameter(torch.empty(config.num_patches, config.d_model))
        self.text_pos = nn.Parameter(torch.empty(config.max_text_len, config.d_model))
        self.segment_embed = nn.Embedding(3, config.d_model)
        self.embed_dropout = nn.Dropout(config.dropout)
        with pipeline(), replica():  # the stack cut into stages; each block one FSDP unit
            self.blocks = nn.ModuleList(
                M6Block(config, config.is_moe_layer(i), derive_seed(seed, f"blocks.{i}.ffn"))
                for i in range(config.num_layers)
            )
        self.norm = nn.LayerNorm(config.d_model)
        with split("head"):  # vocabulary-sharded logits, parallel cross-entropy
            self.head = None if tied else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The text embedding, text positions and segments ``N(0, 0.02)``; the patch positions
        ``N(0, 1)``, the scale of the patch features they are added to (the stem's LayerNorm
        gives each feature element unit variance): at ``N(0, 0.02)`` they started at 2% of the
        features, and on the demo's data the model learned where a shape is hundreds of steps
        later, at a step that varied with the seed (docs/m6.md). The model's own tensors only:
        every submodule resets its own; a pipeline stage after the first holds none of them."""
        if self.text_embed is None:
            return
        for weight in (self.text_embed.weight, self.text_pos, self.segment_embed.weight):
            nn.init.normal_(weight, std=0.02)
        nn.init.normal_(self.patch_pos, std=PATCH_POSITION_STD)

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
        real), ``image_mask`` [B] (None: every sample has its image). Returns ``[B, T, V]``.

        On a pipeline stage (:meth:`pipeline_stage`) after the first, the three positional inputs
        are the previous stage's outputs ``(x_BSD, valid_BS, target_mask_BT)``; a stage before the
        last returns those for the next."""
        if self.text_embed is None:
            return self._run_blocks(prefix_ids, target_ids, images)
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

        text_valid_BX = torch.cat([prefix_mask_BL, target_mask_BT], dim=1)
        text_pos_BX = (text_valid_BX.long().cumsum(1) - 1).clamp(0, cfg.max_text_len - 1)
        x_BXD = torch.cat(
            [
                self._embed_text(prefix_ids, text_pos_BX[:, :prefix_len], SEGMENT_PREFIX),
                self._embed_text(target_ids, text_pos_BX[:, prefix_len:], SEGMENT_TARGET),
            ],
            dim=1,
        )
        x_BSD, valid_BS = self._prepend_images(x_BXD, text_valid_BX, images, image_mask)
        return self._run_blocks(self.embed_dropout(x_BSD), valid_BS, target_mask_BT)

    def _run_blocks(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor, target_mask_BT: torch.Tensor):
        """The blocks this model holds (all, or a pipeline stage's) over the embedded sequence, the
        targets being its last ``T`` positions; then the logits ``[B, T, V]`` (the model's last
        stage) or ``(x_BSD, valid_BS, target_mask_BT)`` for the next stage."""
        target_start = x_BSD.shape[1] - target_mask_BT.shape[1]
        mask_B1SS = prefix_lm_mask(valid_BS, target_start)
        for block in stack_layers(self.blocks):
            x_BSD = block(x_BSD, mask_B1SS, valid_BS)
        if self.norm is None:
            return x_BSD, valid_BS, target_mask_BT
        return self._logits(x_BSD[:, target_start:])

    def pipeline_stage(self, layers, first: bool, last: bool) -> None:
        """Keeps one pipeline stage (:mod:`moetrain.pipeline`): the blocks ``layers`` (names
        unchanged), the image stem, embeddings and positions when ``first``, the final norm and
        head when ``last``. Between stages travel the hidden states ``x_BSD``, the real positions
        ``valid_BS`` (bool) and ``target_mask_BT`` (its width is the target length; the prefix-LM
        mask is rebuilt from these on every stage). ``tie_embeddings`` is refused: the text
        embedding (first stage) would also be the head (last stage)."""
        if self.config.tie_embeddings:
            raise ValueError(TIED_PIPELINE_ERROR)
        self.blocks = keep_layers(self.blocks, layers)
        if not first:
            self.stem, self.text_embed, self.segment_embed = None, None, None
            self.patch_pos, self.text_pos = None, None
        if not last:
            self.norm, self.head = None, None

    def start_decoding(
        self,
        prefix_ids: torch.Tensor,
        images: torch.Tensor | None = None,
        prefix_mask: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        *,
        max_target_len: int,
    ) -> KVCache:
        """Encodes image and prefix (shapes as in :meth:`forward`) once and returns their
        :class:`KVCache`, with room for ``max_target_len`` target tokens (bos included) fed to
        :meth:`decode_step`. Eval mode only (dropout would make the cache disagree with
        :meth:`forward`); MoE layers must be dropless in eval (``eval_capacity_factor`` None or 0)."""
        cfg = self.config
        if self.training:
            raise ValueError("decoding with a key/value cache needs eval mode: call model.eval() first")
        for block in self.blocks:
            factor = block.ffn.config.eval_capacity_factor if block.is_moe else None
            if factor:  # None and 0 are dropless
                raise ValueError(
                    "decoding with a key/value cache needs dropless MoE evaluation: moe.eval_capacity_factor "
                    f"must be null or 0, got {factor} (or decode without the cache)"
                )
        batch, prefix_len = prefix_ids.shape
        require_int("max_target_len", max_target_len, 1)
        if prefix_len + max_target_len > cfg.max_text_len:
            raise ValueError(
                f"prefix length {prefix_len} + target length {max_target_len} exceeds "
                f"max_text_len = {cfg.max_text_len}"
            )
        device = prefix_ids.device
        prefix_mask_BL = self._mask(prefix_mask, (batch, prefix_len), "prefix_mask", device)
        prefix_pos_BL = (prefix_mask_BL.long().cumsum(1) - 1).clamp(0, cfg.max_text_len - 1)
        x_BLD = self._embed_text(prefix_ids, prefix_pos_BL, SEGMENT_PREFIX)
        x_BCD, valid_BC = self._prepend_images(x_BLD, prefix_mask_BL, images, image_mask)
        context_len = x_BCD.shape[1]
        cache = KVCache(len(self.blocks), batch, context_len + max_target_len, device)
        cache.key_valid_BS[:, :context_len] = valid_BC
        cache.next_text_pos_B = prefix_mask_BL.long().sum(1)
        if context_len > 0:
            mask_B1CC = prefix_lm_mask(valid_BC, context_len)  # the context attends both ways
            for layer, block in enumerate(self.blocks):
                x_BCD = block(x_BCD, mask_B1CC, valid_BC, cache, layer)
            cache.advance(context_len)
        return cache

    def decode_step(self, cache: KVCache, tokens_B: torch.Tensor) -> torch.Tensor:
        """Feeds one target token per row (bos first, then each chosen token) and returns the
        logits ``[B, V]`` for the token after it: the new position attends to every cached one
        (context and earlier targets) and is appended to ``cache``; MoE layers route these ``B``
        tokens only. Eval mode only, as :meth:`start_decoding`."""
        if self.training:
            raise ValueError("decoding with a key/value cache needs eval mode: call model.eval() first")
        if tuple(tokens_B.shape) != (cache.batch,):
            raise ValueError(f"tokens_B must be [B={cache.batch}], got {tuple(tokens_B.shape)}")
        position = cache.length
        if position >= cache.capacity:
            raise ValueError(
                f"the key/value cache holds {cache.capacity} positions, {position + 1} were asked for "
                "(start_decoding's max_target_len is used up)"
            )
        text_pos_B1 = cache.next_text_pos_B.clamp(max=self.config.max_text_len - 1)[:, None]
        x_B1D = self._embed_text(tokens_B[:, None], text_pos_B1, SEGMENT_TARGET)
        cache.key_valid_BS[:, position] = True
        mask_B11K = cache.key_valid_BS[:, None, None, : position + 1]
        for layer, block in enumerate(self.blocks):
            x_B1D = block(x_B1D, mask_B11K, None, cache, layer)
        cache.advance(1)
        cache.next_text_pos_B = cache.next_text_pos_B + 1
        return self._logits(x_B1D)[:, 0]

    def _embed_text(self, ids_BX: torch.Tensor, pos_BX: torch.Tensor, segment: int) -> torch.Tensor:
        """Token + text-position + segment embeddings ``[B, X, D]``."""
        return self.text_embed(ids_BX) + self.text_pos[pos_BX] + self.segment_embed.weight[segment]

    def _prepend_images(self, x_BXD, valid_BX, images, image_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """``[patches; x]`` and its valid mask when ``images`` is given, else ``x`` unchanged."""
        if images is None:
            return x_BXD, valid_BX
        batch = x_BXD.shape[0]
        if images.shape[0] != batch:
            raise ValueError(f"images must have B = {batch} rows, got {tuple(images.shape)}")
        image_valid_B = self._mask(image_mask, (batch,), "image_mask", x_BXD.device)
        patches_BPD = self.stem(images) + self.patch_pos + self.segment_embed.weight[SEGMENT_IMAGE]
        x_BSD = torch.cat([patches_BPD.to(x_BXD.dtype), x_BXD], dim=1)
        patches_valid_BP = image_valid_B[:, None].expand(batch, self.config.num_patches)
        return x_BSD, torch.cat([patches_valid_BP, valid_BX], dim=1)

    def _logits(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h_BTD = self.norm(x_BTD)
        if self.head is None:
            if type(self.text_embed.weight).__name__ == "DTensor":
                raise ValueError(
                    "tie_embeddings: the output projection is the text embedding, which the strategy splits; "
                    "replicate text_embed or set tie_embeddings: false (then split head and embedding apart)"
                )
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


def default_m6_strategy(config: M6Config, tp_size: int = 1, pp_size: int = 1) -> dict[str, str]:
    """M6's default strategy: every MoE FFN ``expert``; with ``tp_size > 1`` the attention's
    q / k / v ``split`` (by columns, whole heads), its output projection ``split.row``, the dense
    FFNs ``split`` (Megatron's MLP), the head ``split.head`` (vocabulary-sharded logits, parallel
    cross-entropy) and the text embedding ``split`` (vocabulary-parallel); the image stem and
    everything else replicated. With ``tie_embeddings`` the head is the embedding matrix: both
    stay replicated (splitting one without the other is not possible). With ``pp_size > 1`` the
    block stack ``pipeline`` (:meth:`M6Model.pipeline_stage`). The same strategy as the model's
    :mod:`moetrain.scope` marks for that mesh (``strategy_from_scopes(model, parallel)``)."""
    moe = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    strategy = {f"blocks.{i}.ffn": "expert" for i in moe}
    if tp_size > 1:
        strategy.update({"blocks.*.attn.[qkv]": "split", "blocks.*.attn.proj": "split.row"})
        if config.moe.activation != "swiglu":
            strategy.update({f"blocks.{i}.ffn": "split" for i in dense})
        if not config.tie_embeddings:
            strategy.update({"head": "split.head", "text_embed": "split"})
    strategy.update({"stem": "replica", "blocks.*": "replica"})  # FSDP units under replica: fsdp
    if pp_size > 1:
        strategy["blocks"] = "pipeline"
    return strategy


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` counted once each (tied weights once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(config: M6Config) -> int:
    """Parameters one token uses in a forward: everything except the experts it is not routed to,
    ``total - moe_layers * (E - k) * expert_size`` (an expert is ``D x F`` and ``F x D``, ``D x 2F``
    for SwiGLU, plus its ``F + D`` biases with ``expert_bias``; ``2F + D`` for SwiGLU), for a model
    built from ``config`` on the meta device."""
    with torch.device("meta"):
        total = count_parameters(M6Model(config))
    moe = config.moe
    inner = moe.d_ff * (2 if moe.activation == "swiglu" else 1)
    expert = moe.d_model * (inner + moe.d_ff) + (inner + moe.d_model if moe.expert_bias else 0)
    return total - config.num_moe_layers * (moe.num_experts - moe.top_k) * expert
