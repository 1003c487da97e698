"""Caption scores: exact match and BLEU-4 against independently known values."""

from __future__ import annotations

import math

import pytest

from m6_moe.metrics import bleu4, bleu_tokenizer_for, exact_match


def test_bleu4_reproduces_sacrebleus_documented_example():
    """sacrebleu's README: two reference streams, BLEU = 48.53 (82.4/50.0/45.5/37.5, BP 0.943).
    Our references are per hypothesis, so the streams are transposed."""
    streams = [
        ["The dog bit the man.", "It was not unexpected.", "The man bit him first."],
        ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."],
    ]
    hypotheses = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
    per_hypothesis = [list(refs) for refs in zip(*streams, strict=True)]
    result = bleu4(hypotheses, per_hypothesis)
    assert result["bleu4"] == pytest.approx(48.53, abs=0.005)
    assert result["bleu_tokenize"] == "13a"
    assert "nrefs:2" in result["bleu_signature"] and "tok:13a" in result["bleu_signature"]


def test_bleu4_on_chinese_counts_characters():
    """Hand-computed: with one word per Chinese character the 7-character hypothesis matches every
    1..4-gram of the 10-character reference, so BLEU = brevity penalty = exp(1 - 10/7)."""
    result = bleu4(["一个红色的圆形"], [["左边有一个红色的圆形"]])
    assert result["bleu_tokenize"] == "zh"
    assert result["bleu4"] == pytest.approx(100 * math.exp(1 - 10 / 7), abs=1e-6)
    # read as one word per whitespace-separated run (13a), nothing matches
    assert bleu4(["一个红色的圆形"], [["左边有一个红色的圆形"]], tokenize="13a")["bleu4"] == 0.0


def test_bleu4_perfect_and_disjoint_and_variable_reference_counts():
    assert bleu4(["a red circle on the left"], [["a red circle on the left"]])["bleu4"] == pytest.approx(100)
    assert bleu4(["blue square top"], [["a red circle on the left", "left red circle"]])["bleu4"] == 0.0
    # the first image has two references, the second one: the second is padded, not dropped
    mixed = bleu4(["a red circle on the left", "a blue square at the top"],
                  [["a red circle on the left", "x"], ["a blue square at the top"]])  # fmt: skip
    assert mixed["bleu4"] == pytest.approx(100) and "nrefs:var" in mixed["bleu_signature"]


def test_bleu_tokenizer_is_chosen_by_the_references():
    assert bleu_tokenizer_for([["a red circle"], ["左边有一个红色的圆形"]]) == "zh"
    assert bleu_tokenizer_for([["a red circle"], ["café au lait"]]) == "13a"


def test_exact_match_normalises_whitespace_only():
    references = [["a red circle", "左边有一个红色的圆形"], ["a blue square"], ["a dot"]]
    assert exact_match(["  a  red circle ", "A blue square", "a dot."], references) == pytest.approx(1 / 3)
    assert exact_match(["左边有一个红色的圆形", "a blue square", "a dot"], references) == 1.0


def test_scores_reject_bad_input():
    with pytest.raises(ValueError, match="must be equally long and non-empty"):
        exact_match(["a"], [])
    with pytest.raises(ValueError, match=r"references\[0\] is empty"):
        bleu4(["a"], [[]])
    with pytest.raises(ValueError, match="tokenize must be one of 'auto', '13a', 'zh'"):
        bleu4(["a"], [["a"]], tokenize="bytes")
