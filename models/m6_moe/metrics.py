"""Caption scores for any image-caption data: exact match and corpus BLEU-4.

Each image has one prediction and one or more references (every manifest record of that image).

- Exact match (:func:`exact_match`): the share of images whose prediction equals one of its
  references after whitespace normalisation (runs of whitespace become one space, ends trimmed);
  case and punctuation count.
- BLEU-4 (:func:`bleu4`): corpus BLEU from ``sacrebleu`` (``BLEU(max_ngram_order=4)``, its defaults
  otherwise: exponential smoothing, mixed case), 0-100, against every reference of each image. The
  text is split into words by sacrebleu's tokenizer: ``"zh"`` for Chinese (each Chinese
  character is a word, other text as ``"13a"``), ``"13a"`` (sacrebleu's default, the mteval-v13a
  rules: words and punctuation) otherwise. ``tokenize="auto"`` picks ``"zh"`` when any reference
  holds a CJK ideograph, else ``"13a"``. Note that this is not the model's tokenizer: BLEU counts
  words, whatever the model reads.

Token accuracy needs the model and lives in :mod:`m6_moe.evaluate`.
"""

from __future__ import annotations

import re

from m6_moe.optional import sacrebleu_bleu

# The tokenizers of sacrebleu's BLEU that need no extra package ("ja-mecab", "ko-mecab" and the
# sentencepiece ones do), and "auto" (see the module docstring).
BLEU_TOKENIZERS = ("auto", "13a", "zh", "intl", "char", "none")

# CJK Unified Ideographs, extension A and the compatibility block.
_CJK = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def normalize_whitespace(text: str) -> str:
    """Whitespace runs become one space; leading and trailing whitespace is removed."""
    return " ".join(text.split())


def _check_pairs(predictions: list[str], references: list[list[str]]) -> None:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"predictions ({len(predictions)}) and references ({len(references)}) must be equally long "
            "and non-empty"
        )
    for index, refs in enumerate(references):
        if not refs:
            raise ValueError(f"references[{index}] is empty: every prediction needs at least one reference")


def exact_match(predictions: list[str], references: list[list[str]]) -> float:
    """Share of predictions equal to one of their references after :func:`normalize_whitespace`."""
    _check_pairs(predictions, references)
    hits = sum(
        normalize_whitespace(p) in {normalize_whitespace(r) for r in refs}
        for p, refs in zip(predictions, references, strict=True)
    )
    return hits / len(predictions)


def bleu_tokenizer_for(references: list[list[str]]) -> str:
    """``"zh"`` when any reference holds a CJK ideograph, else ``"13a"``."""
    return "zh" if any(_CJK.search(r) for refs in references for r in refs) else "13a"


def bleu4(predictions: list[str], references: list[list[str]], tokenize: str = "auto") -> dict:
    """Corpus BLEU-4 of ``predictions`` against ``references`` (one list per prediction, any
    number each). Returns ``{"bleu4": 0-100, "bleu_tokenize": the tokenizer used,
    "bleu_signature": sacrebleu's signature}`` (the signature names the version and settings, for
    reporting). Needs the ``sacrebleu`` package."""
    _check_pairs(predictions, references)
    if tokenize not in BLEU_TOKENIZERS:
        raise ValueError(f"tokenize must be one of {', '.join(map(repr, BLEU_TOKENIZERS))}, got {tokenize!r}")
    bleu_metric = sacrebleu_bleu()
    if tokenize == "auto":
        tokenize = bleu_tokenizer_for(references)
    # sacrebleu takes one stream per reference slot; images with fewer references pad with None
    slots = max(len(refs) for refs in references)
    streams = [[refs[slot] if slot < len(refs) else None for refs in references] for slot in range(slots)]
    metric = bleu_metric(tokenize=tokenize, max_ngram_order=4)
    score = metric.corpus_score(predictions, streams)
    return {"bleu4": score.score, "bleu_tokenize": tokenize, "bleu_signature": str(metric.get_signature())}
