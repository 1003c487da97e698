"""M6 model: shapes, the prefix-LM mask, training, presets on the meta device, generation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from m6_moe import build_m6
from m6_moe.config import (
    PRESET_PARAMETER_TARGETS,
    PRESET_PARAMETER_TOLERANCE,
    PRESETS,
    M6Config,
    M6TaskConfig,
)
from m6_moe.evaluate import evaluate_captioning
from m6_moe.generate import (
    beam_search,
    build_context,
    filter_logits,
    generate,
    greedy_search,
    sample,
    sampling_probs,
)
from m6_moe.model import M6Model, count_active_parameters, count_parameters, prefix_lm_mask
from m6_moe.synthetic import write_synthetic_dataset
from m6_moe.tasks import m6_loss
from m6_moe.tokenizer import ByteTokenizer
from moetrain.config import DataConfig, TrainConfig, config_from_dict
from moetrain.layers import MoELayer
from moetrain.layers.losses import sequence_balance_loss
from moetrain.registry import DataShard
from tests.helpers.paths import ROOT

TOKENIZER = ByteTokenizer()


def small_config(**overrides) -> M6Config:
    """A fast model: 2 layers of width 32, the second one MoE with 2 top-1 prototypes."""
    options = {
        "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "max_text_len": 48, "image_size": 16,
        "patch_size": 8, "stem_channels": (8,), "moe_every": 2,
        "moe": {"d_ff": 64, "num_experts": 4, "top_k": 2, "num_prototypes": 2, "eval_capacity_factor": None},
    }  # fmt: skip
    options.update(overrides)
    return M6Config(**options)


def random_inputs(config: M6Config, batch=3, prefix=5, target=6, generator=None) -> dict:
    g = generator or torch.Generator().manual_seed(1)
    return {
        "prefix_ids": torch.randint(0, 256, (batch, prefix), generator=g),
        "target_ids": torch.randint(0, 256, (batch, target), generator=g),
        "images": torch.rand(batch, config.image_channels, config.image_size, config.image_size, generator=g)
        * 2
        - 1,
    }


@pytest.fixture(scope="module")
def model() -> M6Model:
    torch.manual_seed(0)
    return M6Model(small_config()).eval()


# ----------------------------------------------------------------------------------------- shapes
def test_output_shapes_with_and_without_images(model):
    cfg = model.config
    inputs = random_inputs(cfg)
    assert model(**inputs).shape == (3, 6, cfg.vocab_size)
    no_image = {k: v for k, v in inputs.items() if k != "images"}
    assert model(**no_image).shape == (3, 6, cfg.vocab_size)
    empty_prefix = dict(inputs, prefix_ids=torch.empty(3, 0, dtype=torch.long))
    assert model(**empty_prefix).shape == (3, 6, cfg.vocab_size)


def test_patch_stem_shape_and_bad_image_shape(model):
    cfg = model.config
    assert model.stem(torch.zeros(2, 3, 16, 16)).shape == (2, cfg.num_patches, cfg.d_model)
    with pytest.raises(ValueError, match=r"images must be \[B, 3, 16, 16\]"):
        model.stem(torch.zeros(2, 3, 8, 8))


def test_text_longer_than_max_text_len_is_rejected(model):
    inputs = random_inputs(model.config, prefix=40, target=9)
    with pytest.raises(ValueError, match="max_text_len = 48"):
        model(**inputs)


def test_moe_every_places_moe_layers():
    config = small_config(num_layers=4, moe_every=2)
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert [small_config(moe_every=1).is_moe_layer(i) for i in range(2)] == [True, True]
    assert small_config(moe_every=0).num_moe_layers == 0
    model = M6Model(config)
    assert [isinstance(block.ffn, MoELayer) for block in model.blocks] == [False, True, False, True]


# ------------------------------------------------------------------------------- prefix-LM mask
def test_prefix_lm_mask_structure():
    # one image patch, two prefix tokens (second is padding), three target tokens
    valid = torch.tensor([[True, True, False, True, True, True]])
    mask = prefix_lm_mask(valid, target_start=3)[0, 0].int().tolist()
    assert mask == [
        [1, 1, 0, 0, 0, 0],  # image sees image + real prefix
        [1, 1, 0, 0, 0, 0],  # prefix sees image + real prefix (both ways)
        [1, 1, 1, 0, 0, 0],  # padding query: only real keys, plus itself
        [1, 1, 0, 1, 0, 0],  # target 0: prefix + itself
        [1, 1, 0, 1, 1, 0],
        [1, 1, 0, 1, 1, 1],
    ]


def test_later_target_token_does_not_change_earlier_logits(model):
    inputs = random_inputs(model.config)
    changed = dict(inputs, target_ids=inputs["target_ids"].clone())
    changed["target_ids"][:, 3] = (changed["target_ids"][:, 3] + 7) % 256
    with torch.no_grad():
        before, after = model(**inputs), model(**changed)
    torch.testing.assert_close(before[:, :3], after[:, :3], rtol=0, atol=1e-6)
    assert (before[:, 3:] - after[:, 3:]).abs().amax() > 1e-4


def _block_outputs(model, inputs) -> torch.Tensor:
    captured = []
    handle = model.blocks[-1].register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return captured[0]


def test_prefix_and_image_attend_both_ways_but_not_to_targets(model):
    cfg = model.config
    patches = cfg.num_patches
    inputs = random_inputs(cfg)
    hidden = _block_outputs(model, inputs)
    later_prefix = dict(inputs, prefix_ids=inputs["prefix_ids"].clone())
    later_prefix["prefix_ids"][:, -1] = (later_prefix["prefix_ids"][:, -1] + 1) % 256
    hidden_prefix = _block_outputs(model, later_prefix)
    # the first prefix token and the image patches see the last prefix token
    assert (hidden[:, patches] - hidden_prefix[:, patches]).abs().amax() > 1e-4
    assert (hidden[:, :patches] - hidden_prefix[:, :patches]).abs().amax() > 1e-4
    # ... and the last prefix token sees the first image patch
    changed_image = dict(inputs, images=inputs["images"].clone())
    changed_image["images"][:, :, :8, :8] = -inputs["images"][:, :, :8, :8]
    hidden_image = _block_outputs(model, changed_image)
    assert (hidden[:, patches + 4] - hidden_image[:, patches + 4]).abs().amax() > 1e-4
    # a target token is invisible to every image and prefix position
    later_target = dict(inputs, target_ids=(inputs["target_ids"] + 1) % 256)
    hidden_target = _block_outputs(model, later_target)
    prefix_end = patches + inputs["prefix_ids"].shape[1]
    torch.testing.assert_close(hidden[:, :prefix_end], hidden_target[:, :prefix_end], rtol=0, atol=1e-6)


def test_padding_changes_nothing(model):
    """A sample alone equals the same sample padded inside a batch: prefix padding, target
    padding and a missing image are never attended, and text positions ignore padding."""
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    image = torch.rand(1, 3, 16, 16, generator=g)
    prefix, target = torch.randint(0, 256, (1, 3), generator=g), torch.randint(0, 256, (1, 4), generator=g)
    with torch.no_grad():
        alone = model(prefix_ids=prefix, target_ids=target, images=image)
        padded = model(
            prefix_ids=torch.cat(
                [torch.cat([prefix, torch.full((1, 2), 99)], 1), torch.randint(0, 256, (1, 5))]
            ),
            prefix_mask=torch.tensor([[True] * 3 + [False] * 2, [True] * 5]),
            target_ids=torch.cat(
                [torch.cat([target, torch.full((1, 3), 77)], 1), torch.randint(0, 256, (1, 7))]
            ),
            target_mask=torch.tensor([[True] * 4 + [False] * 3, [True] * 7]),
            images=torch.cat([image, torch.rand(1, 3, 16, 16)]),
            image_mask=torch.tensor([True, True]),
        )
        text_only = model(prefix_ids=prefix, target_ids=target)
        masked_image = model(
            prefix_ids=prefix,
            target_ids=target,
            images=torch.rand(1, 3, 16, 16),
            image_mask=torch.tensor([False]),
        )
    torch.testing.assert_close(padded[:1, :4], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked_image, text_only, rtol=1e-5, atol=1e-5)
    assert cfg.moe.eval_capacity_factor is None  # the equality above relies on dropless eval


# ----------------------------------------------------------------------------------- training
def test_tiny_preset_trains_and_loss_drops(tmp_path):
    """build_m6 on the embedded dataset with the tiny preset, driven like the engine: 25 steps on
    one batch must cut its loss, then fresh batches flow through."""
    config = TrainConfig(
        model=M6Config.preset("tiny"),
        data=DataConfig(source="embedded", micro_batch_size=8, seq_len=40),
        out_dir=str(tmp_path),
    )
    torch.manual_seed(0)
    model, batches, loss_fn = build_m6(config, DataShard())
    assert (tmp_path / "data" / "train.jsonl").is_file()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, labels = batches.next()
    losses = []
    for _ in range(25):  # one fixed batch: the loss must fall quickly
        loss = loss_fn(model(**inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
    for _ in range(3):  # fresh batches flow through too
        inputs, labels = batches.next()
        assert torch.isfinite(loss_fn(model(**inputs), labels))
    assert sum(batches.task_counts.values()) == 8 * 4


def test_build_m6_checks_lengths_and_vocab(tmp_path):
    base = {"model": M6Config.preset("tiny"), "out_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=r"data.seq_len = 65 .* model.max_text_len = 128"):
        build_m6(TrainConfig(**base, data=DataConfig(seq_len=65)), DataShard())
    small_vocab = M6Config(vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size = 100 is smaller"):
        build_m6(
            TrainConfig(model=small_vocab, out_dir=str(tmp_path), data=DataConfig(seq_len=32)), DataShard()
        )


def test_loss_ignores_padding():
    logits = torch.randn(2, 3, 10)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    expected = torch.nn.functional.cross_entropy(logits[[0, 0, 1], [0, 1, 0]], torch.tensor([1, 2, 3]))
    torch.testing.assert_close(m6_loss(logits, labels), expected)


def test_sequence_level_balance_loss_balances_each_samples_real_tokens():
    """M6 routes the real tokens of a padded batch flattened: the layer gets each sample's count of
    real tokens (image patches + real prefix + real target), and its sequence-level loss equals the
    per-sample loss averaged over the samples."""
    moe = {"d_ff": 64, "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.0, "seq_aux_loss_coef": 0.1}
    torch.manual_seed(0)
    model = M6Model(small_config(moe=moe))
    cfg = model.config
    inputs = random_inputs(cfg, batch=3, prefix=5, target=6)
    inputs["prefix_mask"] = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    inputs["target_mask"] = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] + [False] * 5])
    inputs["image_mask"] = torch.tensor([True, False, True])
    layer = model.blocks[1].ffn
    seen = {}
    layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    layer.router.register_forward_hook(lambda m, args, out: seen.update(routing=out))
    logits = model(**inputs)
    patches = cfg.num_patches
    assert seen["sequence_lengths"].tolist() == [patches + 5 + 6, 2 + 4, patches + 0 + 1]
    probs, ids = seen["routing"].probs_TE, seen["routing"].expert_ids_TK
    per_sample, start = [], 0
    for n in seen["sequence_lengths"].tolist():
        per_sample.append(sequence_balance_loss(probs[start : start + n], ids[start : start + n], n))
        start += n
    assert start == probs.shape[0]
    torch.testing.assert_close(layer.last_stats.aux_loss, 0.1 * sum(per_sample).detach() / 3)
    logits.float().pow(2).mean().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_and_matches_published_size(name):
    config = M6Config.preset(name)
    with torch.device("meta"):
        model = M6Model(config)
    total = count_parameters(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    if name in PRESET_PARAMETER_TARGETS:
        target, source = PRESET_PARAMETER_TARGETS[name]
        assert abs(total / target - 1) <= PRESET_PARAMETER_TOLERANCE, (name, total, target, source)
    if config.num_moe_layers:
        assert count_active_parameters(config) < total
    else:
        assert count_active_parameters(config) == total


@pytest.mark.parametrize("moe", [{}, {"expert_bias": True}, {"activation": "swiglu", "expert_bias": True}])
def test_active_parameters_leave_out_the_unrouted_experts_whole(moe):
    """Counted from the built model: every expert parameter (weights and biases) of the E - k
    experts a token is not routed to, in every MoE layer."""
    base = M6Config.preset("tiny")
    config = dataclasses.replace(base, moe=dataclasses.replace(base.moe, **moe))
    with torch.device("meta"):
        model = M6Model(config)
    layers = [block.ffn for block in model.blocks if block.is_moe]
    per_expert = sum(p[0].numel() for p in layers[0].experts.parameters())
    unrouted = len(layers) * (config.moe.num_experts - config.moe.top_k) * per_expert
    assert count_active_parameters(config) == count_parameters(model) - unrouted


def test_tiny_preset_uses_expert_prototyping():
    """M6-T's "k top-1": 4 experts in 2 groups of 2, each token picks its top-1 in each group."""
    moe = M6Config.preset("tiny").moe
    assert (moe.num_experts, moe.num_prototypes, moe.top_k) == (4, 2, 2)
    layer = MoELayer(moe)
    routing = layer.router(torch.randn(64, moe.d_model))
    assert bool((routing.expert_ids_TK[:, 0] < 2).all()) and bool((routing.expert_ids_TK[:, 1] >= 2).all())


def test_config_errors_name_field_and_allowed_values():
    with pytest.raises(ValueError, match="preset must be one of 'tiny', 'base', '10B', '100B', '1T'"):
        M6Config.preset("huge")
    with pytest.raises(ValueError, match="patch_size must divide image_size = 32"):
        M6Config(patch_size=5)
    with pytest.raises(ValueError, match="moe_every must be an integer >= 0"):
        M6Config(moe_every=-1)
    with pytest.raises(ValueError, match="moe.d_model must equal d_model = 64"):
        M6Config(d_model=64)
    with pytest.raises(ValueError, match="image_channels must be one of 1, 3"):
        M6Config(image_channels=4)
    with pytest.raises(ValueError, match="tasks.noise_density must be a number in"):
        M6TaskConfig(noise_density=1.5)
    with pytest.raises(ValueError, match="tokenizer must be 'bytes'"):
        M6Config(tokenizer="vocab.txt")


def test_config_from_yaml_dict_fills_moe_d_model():
    config = config_from_dict(
        M6Config,
        {"d_model": 64, "num_heads": 4, "stem_channels": [8, 8], "moe": {"d_ff": 128, "num_experts": 4},
         "tasks": {"denoise_weight": 0}},
    )  # fmt: skip
    assert config.moe.d_model == 64 and config.stem_channels == (8, 8) and config.tasks.denoise_weight == 0
    with pytest.raises(ValueError, match=r"moe\.top_k must satisfy"):
        config_from_dict(M6Config, {"moe": {"d_ff": 8, "num_experts": 2, "top_k": 3}})


# --------------------------------------------------------------------------------- generation
def test_greedy_equals_beam_one_and_top_k_one(model):
    context = build_context(model, TOKENIZER, images=torch.rand(3, 3, 16, 16), prefixes=["a", "左边", ""])
    greedy = greedy_search(model, TOKENIZER, context, max_new_tokens=8)
    assert greedy == beam_search(model, TOKENIZER, context, max_new_tokens=8, num_beams=1)
    g = torch.Generator().manual_seed(0)
    assert greedy == sample(model, TOKENIZER, context, max_new_tokens=8, top_k=1, generator=g)
    assert greedy == sample(model, TOKENIZER, context, max_new_tokens=8, top_p=1e-6, generator=g)
    assert all(len(tokens) <= 8 for tokens in greedy)
    assert model.training is False


def test_batched_generation_equals_one_by_one(model):
    images = torch.rand(2, 3, 16, 16)
    prefixes = ["red", "一个"]
    batched = generate(model, TOKENIZER, images=images, prefixes=prefixes, strategy="beam", num_beams=3,
                       max_new_tokens=6)  # fmt: skip
    alone = [
        generate(
            model,
            TOKENIZER,
            images=images[i : i + 1],
            prefixes=prefixes[i : i + 1],
            strategy="beam",
            num_beams=3,
            max_new_tokens=6,
        )[0]  # fmt: skip
        for i in range(2)
    ]
    assert batched == alone


class ScriptedCache:
    """What :class:`ScriptedModel` caches: each row's tokens fed after bos."""

    def __init__(self, rows: int):
        self.fed = [[] for _ in range(rows)]

    def reorder(self, rows_R: torch.Tensor) -> None:
        self.fed = [list(self.fed[r]) for r in rows_R.tolist()]


class ScriptedModel(nn.Module):
    """Returns fixed next-token log-probabilities by the tokens generated so far (after bos), as a
    full forward and through the decoding interface (``start_decoding`` / ``decode_step``)."""

    def __init__(self, table: dict[tuple, dict[int, float]], vocab: int = TOKENIZER.vocab_size):
        super().__init__()
        self.config = M6Config()
        self.table, self.vocab = table, vocab
        self.weight = nn.Parameter(torch.zeros(1))

    def _logprobs(self, generated: list[int]) -> torch.Tensor:
        probs = torch.full((self.vocab,), 1e-9)
        for token, p in self.table.get(tuple(t for t in generated if t != TOKENIZER.pad_id), {}).items():
            probs[token] = p
        return probs.log()

    def forward(self, target_ids, **context):
        rows = [self._logprobs(row) for row in target_ids[:, 1:].tolist()]
        return torch.stack(rows)[:, None].expand(-1, target_ids.shape[1], -1)

    def start_decoding(self, prefix_ids, *, max_target_len, **context):
        return ScriptedCache(prefix_ids.shape[0])

    def decode_step(self, cache, tokens_B):
        for fed, token in zip(cache.fed, tokens_B.tolist(), strict=True):
            fed.append(token)
        return torch.stack([self._logprobs(fed[1:]) for fed in cache.fed])


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_finds_the_likelier_sequence_and_stops_at_eos(use_cache):
    eos, a, b = TOKENIZER.eos_id, 65, 66
    # greedy takes a (0.6) then a poor continuation (0.3 each); b (0.4) then eos (0.9) is likelier
    table = {(): {a: 0.6, b: 0.4}, (a,): {a: 0.3, b: 0.3, eos: 0.3}, (a, a): {eos: 1.0}, (a, b): {eos: 1.0},
             (b,): {eos: 0.9, a: 0.1}}  # fmt: skip
    model = ScriptedModel(table)
    context = build_context(model, TOKENIZER, prefixes=[""])
    options = {"use_cache": use_cache}
    assert greedy_search(model, TOKENIZER, context, max_new_tokens=5, **options) == [[a, a]]
    beam = beam_search(model, TOKENIZER, context, 5, num_beams=2, length_penalty=0.0, **options)
    assert beam == [[b]]
    # max length cuts an unfinished sequence
    assert greedy_search(model, TOKENIZER, context, max_new_tokens=1, **options) == [[a]]


def kept(logits_BV: torch.Tensor) -> list[list[int]]:
    """The token ids that survived :func:`filter_logits`, per row."""
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits_BV]


def test_top_k_keeps_the_k_largest_logits_per_row():
    rows = [[1.0, 3.0, 0.5, 2.0, -1.0, 2.5], [0.0, -2.0, 4.0, 1.0, 3.0, 2.0]]
    logits = torch.tensor(rows)
    filtered = filter_logits(logits, top_k=3)
    assert kept(filtered) == [[1, 3, 5], [2, 4, 5]]
    survivors = torch.isfinite(filtered)
    assert torch.equal(filtered[survivors], logits[survivors])  # survivors keep their logits
    assert logits.tolist() == rows  # the input is not changed
    assert kept(filter_logits(logits, top_k=1)) == [[1], [2]]
    everything = [list(range(6))] * 2
    assert kept(filter_logits(logits, top_k=0)) == kept(filter_logits(logits, top_k=6)) == everything
    # ties with the k-th largest logit survive too
    assert kept(filter_logits(torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 3.0]]), top_k=2)) == [[1, 2, 3, 5]]


# token 1: 0.5, token 3: 0.3, token 0: 0.15, token 2: 0.05 (shuffled, so the sort is exercised)
NUCLEUS_PROBS = [0.15, 0.5, 0.05, 0.3]


@pytest.mark.parametrize(
    "top_p, survivors",
    [
        (0.3, [1]),
        (0.5, [1]),  # 0.5 alone reaches 0.5
        (0.51, [1, 3]),
        (0.7, [1, 3]),  # token 3 crosses the threshold (0.5 + 0.3 = 0.8) and survives
        (0.8, [1, 3]),  # exactly reached by 0.5 + 0.3: the next token is not needed
        (0.81, [0, 1, 3]),
        (0.95, [0, 1, 3]),
        (0.96, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_that_reaches_top_p(top_p, survivors):
    logits = torch.tensor([NUCLEUS_PROBS]).log() + 3.0  # only the softmax matters
    filtered = filter_logits(logits, top_p=top_p)
    assert kept(filtered) == [survivors]
    assert torch.equal(filtered[torch.isfinite(filtered)], logits[0, survivors])
    renormalised = torch.tensor(NUCLEUS_PROBS)[survivors]
    torch.testing.assert_close(
        sampling_probs(logits, top_p=top_p)[0, survivors], renormalised / renormalised.sum()
    )


def test_top_p_works_row_by_row():
    logits = torch.tensor([NUCLEUS_PROBS, [0.25] * 4, [0.97, 0.01, 0.01, 0.01]]).log()
    # uniform: 0.25 + 0.25 + 0.25 is the first sum >= 0.7 (ties keep sort order: three survive)
    survivors = kept(filter_logits(logits, top_p=0.7))
    assert survivors[0] == [1, 3] and len(survivors[1]) == 3 and survivors[2] == [0]


def test_temperature_scales_logits_before_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    close = {"rtol": 0, "atol": 2e-6}
    torch.testing.assert_close(sampling_probs(logits)[0], torch.tensor([0.5, 0.3, 0.15, 0.05]), **close)
    # T = 0.5 squares the probabilities: 0.25 / 0.09 / 0.0225 / 0.0025, over 0.365
    sharp = torch.tensor([0.684932, 0.246575, 0.061644, 0.006849])
    torch.testing.assert_close(sampling_probs(logits, temperature=0.5)[0], sharp, **close)
    # T = 2 takes square roots: 0.707107 / 0.547723 / 0.387298 / 0.223607, over 1.865735
    flat = torch.tensor([0.378996, 0.293569, 0.207585, 0.119849])
    torch.testing.assert_close(sampling_probs(logits, temperature=2.0)[0], flat, **close)
    # top_p 0.7: T = 1 keeps 0.5 + 0.3; T = 2 needs a third token (0.379 + 0.294 = 0.673 < 0.7)
    two = torch.tensor([0.625, 0.375, 0.0, 0.0])
    torch.testing.assert_close(sampling_probs(logits, top_p=0.7)[0], two, **close)
    three = torch.tensor([0.430604, 0.333544, 0.235852, 0.0])  # flat[:3] / 0.880151
    torch.testing.assert_close(sampling_probs(logits, top_p=0.7, temperature=2.0)[0], three, **close)
    # top_p 0.6: T = 1 keeps two tokens (0.5 < 0.6), T = 0.5 only the first (0.685 >= 0.6)
    assert kept(filter_logits(logits, top_p=0.6)) == [[0, 1]]
    assert sampling_probs(logits, top_p=0.6, temperature=0.5)[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p_on_the_renormalised_top_k():
    logits = torch.tensor([[0.3, 0.25, 0.2, 0.1, 0.1, 0.05]]).log()
    # alone, each keeps three tokens: top-3; top_p 0.7 (0.3 + 0.25 = 0.55 < 0.7, + 0.2 = 0.75)
    assert kept(filter_logits(logits, top_k=3)) == kept(filter_logits(logits, top_p=0.7)) == [[0, 1, 2]]
    # together: top-3 renormalised is 0.4 / 0.333 / 0.267, and 0.4 + 0.333 >= 0.7 keeps two
    assert kept(filter_logits(logits, top_k=3, top_p=0.7)) == [[0, 1]]
    expected = torch.tensor([0.3, 0.25, 0, 0, 0, 0]) / 0.55
    torch.testing.assert_close(sampling_probs(logits, top_k=3, top_p=0.7)[0], expected)
    assert kept(filter_logits(logits, top_k=2, top_p=0.99)) == [[0, 1]]  # top-k binds
    # top_p 0.72: T = 1 keeps two (0.4 + 0.333 = 0.733); T = 2 flattens the top-3 to
    # 0.366 / 0.335 / 0.299 (square roots) and needs the third (0.366 + 0.335 = 0.701 < 0.72)
    assert (sampling_probs(logits, top_k=3, top_p=0.72)[0] > 0).tolist() == [True] * 2 + [False] * 4
    flattened = sampling_probs(logits, top_k=3, top_p=0.72, temperature=2.0)[0]
    torch.testing.assert_close(flattened, torch.tensor([0.366385, 0.334462, 0.299152, 0, 0, 0]))


def test_sample_draws_only_surviving_tokens_with_their_probabilities():
    a, b, c, d = 65, 66, 67, 68
    model = ScriptedModel({(): {a: 0.5, b: 0.3, c: 0.15, d: 0.05}})
    context = build_context(model, TOKENIZER, prefixes=[""] * 400)
    g = torch.Generator().manual_seed(0)
    drawn = [t[0] for t in sample(model, TOKENIZER, context, max_new_tokens=1, top_p=0.7, generator=g)]
    assert set(drawn) == {a, b}
    assert abs(drawn.count(a) / 400 - 0.625) < 0.08  # 0.5 / (0.5 + 0.3); 3.3 standard deviations
    drawn = [t[0] for t in sample(model, TOKENIZER, context, max_new_tokens=1, top_k=3, generator=g)]
    assert set(drawn) == {a, b, c}


def test_generation_validates_options(model):
    context = build_context(model, TOKENIZER, prefixes=["x"])
    with pytest.raises(ValueError, match="top_p must be a number in"):
        sample(model, TOKENIZER, context, max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        sample(model, TOKENIZER, context, max_new_tokens=2, top_k=-1)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        sample(model, TOKENIZER, context, max_new_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="top_p must be a number in"):
        filter_logits(torch.zeros(1, 4), top_p=True)
    with pytest.raises(ValueError, match="max_text_len = 48 leaves room for 47 new tokens"):
        greedy_search(model, TOKENIZER, context, max_new_tokens=100)
    with pytest.raises(ValueError, match="strategy must be one of"):
        generate(model, TOKENIZER, prefixes=["x"], strategy="nucleus")


def test_evaluate_captioning_scores_and_shows_progress(model, tmp_path, progress_log):
    stream = progress_log()
    data_dir = write_synthetic_dataset(tmp_path / "data", seed=2, num_train=4, num_heldout=5, progress=False)
    scores = evaluate_captioning(model, TOKENIZER, data_dir, batch_size=2, max_new_tokens=4)
    assert scores["images"] == 5 and 0 <= scores["accuracy"] <= 1 and len(scores["examples"]) == 5
    assert 0 <= scores["bleu4"] <= 100 and 0 <= scores["token_accuracy"] <= 1
    assert set(scores["attribute_accuracy"]) == {"colour", "shape", "position"}
    err = stream.getvalue()
    assert "held-out captioning [" in err and "3/3 | images 5 | exact_match" in err
    stream.seek(0)
    stream.truncate()
    evaluate_captioning(model, TOKENIZER, data_dir, max_new_tokens=2, limit=2, progress=False)
    assert stream.getvalue() == ""


def test_example_yaml_is_the_tiny_preset():
    import yaml

    path = ROOT / "models" / "m6_moe" / "tiny.yaml"
    raw = yaml.safe_load(path.read_text())
    body = {k: v for k, v in raw["model"].items() if k != "name"}
    assert raw["model"]["name"] == "m6_moe"
    assert config_from_dict(M6Config, body, "model") == M6Config.preset("tiny")
    data = config_from_dict(DataConfig, raw["data"], "data")
    assert 2 * data.seq_len <= M6Config.preset("tiny").max_text_len


def _expert_parallel_rank(rank: int, world_size: int) -> tuple[dict, torch.Tensor]:
    from moetrain.config import ParallelConfig
    from moetrain.parallel import ParallelContext
    from moetrain.parallelize import parallelize

    parallel = ParallelContext(ParallelConfig(ep_size=world_size, local_world_size=world_size))
    torch.manual_seed(0)
    model = M6Model(EP_CONFIG)
    parallelize(model, parallel)
    model.eval()
    inputs = random_inputs(EP_CONFIG, generator=torch.Generator().manual_seed(10 + rank))
    inputs["prefix_mask"] = torch.ones(3, 5, dtype=torch.bool)
    inputs["prefix_mask"][: rank + 1, 2:] = False  # ranks route different numbers of tokens
    with torch.no_grad():
        return inputs, model(**inputs)


EP_CONFIG = small_config(
    moe_every=1, moe={"d_ff": 64, "num_experts": 4, "top_k": 2, "eval_capacity_factor": None}
)


def test_expert_parallel_matches_single_process():
    """Two gloo ranks, each holding 2 of the 4 experts of every layer, padding routed nowhere:
    each rank's logits equal a single-process model's with the same seed (experts are seeded by
    their global index)."""
    from tests.helpers.dist_utils import run_distributed

    torch.manual_seed(0)
    reference = M6Model(EP_CONFIG).eval()
    for inputs, logits in run_distributed(_expert_parallel_rank, 2):
        with torch.no_grad():
            torch.testing.assert_close(logits, reference(**inputs), rtol=1e-5, atol=1e-5)
