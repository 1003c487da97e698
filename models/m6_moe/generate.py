"""Text generation from an image and/or a text prefix: greedy, top-k / top-p sampling, beam search.

Legend: B inputs, K beams, N = B * K beam rows, T generated so far, V vocabulary. Every strategy
is batched over the B inputs (beam search over B * K rows). A decoder gives the next-token logits:

- with the key/value cache (``use_cache=True``, the default): the model encodes image and prefix
  once (:meth:`~m6_moe.model.M6Model.start_decoding`), then each step feeds only the newest
  token (:meth:`~m6_moe.model.M6Model.decode_step`); the MoE layers route that token only. It
  needs dropless MoE evaluation (``moe.eval_capacity_factor`` None, as in every preset);
- without it: each step runs the whole model on ``[image; prefix; bos + tokens so far]`` and reads
  the last position's logits. Same tokens, several times slower (``benchmarks/decode.py``).

Results are token lists without bos and eos, stopping at the first eos or after
``max_new_tokens``. Rows of a batch do not influence each other when the model's MoE layers are
dropless in eval mode (``moe.eval_capacity_factor`` None, as in every preset); with a capacity cut
the tokens of other rows compete for expert capacity. The model runs in eval mode under
``torch.no_grad()`` and is put back in its previous mode afterwards.
"""

from __future__ import annotations

import contextlib

import torch

from m6_moe.data import normalize_pixels
from m6_moe.tokenizer import encode_prefix
from moetrain.validation import require_bool, require_int, require_number, require_positive_float

STRATEGIES = ("greedy", "sample", "beam")


def build_context(model, tokenizer, images=None, prefixes=None) -> dict:
    """The model inputs shared by every step: ``prefix_ids``/``prefix_mask`` [B, L] and, when
    ``images`` is given, ``images`` [B, C, H, W] (uint8 pixels are normalised; float is taken as
    already normalised) and ``image_mask`` [B]. ``prefixes``: strings (through
    :func:`~m6_moe.tokenizer.encode_prefix`: ``<extra_id_i>`` is sentinel i, a text the tokenizer
    cannot represent faithfully is a ``ValueError``) or token-id lists (None: empty prefixes)."""
    if images is None and prefixes is None:
        raise ValueError("give images, prefixes or both")
    batch = len(prefixes) if prefixes is not None else images.shape[0]
    if images is not None and images.shape[0] != batch:
        raise ValueError(f"images has {images.shape[0]} rows but prefixes has {batch}")
    device = next(model.parameters()).device
    token_lists = [
        encode_prefix(tokenizer, p) if isinstance(p, str) else [int(t) for t in p]
        for p in (prefixes if prefixes is not None else [[]] * batch)
    ]
    length = max(len(t) for t in token_lists)
    prefix_ids = torch.full((batch, length), tokenizer.pad_id, dtype=torch.long, device=device)
    prefix_mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
    for row, tokens in enumerate(token_lists):
        prefix_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        prefix_mask[row, : len(tokens)] = True
    context = {"prefix_ids": prefix_ids, "prefix_mask": prefix_mask}
    if images is not None:
        pixels = normalize_pixels(images) if images.dtype == torch.uint8 else images
        context["images"] = pixels.to(device)
        context["image_mask"] = torch.ones(batch, dtype=torch.bool, device=device)
    return context


@contextlib.contextmanager
def _inference(model):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def room_for_new_tokens(model_config, prefix_len: int) -> int:
    """How many tokens a model with ``model_config`` (an ``M6Config``) can generate after a
    prefix of ``prefix_len`` tokens: the decoder inputs (bos, then every generated token but the
    last) share the ``max_text_len`` text positions with the prefix, so ``max_text_len -
    prefix_len``."""
    return model_config.max_text_len - prefix_len


def check_new_tokens(model_config, prefix_len: int, max_new_tokens: int) -> None:
    """One-line ``ValueError`` unless ``1 <= max_new_tokens <=`` :func:`room_for_new_tokens`."""
    require_int("max_new_tokens", max_new_tokens, 1)
    limit = model_config.max_text_len
    room = room_for_new_tokens(model_config, prefix_len)
    if room < 1:
        raise ValueError(
            f"a prefix of {prefix_len} tokens leaves no room for new tokens: the model's max_text_len = "
            f"{limit} text positions hold the prefix and bos; shorten the prefix"
        )
    if max_new_tokens > room:
        raise ValueError(
            f"max_new_tokens = {max_new_tokens} does not fit after a prefix of {prefix_len} tokens: the "
            f"model's max_text_len = {limit} leaves room for {room} new tokens"
        )


class CachedDecoder:
    """Next-token logits through the model's key/value cache (image and prefix encoded once)."""

    def __init__(self, model, context: dict, max_new_tokens: int):
        self.model = model
        self.cache = model.start_decoding(**context, max_target_len=max_new_tokens)

    def step(self, tokens_R: torch.Tensor) -> torch.Tensor:
        """Feeds one token per row; returns the next-token logits ``[R, V]`` in fp32."""
        return self.model.decode_step(self.cache, tokens_R).float()

    def reorder(self, rows_R: torch.Tensor) -> None:
        self.cache.reorder(rows_R)


class RecomputeDecoder:
    """Next-token logits from a full forward over ``[image; prefix; every token fed so far]``."""

    def __init__(self, model, context: dict, max_new_tokens: int):
        self.model, self.context = model, dict(context)
        self.fed_RT = torch.empty(context["prefix_ids"].shape[0], 0, dtype=torch.long,
                                  device=context["prefix_ids"].device)  # fmt: skip

    def step(self, tokens_R: torch.Tensor) -> torch.Tensor:
        self.fed_RT = torch.cat([self.fed_RT, tokens_R[:, None]], dim=1)
        return self.model(target_ids=self.fed_RT, **self.context)[:, -1].float()

    def reorder(self, rows_R: torch.Tensor) -> None:
        self.fed_RT = self.fed_RT[rows_R]
        self.context = {name: value[rows_R] for name, value in self.context.items()}


def make_decoder(model, context: dict, max_new_tokens: int, use_cache: bool = True):
    """A :class:`CachedDecoder` (``use_cache``) or a :class:`RecomputeDecoder` for ``context``'s
    rows, after checking that ``max_new_tokens`` fits (:func:`check_new_tokens`)."""
    require_bool("use_cache", use_cache)
    check_new_tokens(model.config, context["prefix_ids"].shape[1], max_new_tokens)
    if use_cache and not (hasattr(model, "start_decoding") and hasattr(model, "decode_step")):
        raise ValueError(
            f"{type(model).__name__} has no key/value cache (start_decoding / decode_step): "
            "pass use_cache=False"
        )
    return (CachedDecoder if use_cache else RecomputeDecoder)(model, context, max_new_tokens)


# Top-p: a prefix of the sorted distribution whose mass is within this of ``top_p`` counts as
# reaching it, so that an exact boundary (0.5 + 0.3 at top_p 0.8) is not decided by the rounding of
# softmax and cumsum (done in fp64, errors ~1e-12 at a 21k vocabulary).
TOP_P_TOLERANCE = 1e-6


def check_sampling_options(top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0) -> None:
    """One-line ``ValueError`` naming the first option out of range (see :func:`sampling_probs`)."""
    require_int("top_k", top_k, 0)
    require_number("top_p", top_p, low=0, high=1, low_open=True)
    require_positive_float("temperature", temperature)


def filter_logits(logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """A copy of ``logits_BV`` with -inf for every token filtered out, row by row; survivors keep
    their logits. First top-k: the ``top_k`` largest logits survive (0: no limit; ties with the
    k-th largest survive too). Then top-p (nucleus) on the softmax of what top-k left: sorted by
    probability, a token survives when the mass of the tokens before it is < ``top_p``, i.e. the
    smallest set of most likely tokens whose probability sums to >= ``top_p`` survives, the token
    that crosses ``top_p`` included (1: no limit; :data:`TOP_P_TOLERANCE`). The most likely token
    always survives. Example, probabilities 0.5 / 0.3 / 0.15 / 0.05: top_p 0.5 keeps 1 token, 0.7
    and 0.8 keep 2, 0.9 keeps 3."""
    check_sampling_options(top_k, top_p)
    logits_BV = logits_BV.clone()
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV[logits_BV < kth_B1] = float("-inf")
    if top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.double().softmax(dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_BV = mass_before_BV >= top_p - TOP_P_TOLERANCE
        drop_BV[:, 0] = False
        logits_BV[drop_BV.scatter(1, order_BV, drop_BV)] = float("-inf")
    return logits_BV


def sampling_probs(
    logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0
) -> torch.Tensor:
    """The distribution :func:`sample` draws from, ``[B, V]`` fp32 rows summing to 1:
    ``softmax(filter_logits(logits / temperature, top_k, top_p))``. The temperature comes first,
    so it also changes which tokens top-p keeps (< 1 sharpens: fewer; > 1 flattens: more). Computed
    as ``(logits - row max) / temperature`` in fp64, which the softmax does not notice, so that a
    tiny temperature (1e-40) gives the argmax (ties share it) instead of inf - inf = NaN."""
    check_sampling_options(top_k, top_p, temperature)
    logits_BV = logits_BV.double()
    scaled_BV = (logits_BV - logits_BV.amax(dim=-1, keepdim=True)) / temperature
    return filter_logits(scaled_BV, top_k, top_p).softmax(dim=-1).float()


def _decode(model, tokenizer, context: dict, max_new_tokens: int, choose, use_cache: bool) -> list[list[int]]:
    """Token-by-token decoding; ``choose(logits_BV) -> tokens_B``. Finished rows get pad."""
    decoder = make_decoder(model, context, max_new_tokens, use_cache)
    batch = context["prefix_ids"].shape[0]
    device = context["prefix_ids"].device
    tokens_B = torch.full((batch,), tokenizer.bos_id, dtype=torch.long, device=device)
    generated = []
    finished_B = torch.zeros(batch, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        tokens_B = choose(decoder.step(tokens_B))
        tokens_B = torch.where(finished_B, torch.full_like(tokens_B, tokenizer.pad_id), tokens_B)
        generated.append(tokens_B)
        finished_B |= tokens_B == tokenizer.eos_id
        if bool(finished_B.all()):
            break
    results = []
    for row in torch.stack(generated, dim=1).tolist():
        results.append(row[: row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row)
    return results


def greedy_search(
    model, tokenizer, context: dict, max_new_tokens: int, use_cache: bool = True
) -> list[list[int]]:
    """The most likely token at every step."""
    with _inference(model):
        return _decode(
            model, tokenizer, context, max_new_tokens, lambda logits: logits.argmax(dim=-1), use_cache
        )


def sample(
    model,
    tokenizer,
    context: dict,
    max_new_tokens: int,
    top_k: int = 0,
    top_p: float = 1.0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Samples each token from :func:`sampling_probs` (``top_k``, ``top_p``, ``temperature``);
    ``top_k=1`` is greedy search."""
    check_sampling_options(top_k, top_p, temperature)  # before the first forward

    def choose(logits_BV):
        probs_BV = sampling_probs(logits_BV, top_k, top_p, temperature)
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)

    with _inference(model):
        return _decode(model, tokenizer, context, max_new_tokens, choose, use_cache)


def beam_search(
    model,
    tokenizer,
    context: dict,
    max_new_tokens: int,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    use_cache: bool = True,
) -> list[list[int]]:
    """Beam search with ``num_beams`` beams per input; a hypothesis' score is its summed token
    log-probability (eos included) divided by ``length ** length_penalty``. Each step takes the
    2K best continuations; an eos among the K best finishes a hypothesis, the best non-eos ones
    (up to K) stay alive. An input is done when K hypotheses have finished; at
    ``max_new_tokens`` the alive beams count as finished. ``num_beams=1`` is greedy search.
    Image and prefix are encoded once per input, then their cache is copied to the K beams."""
    require_int("num_beams", num_beams, 1)
    require_number("length_penalty", length_penalty)
    beams = num_beams
    batch = context["prefix_ids"].shape[0]
    device = context["prefix_ids"].device
    scores_BK = torch.full((batch, beams), float("-inf"), device=device)
    scores_BK[:, 0] = 0.0
    generated_NT = torch.empty(batch * beams, 0, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    done = [False] * batch
    with _inference(model):
        decoder = make_decoder(model, context, max_new_tokens, use_cache)
        decoder.reorder(torch.arange(batch, device=device).repeat_interleave(beams))
        tokens_N = torch.full((batch * beams,), tokenizer.bos_id, dtype=torch.long, device=device)
        for step in range(max_new_tokens):
            logprobs_NV = decoder.step(tokens_N).log_softmax(dim=-1)
            vocab = logprobs_NV.shape[-1]
            candidates_BX = (scores_BK.reshape(-1, 1) + logprobs_NV).view(batch, beams * vocab)
            top_scores, top_index = candidates_BX.topk(min(2 * beams, beams * vocab), dim=1)
            rows, tokens, new_scores = [], [], []
            for b in range(batch):
                chosen = []
                if not done[b]:
                    for rank, (score, index) in enumerate(
                        zip(top_scores[b].tolist(), top_index[b].tolist(), strict=True)
                    ):
                        beam, token = divmod(index, vocab)
                        if score == float("-inf"):
                            break
                        if token == tokenizer.eos_id:
                            if rank < beams:
                                history = generated_NT[b * beams + beam].tolist()
                                finished[b].append((score / (step + 1) ** length_penalty, history))
                            continue
                        chosen.append((b * beams + beam, token, score))
                        if len(chosen) == beams:
                            break
                    done[b] = len(finished[b]) >= beams or not chosen
                while len(chosen) < beams:  # done inputs and spare slots: dead beams
                    chosen.append((b * beams, tokenizer.pad_id, float("-inf")))
                for row, token, score in chosen:
                    rows.append(row)
                    tokens.append(token)
                    new_scores.append(score)
            if all(done):
                break
            index_N = torch.tensor(rows, device=device)
            tokens_N = torch.tensor(tokens, device=device)
            decoder.reorder(index_N)
            generated_NT = torch.cat([generated_NT[index_N], tokens_N[:, None]], dim=1)
            scores_BK = torch.tensor(new_scores, device=device).view(batch, beams)
        else:
            length = generated_NT.shape[1]
            for b in range(batch):
                if done[b]:
                    continue
                for k in range(beams):
                    score = float(scores_BK[b, k])
                    if score != float("-inf"):
                        finished[b].append(
                            (score / max(length, 1) ** length_penalty, generated_NT[b * beams + k].tolist())
                        )
    return [max(hyps, key=lambda h: h[0])[1] for hyps in finished]


def generate(
    model,
    tokenizer,
    images=None,
    prefixes=None,
    strategy: str = "greedy",
    max_new_tokens: int = 64,
    **options,
) -> list[str]:
    """Decoded texts for a batch of images and/or prefixes. ``strategy``: ``"greedy"``,
    ``"sample"`` (options ``top_k``, ``top_p``, ``temperature``, ``generator``) or ``"beam"``
    (options ``num_beams``, ``length_penalty``); every strategy takes ``use_cache`` (default
    True: decode with the key/value cache)."""
    context = build_context(model, tokenizer, images, prefixes)
    if strategy == "greedy":
        unknown = sorted(set(options) - {"use_cache"})
        if unknown:
            raise ValueError(f"greedy search takes no options but use_cache, got {unknown}")
        ids = greedy_search(model, tokenizer, context, max_new_tokens, **options)
    elif strategy == "sample":
        ids = sample(model, tokenizer, context, max_new_tokens, **options)
    elif strategy == "beam":
        ids = beam_search(model, tokenizer, context, max_new_tokens, **options)
    else:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    return [tokenizer.decode(tokens) for tokens in ids]
