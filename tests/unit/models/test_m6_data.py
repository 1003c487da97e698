"""M6 data: tokenizer, synthetic dataset, manifest errors, pretraining tasks and batches."""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset
from m6_moe.loader import M6Batches
from m6_moe.synthetic import (
    attribute_accuracy,
    caption_accuracy,
    captions_by_image,
    ensure_synthetic_dataset,
    most_frequent_caption,
    most_frequent_caption_accuracy,
    normalize_caption,
    parse_caption,
    write_synthetic_dataset,
)
from m6_moe.tasks import IGNORE_INDEX, MAX_REPLACEMENTS, TaskSampler, collate, span_corruption
from m6_moe.tokenizer import ByteTokenizer, JSONTokenizer, load_tokenizer

TOKENIZER = ByteTokenizer()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("synthetic") / "data", seed=3, num_train=24, num_heldout=6
    )


def digest(directory: Path) -> dict[str, str]:
    """Content hashes of the dataset's files (manifest indexes, hidden directories, left out)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }


# ---------------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize(
    "text", ["a red circle on the left", "左边有一个红色的圆形", "mixed 中文 and English!"]
)
def test_byte_tokenizer_round_trips(text):
    ids = TOKENIZER.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode([TOKENIZER.bos_id, *ids, TOKENIZER.eos_id, TOKENIZER.pad_id]) == text


def test_byte_tokenizer_special_ids():
    tok = ByteTokenizer(num_sentinels=4)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sentinel_ids, tok.vocab_size) == (
        256, 257, 258, (259, 260, 261, 262), 263,
    )  # fmt: skip
    assert (
        tok.decode([104, 105, tok.sentinel_ids[1], tok.eos_id], skip_special=False) == "hi<extra_id_1><eos>"
    )
    assert len(TOKENIZER.encode("圆")) == 3
    with pytest.raises(ValueError, match="tokenizer must be 'bytes' or the path"):
        load_tokenizer("words")


def write_word_level_tokenizer(path: Path, words: list[str], num_sentinels: int = 16) -> Path:
    """A tiny ``tokenizers`` JSON file written by hand: a word-level model split on whitespace,
    ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<extra_id_i>`` 3 + i, then ``[UNK]`` and ``words``."""
    specials = ["<pad>", "<bos>", "<eos>", *(f"<extra_id_{i}>" for i in range(num_sentinels))]
    vocab = {token: i for i, token in enumerate([*specials, "[UNK]", *words])}
    added = [
        {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t in specials
    ]  # fmt: skip
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }  # fmt: skip
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path


def test_json_tokenizer_round_trips_a_tiny_vocabulary(tmp_path):
    pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package is not installed")
    words = ["a", "red", "circle", "on", "the", "left", "左边", "有", "一个", "红色的", "圆形"]
    path = write_word_level_tokenizer(tmp_path / "tiny.json", words)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, JSONTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.sentinel_ids == tuple(range(3, 19)) and tok.vocab_size == 19 + 1 + len(words)
    for text in ("a red circle on the left", "左边 有 一个 红色的 圆形"):
        ids = tok.encode(text)
        assert ids == [20 + words.index(w) for w in text.split()]
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text  # specials dropped
    assert tok.decode([tok.sentinel_ids[0], *tok.encode("red")], skip_special=False) == "<extra_id_0> red"
    assert tok.encode("a blue circle") == [20, 19, 22]  # unknown word -> [UNK]
    with pytest.raises(ValueError, match="has no special token '<extra_id_16>'"):
        JSONTokenizer(path, num_sentinels=17)
    with pytest.raises(ValueError, match="tokenizer file .*nope.json does not exist"):
        JSONTokenizer(tmp_path / "nope.json")


def test_json_tokenizer_needs_the_tokenizers_package(tmp_path):
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs the 'tokenizers' package"):
            JSONTokenizer(tmp_path / "tok.json")
    else:
        pytest.skip("tokenizers is installed: the ImportError path cannot be exercised")


# ---------------------------------------------------------------------------- synthetic data
def test_synthetic_dataset_is_deterministic(synthetic, tmp_path):
    again = write_synthetic_dataset(tmp_path / "again", seed=3, num_train=24, num_heldout=6)
    assert digest(again) == digest(synthetic)
    other = write_synthetic_dataset(tmp_path / "other", seed=4, num_train=24, num_heldout=6)
    assert digest(other) != digest(synthetic)


def test_synthetic_dataset_shows_progress(tmp_path, progress_log):
    stream = progress_log()
    write_synthetic_dataset(tmp_path / "quiet", num_train=3, num_heldout=2, progress=False)
    assert stream.getvalue() == ""
    write_synthetic_dataset(tmp_path / "shown", num_train=3, num_heldout=2)
    err = stream.getvalue()
    assert "synthetic dataset [" in err and "3/5 | split train" in err and "5/5 | split heldout" in err


def test_synthetic_captions_parse_and_match_the_image(synthetic):
    for split, images in (("train", 24), ("heldout", 6)):
        records = [
            json.loads(line)
            for line in (synthetic / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        ]
        assert len(records) == 2 * images
        for record in records:
            facts = parse_caption(record["text"])
            assert facts is not None, record["text"]
            assert (facts.colour, facts.shape, facts.position, facts.language) == (
                record["colour"], record["shape"], record["position"], record["lang"],
            )  # fmt: skip
            with Image.open(synthetic / record["image"]) as image:
                assert image.size == (64, 64)
                assert image.getpixel((32, 32)) is not None
        assert {r["lang"] for r in records} == {"en", "zh"}
    assert parse_caption("a red circle on the left") == parse_caption("  a red  circle on the left ")
    assert parse_caption("左边有一个红色的圆形").language == "zh"
    assert parse_caption("a red cat on the left") is None


def test_caption_accuracy_and_baseline():
    refs = [["a red circle on the left", "左边有一个红色的圆形"], ["a blue square at the top"]]
    assert caption_accuracy(["左边有一个红色的圆形", "a blue  square at the top "], refs) == 1.0
    assert caption_accuracy(["a red circle on the left", "nope"], refs) == 0.5
    train = ["a blue square at the top", "a blue square at the top", "a red circle on the left"]
    assert most_frequent_caption(train) == "a blue square at the top"
    assert most_frequent_caption_accuracy(train, refs) == 0.5
    assert normalize_caption(" a\t b \n") == "a b"
    scores = attribute_accuracy(["a red square on the left", "garbage"], refs)
    assert scores == {"colour": 0.5, "shape": 0.0, "position": 0.5}


def _ensure(directory: str) -> str:
    return str(ensure_synthetic_dataset(directory, seed=1, num_train=12, num_heldout=2))


def test_ensure_synthetic_dataset_is_race_free_and_checks_parameters(tmp_path):
    target = str(tmp_path / "shared" / "data")
    with ThreadPoolExecutor(3) as pool:  # concurrent writers: one rename wins, the others discard
        assert list(pool.map(_ensure, [target] * 3)) == [target] * 3
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["data"]  # no temporary left
    assert digest(Path(target)) == digest(
        write_synthetic_dataset(tmp_path / "fresh", seed=1, num_train=12, num_heldout=2)
    )
    assert _ensure(target) == target  # reused
    with pytest.raises(ValueError, match="written with .* not"):
        ensure_synthetic_dataset(target, seed=2, num_train=12, num_heldout=2)


# ------------------------------------------------------------------------------ manifest errors
def write_manifest(directory: Path, lines: list) -> Path:
    path = directory / "manifest.jsonl"
    path.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines) + "\n"
    )
    return path


@pytest.fixture()
def images_dir(tmp_path) -> Path:
    Image.new("RGB", (20, 10), (255, 0, 0)).save(tmp_path / "good.png")
    (tmp_path / "garbage.png").write_bytes(b"this is not an image")
    good = (tmp_path / "good.png").read_bytes()
    big = Image.effect_noise((64, 64), 50).convert("RGB")
    big.save(tmp_path / "big.png")
    (tmp_path / "truncated.png").write_bytes((tmp_path / "big.png").read_bytes()[:200])
    (tmp_path / "empty.png").write_bytes(b"")  # a copy cut short: under 4 bytes, Pillow's BMP test raised
    (tmp_path / "short.png").write_bytes(b"\x89PN")
    assert good
    return tmp_path


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ({"image": "good.png"}, r"manifest\.jsonl:2: record has no text"),
        ({"image": "good.png", "text": "  "}, r"manifest\.jsonl:2: record has no text"),
        ('{"image": "good.png", "text": ', r"manifest\.jsonl:2: invalid JSON"),
        ('["good.png", "x"]', r"manifest\.jsonl:2: a record must be a JSON object"),
        ({"image": 3, "text": "x"}, r"manifest\.jsonl:2: 'image' must be a path string or null"),
        # json.loads raises RecursionError for deep nesting, a plain ValueError for a huge integer
        pytest.param(
            '{"text": "x", "n": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"manifest\.jsonl:2: invalid JSON \(nested too deeply\)$",
            id="deep-nesting",
        ),
        pytest.param(
            '{"text": "x", "n": ' + "1" * 5000 + "}",
            r"manifest\.jsonl:2: invalid JSON \(Exceeds the limit \(4300 digits\) .* 5000 digits\)$",
            id="huge-integer",
        ),
        ({"image": "a\x00.png", "text": "x"}, r"manifest\.jsonl:2: 'image' is not a valid path \(NUL"),
        ('{"image": "a\\ud800.png", "text": "x"}', r"manifest\.jsonl:2: 'image' is not a valid path \(lone"),
    ],
)
def test_bad_manifest_lines_stop_with_file_and_line(images_dir, bad_line, message):
    manifest = write_manifest(images_dir, [{"image": "good.png", "text": "fine"}, bad_line])
    with pytest.raises(ValueError, match=message) as error:
        ManifestDataset(manifest, image_size=8)
    assert "\n" not in str(error.value)
    skipping = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    assert len(skipping) == 1 and skipping.skipped_records == 1
    assert "manifest.jsonl:2" in skipping.skip_reasons[0]


@pytest.mark.parametrize(
    "image, message",
    [
        ("missing.png", r"manifest\.jsonl:2: image .*missing\.png does not exist"),
        ("garbage.png", r"manifest\.jsonl:2: image .*garbage\.png cannot be read"),
        ("truncated.png", r"manifest\.jsonl:2: image .*truncated\.png cannot be decoded"),
        ("empty.png", r"manifest\.jsonl:2: image .*empty\.png cannot be read"),
        ("short.png", r"manifest\.jsonl:2: image .*short\.png cannot be read"),
    ],
)
def test_bad_image_files_are_found_at_first_load(images_dir, image, message, monkeypatch):
    manifest = write_manifest(
        images_dir, [{"image": "good.png", "text": "fine"}, {"image": image, "text": "x"}]
    )
    opened = []
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(args))
    dataset = ManifestDataset(manifest, image_size=8)  # construction opens no image file
    skipping = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    monkeypatch.undo()
    assert opened == [] and len(dataset) == len(skipping) == 2
    with pytest.raises(ValueError, match=message) as error:
        dataset.load_image(1)
    assert "\n" not in str(error.value)
    assert skipping.load_image(1) is None and skipping.load_image(1) is None
    assert skipping.skipped_records == 1 and skipping.is_bad(1) and not skipping.is_bad(0)
    assert re.search(message, skipping.skip_reasons[0])


def test_verify_images_checks_every_header_up_front_with_progress(images_dir, progress_log):
    stream = progress_log()
    lines = [
        {"image": "good.png", "text": "fine"},
        {"image": "missing.png", "text": "x"},
        {"image": "garbage.png", "text": "y"},
        {"image": "truncated.png", "text": "z"},
        {"text": "only text"},
    ]
    manifest = write_manifest(images_dir, lines)
    with pytest.raises(ValueError, match=r"manifest\.jsonl:2: image .*missing\.png does not exist"):
        ManifestDataset(manifest, image_size=8).verify_images(progress=False)
    assert stream.getvalue() == ""
    dataset = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    assert dataset.verify_images() == 2  # the truncated file's header is fine: its pixels fail later
    assert sorted(dataset.undecodable) == [1, 2] and dataset.skipped_records == 2
    err = stream.getvalue()
    assert "checking images of manifest.jsonl" in err and "4/4" in err and "bad 2" in err
    assert dataset.load_image(1) is None and dataset.skipped_records == 2  # counted once
    assert dataset.load_image(3) is None and dataset.skipped_records == 3
    assert dataset.verify_images(progress=False) == 0  # known-bad ones are not checked again


def test_skip_summary_is_one_line_with_count_and_first_reasons(images_dir):
    clean = ManifestDataset(write_manifest(images_dir, [{"image": "good.png", "text": "x"}]), image_size=8)
    assert clean.skip_summary() == f"no bad records skipped ({clean.manifest})"
    lines = [
        {"image": "good.png", "text": "fine"},
        '{"image": ',
        {"image": "good.png"},
        "[1, 2]",
        {"image": "missing.png", "text": "x"},
        {"image": 3, "text": "x"},
    ]
    dataset = ManifestDataset(write_manifest(images_dir, lines), image_size=8, skip_bad_records=True)
    reasons = dataset.skip_reasons
    assert dataset.skip_summary(max_reasons=1) == f"4 bad records skipped: {reasons[0]}; ... 3 more"
    sampler = TaskSampler(dataset, TOKENIZER, M6TaskConfig(denoise_weight=0, image_text_weight=0), seq_len=16)
    batches = M6Batches(sampler, 1, num_patches=4)
    assert dataset.load_image(1) is None  # the missing image: found at load time, counted
    summary = batches.skip_summary()
    assert summary == dataset.skip_summary() and batches.skipped_records == 5
    assert summary.startswith("5 bad records skipped: ") and summary.endswith("; ... 2 more")
    assert all(reason in summary for reason in reasons[:3]) and reasons[3] not in summary
    assert "manifest.jsonl:2: invalid JSON" in summary and "\n" not in summary
    assert dataset.skip_summary(max_reasons=5).endswith("missing.png does not exist")
    one = ManifestDataset(write_manifest(images_dir, lines[:2]), image_size=8, skip_bad_records=True)
    assert one.skip_summary().startswith("1 bad record skipped: ")


def test_empty_manifest_and_all_bad_records_raise(images_dir):
    with pytest.raises(ValueError, match="manifest .*manifest.jsonl holds no usable records"):
        ManifestDataset(write_manifest(images_dir, [""]), image_size=8)
    manifest = write_manifest(images_dir, [{"image": "good.png"}])
    with pytest.raises(ValueError, match=r"holds no usable records \(1 bad records skipped\)"):
        ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    with pytest.raises(ValueError, match="cannot be read"):
        ManifestDataset(images_dir / "nope.jsonl", image_size=8)


def test_all_images_bad_stops_the_image_tasks_but_not_denoise(images_dir):
    """A record whose image is bad serves denoise (its text is good) when denoise is on; without
    denoise the position takes replacement records, and a dataset of bad images stops the run."""
    lines = [{"image": "missing.png", "text": "x y z"}, {"image": "garbage.png", "text": "abc"}]
    dataset = ManifestDataset(write_manifest(images_dir, lines), image_size=8, skip_bad_records=True)
    sampler = TaskSampler(dataset, TOKENIZER, M6TaskConfig(), seq_len=16)
    assert {sampler.sample_at(e, i).task for e in range(10) for i in range(2)} == {"denoise"}
    assert dataset.skipped_records == 2 and sampler.sample_at(0, 0, "denoise").image is None
    caption_only = TaskSampler(dataset, TOKENIZER, M6TaskConfig(denoise_weight=0, image_text_weight=0), 16)
    with pytest.raises(
        ValueError, match=f"sample 0 of epoch 0: {MAX_REPLACEMENTS} records drawn in a row had bad"
    ):
        caption_only.sample_at(0, 0)
    with pytest.raises(ValueError, match="records drawn in a row had bad images"):
        sampler.sample_at(0, 0, "image_text")


def test_images_are_rgb_resized_and_decoding_errors_follow_the_skip_rule(images_dir):
    lines = [
        {"image": "good.png", "text": "red"},
        {"image": "truncated.png", "text": "noise"},
        {"text": "only text"},
    ]
    manifest = write_manifest(images_dir, lines)
    dataset = ManifestDataset(manifest, image_size=8)
    pixels = dataset.load_image(0)
    assert pixels.shape == (3, 8, 8) and pixels.dtype == torch.uint8
    assert pixels[0].min() == 255 and pixels[1:].max() == 0
    assert dataset.records[2].image is None
    with pytest.raises(ValueError, match=r"manifest\.jsonl:2: image .*truncated\.png cannot be decoded"):
        dataset.load_image(1)
    skipping = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    assert skipping.load_image(1) is None and skipping.skipped_records == 1
    sampler = TaskSampler(
        skipping, TOKENIZER, M6TaskConfig(denoise_weight=0, image_text_weight=0), seq_len=16
    )
    samples = [sampler.sample_at(epoch, i) for epoch in range(5) for i in range(sampler.epoch_size)]
    assert {TOKENIZER.decode(s.target) for s in samples} == {"red"}  # the bad one is replaced
    assert sampler.epoch_size == 2 and skipping.skipped_records == 1  # counted once
    grey = ManifestDataset(manifest, image_size=4, image_channels=1).load_image(0)
    assert grey.shape == (1, 4, 4)


# --------------------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("length", [1, 2, 3, 10, 57])
def test_span_corruption_keeps_every_token(length):
    tokens = list(range(length))
    sentinels = TOKENIZER.sentinel_ids
    g = torch.Generator().manual_seed(length)
    prefix, target = span_corruption(tokens, 0.15, 3.0, sentinels, g)
    assert target[0] == sentinels[0] and sentinels[0] in prefix
    spans, current = {}, None
    for token in target:
        if token in sentinels:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    rebuilt = [t for token in prefix for t in (spans[token] if token in sentinels else [token])]
    assert rebuilt == tokens
    assert 1 <= sum(len(s) for s in spans.values()) <= max(1, length - 1)


@pytest.fixture(scope="module")
def sampler(synthetic) -> TaskSampler:
    dataset = ManifestDataset(synthetic / "train.jsonl", image_size=16, cache_images=True)
    return TaskSampler(dataset, TOKENIZER, M6TaskConfig(), seq_len=40)


def test_every_task_produces_a_valid_sample(sampler):
    texts = {r.text for r in sampler.dataset.records}
    for i in range(6):
        caption = sampler.sample_at(0, i, "caption")
        assert caption.prefix == [] and caption.image.shape == (3, 16, 16)
        assert TOKENIZER.decode(caption.target) in texts
        mixed = sampler.sample_at(0, i, "image_text")
        assert mixed.image is not None and mixed.prefix and mixed.target
        assert TOKENIZER.decode(mixed.prefix + mixed.target) in texts
        denoise = sampler.sample_at(0, i, "denoise")
        assert denoise.image is None and denoise.target[0] == TOKENIZER.sentinel_ids[0]
        assert len(denoise.prefix) <= 40 and len(denoise.target) + 1 <= 40
        assert caption.record == mixed.record == denoise.record == sampler.record_at(0, i)


def test_a_sample_is_a_function_of_its_position(sampler):
    """Same (seed, epoch, index): same sample, in any order; the task mix follows the weights."""
    forward = [sampler.sample_at(1, i) for i in range(40)]
    backward = [sampler.sample_at(1, i) for i in reversed(range(40))][::-1]
    for a, b in zip(forward, backward, strict=True):
        assert (a.task, a.prefix, a.target, a.record) == (b.task, b.prefix, b.target, b.record)
    other_seed = [sampler.with_seed(1).sample_at(1, i) for i in range(40)]
    assert [s.record for s in other_seed] != [s.record for s in forward]
    tasks = [sampler.sample_at(*divmod(p, sampler.epoch_size)).task for p in range(300)]
    assert all(60 < tasks.count(t) < 140 for t in ("caption", "denoise", "image_text")), tasks


def test_collate_layout(sampler):
    samples = [sampler.sample_at(0, 3, task) for task in ("caption", "denoise", "image_text")]
    inputs, labels = collate(samples, TOKENIZER, (3, 16, 16))
    batch, target_len = labels.shape
    assert inputs["prefix_ids"].shape[1] == max(len(s.prefix) for s in samples)
    assert target_len == max(len(s.target) for s in samples) + 1
    assert inputs["image_mask"].tolist() == [True, False, True]
    assert inputs["images"][1].abs().sum() == 0 and inputs["images"].abs().max() <= 1
    for row, s in enumerate(samples):
        n = len(s.target) + 1
        assert inputs["target_ids"][row, :n].tolist() == [TOKENIZER.bos_id, *s.target]
        assert labels[row, :n].tolist() == [*s.target, TOKENIZER.eos_id]
        assert (labels[row, n:] == IGNORE_INDEX).all() and (
            inputs["target_ids"][row, n:] == TOKENIZER.pad_id
        ).all()
        assert inputs["target_mask"][row].sum() == n and inputs["prefix_mask"][row].sum() == len(s.prefix)


def test_task_weights_and_missing_images(sampler, images_dir):
    only_caption = TaskSampler(
        sampler.dataset, TOKENIZER, M6TaskConfig(denoise_weight=0, image_text_weight=0), 40
    )
    batches = M6Batches(only_caption, 4, num_patches=4)
    batches.next()
    assert batches.task_counts == {"caption": 4, "denoise": 0, "image_text": 0}
    text_only = ManifestDataset(write_manifest(images_dir, [{"text": "no image here"}]), image_size=8)
    with pytest.raises(ValueError, match="task 'caption' has weight 1.0 but manifest .* has no record"):
        TaskSampler(text_only, TOKENIZER, M6TaskConfig(), 40)
    denoise_only = TaskSampler(text_only, TOKENIZER, M6TaskConfig(caption_weight=0, image_text_weight=0), 40)
    assert denoise_only.sample_at(0, 0).task == "denoise"


def test_mixed_records_serve_only_the_tasks_they_can(images_dir):
    """Text-only records serve denoise; with denoise off an epoch runs over the image records only."""
    lines = [{"text": "only text"}, {"image": "good.png", "text": "r"}, {"image": "good.png", "text": "red"}]
    dataset = ManifestDataset(write_manifest(images_dir, lines), image_size=8)
    mixed = TaskSampler(dataset, TOKENIZER, M6TaskConfig(), 16)
    by_record = {}
    for epoch in range(30):
        for i in range(mixed.epoch_size):
            sample = mixed.sample_at(epoch, i)
            by_record.setdefault(sample.record, set()).add(sample.task)
    assert by_record == {0: {"denoise"}, 1: {"caption", "denoise"}, 2: {"caption", "denoise", "image_text"}}
    images = TaskSampler(dataset, TOKENIZER, M6TaskConfig(denoise_weight=0), 16)
    assert images.epoch_size == 2 and sorted(images.record_at(0, i) for i in range(2)) == [1, 2]
    image_text = TaskSampler(dataset, TOKENIZER, M6TaskConfig(denoise_weight=0, caption_weight=0), 16)
    assert image_text.epoch_size == 1 and image_text.sample_at(3, 0).record == 2


def test_long_texts_are_cut_and_counted(images_dir):
    manifest = write_manifest(images_dir, [{"image": "good.png", "text": "圆" * 30}])
    dataset = ManifestDataset(manifest, image_size=8)
    sampler = TaskSampler(dataset, TOKENIZER, M6TaskConfig(), seq_len=16)
    for task in ("caption", "denoise", "image_text"):
        s = sampler.sample_at(0, 0, task)
        assert len(s.prefix) <= 16 and len(s.target) + 1 <= 16 and s.truncated
    batches = M6Batches(sampler, 3, num_patches=4)
    batches.next()
    assert batches.truncated_samples == 3


def test_captions_by_image_groups_languages(synthetic):
    grouped = captions_by_image(synthetic / "heldout.jsonl")
    assert len(grouped) == 6 and all(len(c) == 2 for c in grouped.values())


def test_epoch_boundaries_are_logged_at_debug_only(caplog):
    """On a small manifest a run crosses many epochs: their lines are DEBUG, not INFO."""
    import logging
    from types import SimpleNamespace

    from m6_moe.loader import M6Batches

    batches = SimpleNamespace(sampler=SimpleNamespace(epoch_size=3), offset=2, epoch=0, rank=0)
    with caplog.at_level(logging.DEBUG, logger="moetrain.m6_moe.loader"):
        M6Batches._advance(batches, 7)  # offset 2 + 7 = 9: three epochs further
    assert (batches.epoch, batches.offset) == (3, 0)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "epoch" in r.getMessage()]
    assert lines == [(logging.DEBUG, "data: epoch 3 begins (3 records per epoch)")]
