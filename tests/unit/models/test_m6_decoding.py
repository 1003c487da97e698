"""M6 decoding with the key/value cache against the full recompute, and generation prefixes."""

from __future__ import annotations

import pytest
import torch

from m6_moe.config import M6Config
from m6_moe.generate import beam_search, build_context, check_new_tokens, generate, greedy_search, sample
from m6_moe.model import M6Model
from m6_moe.tokenizer import ByteTokenizer, encode_prefix
from moetrain.layers import MoELayer

TOKENIZER = ByteTokenizer()


def decoding_config(**overrides) -> M6Config:
    """Small and fast; MoE in every layer (top-2 over 2 prototypes), dropless in eval."""
    options = {
        "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "max_text_len": 40, "image_size": 16,
        "patch_size": 8, "stem_channels": (8,), "moe_every": 1,
        "moe": {"d_ff": 64, "num_experts": 4, "top_k": 2, "num_prototypes": 2, "eval_capacity_factor": None},
    }  # fmt: skip
    options.update(overrides)
    return M6Config(**options)


@pytest.fixture(scope="module")
def model() -> M6Model:
    torch.manual_seed(0)
    return M6Model(decoding_config()).eval()


def padded_batch(config: M6Config, generator: torch.Generator) -> dict:
    """3 rows: prefixes of 5, 3 and 0 real tokens (padding on the right), the second row without
    its image."""
    prefix_ids = torch.randint(0, 256, (3, 5), generator=generator)
    prefix_mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [False] * 5])
    images = torch.rand(3, 3, config.image_size, config.image_size, generator=generator) * 2 - 1
    return {
        "prefix_ids": prefix_ids,
        "prefix_mask": prefix_mask,
        "images": images,
        "image_mask": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("with_images", [True, False])
def test_cached_logits_equal_the_full_forward(model, with_images):
    """Teacher forcing 7 target tokens one at a time through the cache gives the full forward's
    logits at every position (fp32), with padded prefixes and a missing image."""
    g = torch.Generator().manual_seed(1)
    context = padded_batch(model.config, g)
    if not with_images:
        context = {k: context[k] for k in ("prefix_ids", "prefix_mask")}
    target_ids = torch.randint(0, TOKENIZER.vocab_size, (3, 7), generator=g)
    with torch.no_grad():
        full_BTV = model(target_ids=target_ids, **context)
        cache = model.start_decoding(**context, max_target_len=7)
        steps_BTV = torch.stack([model.decode_step(cache, target_ids[:, t]) for t in range(7)], dim=1)
    torch.testing.assert_close(steps_BTV, full_BTV, rtol=1e-5, atol=1e-5)
    assert full_BTV.std() > 0.1  # not trivially equal


def test_reordered_cache_continues_each_row(model):
    """After ``reorder`` (what beam search does), every row decodes as the row it was copied from."""
    g = torch.Generator().manual_seed(2)
    context = padded_batch(model.config, g)
    target_ids = torch.randint(0, 256, (3, 4), generator=g)
    rows = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        cache = model.start_decoding(**context, max_target_len=4)
        for t in range(2):
            model.decode_step(cache, target_ids[:, t])
        cache.reorder(rows)
        last = [model.decode_step(cache, target_ids[rows, t]) for t in range(2, 4)][-1]
        full = model(target_ids=target_ids[rows], **{k: v[rows] for k, v in context.items()})[:, -1]
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)


def test_moe_layers_route_only_the_new_token(model):
    g = torch.Generator().manual_seed(3)
    context = padded_batch(model.config, g)
    with torch.no_grad():
        cache = model.start_decoding(**context, max_target_len=2)
        model.decode_step(cache, torch.full((3,), TOKENIZER.bos_id))
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2
    top_k = model.config.moe.top_k
    assert all(int(layer.last_stats.routed_per_expert.sum()) == 3 * top_k for layer in layers)


@pytest.mark.parametrize(
    "config_overrides",
    [{}, {"moe_every": 2, "tie_embeddings": False}],
    ids=["moe-every-layer", "dense-and-moe-untied"],
)
def test_generation_is_identical_with_and_without_cache(config_overrides):
    torch.manual_seed(4)
    model = M6Model(decoding_config(**config_overrides)).eval()
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    context = build_context(model, TOKENIZER, images=images, prefixes=["a red", "左边", ""])
    greedy = [greedy_search(model, TOKENIZER, context, 12, use_cache=c) for c in (True, False)]
    beam = [beam_search(model, TOKENIZER, context, 12, num_beams=3, use_cache=c) for c in (True, False)]
    drawn = [
        sample(model, TOKENIZER, context, 12, top_k=20, temperature=1.5,
               generator=torch.Generator().manual_seed(7), use_cache=c)
        for c in (True, False)
    ]  # fmt: skip
    assert greedy[0] == greedy[1] and beam[0] == beam[1] and drawn[0] == drawn[1]
    assert all(len(tokens) == 12 for tokens in greedy[0])  # random weights: no early eos, 12 steps compared
    assert beam[0] != greedy[0] or drawn[0] != greedy[0]  # the strategies differ: the test compares something


def test_cache_is_refused_in_training_mode_and_under_a_capacity_cut():
    torch.manual_seed(0)
    capped = M6Model(
        decoding_config(moe={"d_ff": 64, "num_experts": 4, "top_k": 2, "eval_capacity_factor": 1.0})
    ).eval()
    context = build_context(capped, TOKENIZER, prefixes=["ab"])
    with pytest.raises(
        ValueError, match="needs dropless MoE evaluation: moe.eval_capacity_factor must be null"
    ):
        greedy_search(capped, TOKENIZER, context, 3)
    assert len(greedy_search(capped, TOKENIZER, context, 3, use_cache=False)[0]) <= 3
    with pytest.raises(ValueError, match="needs eval mode"):
        capped.train().start_decoding(context["prefix_ids"], max_target_len=2)


def test_the_cache_takes_eval_capacity_factor_0_which_is_dropless():
    torch.manual_seed(0)
    dropless = M6Model(
        decoding_config(moe={"d_ff": 64, "num_experts": 4, "top_k": 2, "eval_capacity_factor": 0})
    ).eval()
    context = build_context(dropless, TOKENIZER, prefixes=["ab", "c"])
    cached = greedy_search(dropless, TOKENIZER, context, 5)
    assert cached == greedy_search(dropless, TOKENIZER, context, 5, use_cache=False)


def test_cache_bounds_and_shapes(model):
    context = build_context(model, TOKENIZER, prefixes=["abc"])
    with torch.no_grad():
        cache = model.start_decoding(**context, max_target_len=1)
        model.decode_step(cache, torch.tensor([TOKENIZER.bos_id]))
        with pytest.raises(ValueError, match="the key/value cache holds 4 positions, 5 were asked for"):
            model.decode_step(cache, torch.tensor([65]))
        with pytest.raises(ValueError, match=r"tokens_B must be \[B=1\]"):
            model.decode_step(cache, torch.tensor([65, 66]))
        with pytest.raises(
            ValueError, match="prefix length 3 \\+ target length 38 exceeds max_text_len = 40"
        ):
            model.start_decoding(**context, max_target_len=38)


def test_new_tokens_must_fit_after_the_prefix(model):
    check_new_tokens(model.config, 30, 10)  # 30 + 10 = max_text_len 40: fits exactly
    with pytest.raises(ValueError, match="max_text_len = 40 leaves room for 10 new tokens"):
        check_new_tokens(model.config, 30, 11)
    with pytest.raises(ValueError, match="a prefix of 40 tokens leaves no room for new tokens"):
        generate(model, TOKENIZER, prefixes=["x" * 40], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        check_new_tokens(model.config, 0, 0)
    # exactly full: 39 prefix tokens + bos = 40 positions, one new token
    assert len(generate(model, TOKENIZER, prefixes=["x" * 39], max_new_tokens=1)) == 1


# ------------------------------------------------------------------------------------ prefixes
def test_prefix_sentinels_become_sentinel_ids():
    sentinels = TOKENIZER.sentinel_ids
    assert encode_prefix(TOKENIZER, "a <extra_id_0> c<extra_id_15>") == [
        97, 32, sentinels[0], 32, 99, sentinels[15]
    ]  # fmt: skip
    assert encode_prefix(TOKENIZER, "左边") == list("左边".encode())
    assert encode_prefix(TOKENIZER, "") == []
    with pytest.raises(ValueError, match="<extra_id_16> is not a sentinel of the tokenizer"):
        encode_prefix(TOKENIZER, "a <extra_id_16>")


def test_prefix_that_is_not_unicode_text_is_refused():
    # what Python makes of a non-UTF-8 command-line argument (surrogateescape)
    argument = b"caf\xe9".decode("utf-8", errors="surrogateescape")
    with pytest.raises(ValueError, match="is not valid Unicode text \\(character 3 cannot be encoded"):
        encode_prefix(TOKENIZER, argument)


class LowercasingTokenizer(ByteTokenizer):
    """Stands in for a WordPiece-like tokenizer that lowercases and maps unknown characters to one
    unknown id (255 here)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) if ord(c) < 128 else 255 for c in text.lower()]

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join("[UNK]" if i == 255 else chr(i) for i in ids if i < 256)


def test_prefix_the_tokenizer_cannot_represent_is_refused(model):
    tokenizer = LowercasingTokenizer()
    assert encode_prefix(tokenizer, "a red") == [97, 32, 114, 101, 100]
    with pytest.raises(ValueError, match=r"prefix 'A red': the tokenizer cannot represent it faithfully "
                                         r"\(its 5 tokens decode to 'a red'\)"):  # fmt: skip
        encode_prefix(tokenizer, "A red")
    with pytest.raises(ValueError, match=r"decode to '\[UNK\]\[UNK\]'"):
        generate(model, tokenizer, prefixes=["左边"], max_new_tokens=2)
