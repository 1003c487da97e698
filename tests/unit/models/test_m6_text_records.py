"""M6 record texts and manifest lines at their limits: long captions cut before the task (and at a
character boundary), texts the tokenizer cannot use, over-long manifest lines, and the indexes of
older manifest versions that running jobs may still read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from PIL import Image

from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset
from m6_moe.loader import M6Batches
from m6_moe.manifest_index import (
    LONG_LINE_REASON,
    MAX_LINE_BYTES,
    ManifestIndex,
    ensure_index,
    remove_other_indexes,
)
from m6_moe.shuffle import derive_seed
from m6_moe.tasks import TaskSampler
from m6_moe.tokenizer import ByteTokenizer, load_tokenizer
from tests.helpers.paths import ROOT
from tests.unit.models.test_m6_data import write_word_level_tokenizer

TOKENIZER = ByteTokenizer()
LONG_CAPTIONS = [
    "".join(chr(ord("a") + i % 26) for i in range(200)),
    "左边有一个红色的圆形" * 6,
    "a 红色 circle, 左边 and é " * 8,
]


def write_lines(directory: Path, records: list, name: str = "train.jsonl") -> Path:
    """A manifest of ``records`` (dicts, or raw bytes written as they are) next to ``red.png``."""
    directory.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (6, 4), "red").save(directory / "red.png")
    lines = [r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode() for r in records]
    path = directory / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def sampler_for(manifest: Path, seq_len: int = 24, skip: bool = False, tokenizer=TOKENIZER, **tasks):
    dataset = ManifestDataset(manifest, image_size=8, skip_bad_records=skip)
    return TaskSampler(dataset, tokenizer, M6TaskConfig(**tasks), seq_len=seq_len)


# ------------------------------------------------------------------------- cutting long texts
@pytest.mark.parametrize("seq_len", [6, 9, 24])
@pytest.mark.parametrize("caption", LONG_CAPTIONS, ids=["ascii", "chinese", "mixed"])
def test_image_text_prefix_and_target_are_the_start_of_a_long_caption(tmp_path, caption, seq_len):
    sampler = sampler_for(write_lines(tmp_path, [{"image": "red.png", "text": caption}]), seq_len)
    cuts = set()
    for epoch in range(24):
        sample = sampler.sample_at(epoch, 0, "image_text")
        prefix, target = TOKENIZER.decode(sample.prefix), TOKENIZER.decode(sample.target)
        assert caption.startswith(prefix + target), (epoch, prefix, target)
        assert len(sample.prefix) + len(sample.target) <= seq_len - 1 and sample.truncated
        cuts.add(len(prefix))
    if TOKENIZER.encode_head(caption, seq_len - 1)[1] >= 3:  # 3 characters kept: 2 places to cut
        assert len(cuts) > 1  # the cut is still drawn


def test_image_text_draws_as_before_for_captions_that_fit(tmp_path):
    caption = "左边有一个红色的圆形 ok"  # 33 bytes: fits seq_len 40, as the demo's captions do
    sampler = sampler_for(write_lines(tmp_path, [{"image": "red.png", "text": caption}]), seq_len=40)
    for epoch in range(10):
        generator = torch.Generator().manual_seed(derive_seed(0, epoch, 0))
        cut = int(torch.randint(1, len(caption), (), generator=generator))
        sample = sampler.sample_at(epoch, 0, "image_text")
        assert (sample.prefix, sample.target, sample.truncated) == (
            TOKENIZER.encode(caption[:cut]), TOKENIZER.encode(caption[cut:]), False,
        )  # fmt: skip


@pytest.mark.parametrize("task", ["caption", "denoise"])
def test_a_cut_text_ends_at_a_character_boundary(tmp_path, task):
    sampler = sampler_for(write_lines(tmp_path, [{"image": "red.png", "text": "圆" * 30}]), seq_len=24)
    sample = sampler.sample_at(0, 0, task)
    kept = [t for t in sample.prefix + sample.target if t < 256]  # the text's bytes, sentinels left out
    assert sample.truncated and len(kept) == 21  # 7 characters of 3 bytes in 23 tokens
    if task == "caption":
        assert TOKENIZER.decode(sample.target) == "圆" * 7


@pytest.mark.parametrize(
    "text, max_tokens, expected",
    [
        ("abc", 5, ("abc", 3)),
        ("abc", 2, ("ab", 2)),
        ("a圆b", 3, ("a", 1)),
        ("a圆b", 4, ("a圆", 2)),
        ("圆圆", 5, ("圆", 1)),
        ("", 3, ("", 0)),
    ],
)
def test_byte_encode_head_keeps_whole_characters(text, max_tokens, expected):
    kept, chars = expected
    assert TOKENIZER.encode_head(text, max_tokens) == (TOKENIZER.encode(kept), chars)


def test_byte_encode_head_of_a_single_long_character_keeps_its_first_bytes():
    assert TOKENIZER.encode_head("圆a", 2) == (TOKENIZER.encode("圆")[:2], 0)


def test_json_encode_head_keeps_whole_words(tmp_path):
    pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package is not installed")
    words = ["a", "red", "circle", "on", "the", "left"]
    tok = load_tokenizer(str(write_word_level_tokenizer(tmp_path / "words.json", words)))
    text = "a red circle on the left " * 40
    tokens, chars = tok.encode_head(text, 3)
    assert tokens == tok.encode("a red circle") and text[:chars].split() == ["a", "red", "circle"]
    assert tok.encode_head("a red", 3) == (tok.encode("a red"), 5)


def test_a_long_text_is_not_tokenized_whole(tmp_path):
    text = "x" * 1_000_000  # a list of its 1M tokens alone would take 8 MB
    sampler = sampler_for(write_lines(tmp_path, [{"image": "red.png", "text": text}]))
    for task in ("caption", "denoise", "image_text"):
        tracemalloc.start()
        try:
            sample = sampler.sample_at(0, 0, task)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert sample.truncated and peak < 7 * 2**20, (task, peak)  # the 1 MB line read and parsed


# ---------------------------------------------------------------------- texts that are bad
SURROGATE_LINE = b'{"image": "red.png", "text": "bad \\ud800 text"}'


def test_a_lone_surrogate_is_a_bad_line_found_at_index_time(tmp_path):
    manifest = write_lines(tmp_path, [{"image": "red.png", "text": "good"}, SURROGATE_LINE])
    with pytest.raises(
        ValueError, match=r"train\.jsonl:2: text is not valid Unicode \(lone surrogate at character 4\)"
    ):
        ManifestDataset(manifest, image_size=8)
    skipping = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    assert len(skipping) == 1 and skipping.skipped_records == 1


@pytest.fixture()
def dropping_tokenizer(tmp_path):
    """A word-level tokenizer whose BERT normalizer drops control characters: ``"\\x07\\x07"``
    becomes no token."""
    pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package is not installed")
    path = write_word_level_tokenizer(tmp_path / "tok.json", ["good", "text"])
    spec = json.loads(path.read_text())
    spec["normalizer"] = {
        "type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True, "strip_accents": None,
        "lowercase": False,
    }  # fmt: skip
    path.write_text(json.dumps(spec))
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.encode("\x07\x07") == []
    return tokenizer


def test_a_text_of_no_tokens_names_its_line(tmp_path, dropping_tokenizer):
    manifest = write_lines(tmp_path / "m", [{"text": "good text"}, {"text": "\x07\x07"}])
    sampler = sampler_for(manifest, tokenizer=dropping_tokenizer, caption_weight=0, image_text_weight=0)
    bad_position = next(i for i in range(2) if sampler.record_at(0, i) == 1)
    with pytest.raises(ValueError, match=r"train\.jsonl:2: the tokenizer turns its text into no tokens"):
        sampler.sample_at(0, bad_position)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_text_of_no_tokens_is_skipped_and_counted(tmp_path, dropping_tokenizer, workers):
    manifest = write_lines(tmp_path / "m", [{"text": "good text"}, {"text": "\x07\x07"}, {"text": "text"}])
    sampler = sampler_for(
        manifest, skip=True, tokenizer=dropping_tokenizer, caption_weight=0, image_text_weight=0
    )
    batches = M6Batches(sampler, 3, num_patches=4, num_workers=workers)
    try:
        batches.next()
        records = batches.last_report["records"]
    finally:
        batches.close()
    assert 1 not in records and len(records) == 3
    assert batches.skipped_records == 1
    assert "train.jsonl:2: the tokenizer turns its text into no tokens" in sampler.dataset.skip_summary()


# ------------------------------------------------------------------------ long manifest lines
def test_a_line_longer_than_the_bound_is_a_bad_line_never_held_whole(tmp_path):
    array = json.dumps([{"image": "red.png", "text": "y" * 50}] * 250_000).encode()  # 16 MB, one line
    assert len(array) > 10 * MAX_LINE_BYTES
    manifest = write_lines(tmp_path, [{"text": "first"}, array, {"text": "third"}, array[:-1] + b"]"])
    manifest.write_bytes(manifest.read_bytes()[:-1])  # the last line without its newline
    tracemalloc.start()
    try:
        directory = ensure_index(manifest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak
    index = ManifestIndex(manifest, directory)
    assert index.records == 2 and index.bad_reasons == [(2, LONG_LINE_REASON), (4, LONG_LINE_REASON)]
    assert [json.loads(index.read(i))["text"] for i in range(2)] == ["first", "third"]
    assert [index.line_number(i) for i in range(2)] == [1, 3]
    with pytest.raises(ValueError, match=r"train\.jsonl:2: line is longer than 1048576 bytes"):
        ManifestDataset(manifest, image_size=8)


@pytest.mark.parametrize("extra", [0, 1])
def test_a_line_at_the_bound_is_read_and_one_byte_over_is_not(tmp_path, extra):
    record = {"text": "z"}
    padding = MAX_LINE_BYTES + extra - len(json.dumps({**record, "pad": ""}))
    line = json.dumps({**record, "pad": " " * padding}).encode()
    assert len(line) == MAX_LINE_BYTES + extra
    index = ManifestIndex(write_lines(tmp_path, [line]), ensure_index(tmp_path / "train.jsonl"))
    assert (index.records, index.bad_lines) == ((1, 0) if extra == 0 else (0, 1))


def test_reading_a_record_stops_at_the_line_bound(tmp_path):
    manifest = write_lines(tmp_path / "a", [{"text": "short"}])
    changed = write_lines(tmp_path / "b", [b"x" * (4 * MAX_LINE_BYTES)])  # the line at the same offset
    line = ManifestIndex(changed, ensure_index(manifest)).read(0)
    assert MAX_LINE_BYTES < len(line) <= MAX_LINE_BYTES + 4096


# ------------------------------------------------------------- indexes of older versions
def test_reindexing_a_touched_manifest_keeps_the_index_a_running_job_reads(tmp_path):
    manifest = write_lines(
        tmp_path, [{"image": "red.png", "text": "fine"}, {"image": "gone.png", "text": "x"}]
    )
    running = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    old = running.indexes[0].directory
    later = time.time_ns() + 10**9
    os.utime(manifest, ns=(later, later))  # the same content, a new key
    new = ensure_index(manifest)
    assert new != old and old.exists()
    assert running.load_image(1) is None and running.skipped_records == 1  # names its line from old
    assert remove_other_indexes(manifest) == [old] and not old.exists() and new.exists()


def test_the_index_command_prunes_older_indexes(tmp_path):
    manifest = write_lines(tmp_path, [{"text": "one"}])
    old = ensure_index(manifest)
    later = time.time_ns() + 10**9
    os.utime(manifest, ns=(later, later))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'models'}"}
    command = [sys.executable, "-W", "error::RuntimeWarning", "-m", "m6_moe.index_command", "--prune"]
    done = subprocess.run([*command, str(manifest)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{manifest}: 1 older index(es) kept" in done.stderr  # logged by the build
    assert f"{manifest}: removed 1 older index(es)" in done.stdout
    assert not old.exists() and ensure_index(manifest).exists()
