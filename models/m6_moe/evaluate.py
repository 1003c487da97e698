"""Scoring a model's captions of a manifest's images against the manifest's texts.

The general path works on any JSON-lines manifest (:class:`~m6_moe.data.ManifestDataset`: image
paths relative to the manifest or absolute):

- the records that have an image are grouped by image file (resolved path), in manifest order;
  every text of an image is one of its references, wherever it stands in the manifest (so even
  ``limit`` images take one pass over the image records: see :func:`images_with_references`);
  text-only records are counted (from the manifest's index) and left out;
- :func:`caption_manifest` captions each image from the image alone (empty prefix), greedy or
  beam search, batched, and measures teacher-forced token accuracy on every reference: the model
  reads ``bos`` + the reference's tokens and predicts each next token (eos included); a token is
  right when its argmax is the reference's;
- :func:`caption_scores` turns predictions into scores: exact match and BLEU-4
  (:mod:`m6_moe.metrics`) and token accuracy; :func:`evaluate_manifest` does both.

:func:`evaluate_captioning` is the synthetic dataset's report for ``scripts/demo.py``: the general
scores on its ``heldout.jsonl`` plus the most-frequent-caption baseline and the per-attribute
(colour / shape / position) accuracy that only mean something there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from m6_moe.data import ManifestDataset, normalize_pixels
from m6_moe.generate import beam_search, build_context, greedy_search
from m6_moe.metrics import bleu4, exact_match
from moetrain.progress import ProgressBar
from moetrain.validation import require_int

EVAL_STRATEGIES = ("greedy", "beam")


@dataclass
class CaptionResult:
    """What :func:`caption_manifest` produced for one dataset (``manifest``: its
    :func:`manifest_label`): per image its absolute path, prediction and references
    (``predictions[i]`` is the caption of ``images[i]``), and the teacher-forced token counts over
    every reference."""

    manifest: str
    images: list[str] = field(default_factory=list)
    predictions: list[str] = field(default_factory=list)
    references: list[list[str]] = field(default_factory=list)
    tokens_correct: int = 0
    tokens_total: int = 0
    truncated_references: int = 0  # longer than the model's text positions: cut for token accuracy
    skipped_images: int = 0  # bad image files skipped (tasks.skip_bad_records)
    text_only_records: int = 0


def manifest_names(dataset: ManifestDataset, shown: int = 3) -> str:
    """The file names of ``dataset``'s manifests for a label: ``"held.jsonl"``, or the first
    ``shown`` joined by ``", "`` with ``" ... (<n> manifests)"`` when there are more."""
    names = ", ".join(m.name for m in dataset.manifests[:shown])
    more = len(dataset.manifests) - shown
    return names + (f" ... ({len(dataset.manifests)} manifests)" if more > 0 else "")


def manifest_label(dataset: ManifestDataset) -> str:
    """What a report calls ``dataset``: its manifest's path (one manifest), the pattern it was
    given (``"held/part-*.jsonl"`` matching several), else ``"<n> manifests (<first> ...)"``."""
    if len(dataset.manifests) > 1 and dataset.source is not None:
        return dataset.source
    return str(dataset.manifest)


# Entries of an index's image_records array read at once (8 bytes each).
_IMAGE_RECORDS_CHUNK = 1 << 16


def image_record_indices(dataset: ManifestDataset) -> Iterator[int]:
    """The dataset indices of the records that have an image, in order (from the manifests'
    indexes, a chunk of their ``image_records`` arrays at a time; no record is read)."""
    for k, index in enumerate(dataset.indexes):
        start = int(dataset.starts[k])
        for first in range(0, index.image_records, _IMAGE_RECORDS_CHUNK):
            chunk = dataset.index(k).array("image_records")[first : first + _IMAGE_RECORDS_CHUNK]
            for local in chunk.tolist():
                yield start + local


def images_with_references(dataset: ManifestDataset, limit: int | None = None) -> list[list[int]]:
    """Record indices grouped by image file (``os.path.abspath`` of the resolved path), images
    in order of first appearance, the first ``limit`` images only when given (the same groups as
    the first ``limit`` of all). Text-only records are left out unread. Reads every record that
    has an image once (a later record can hold another reference of an early image) and holds
    only the kept images' paths."""
    groups: dict[str, list[int]] = {}
    for index in image_record_indices(dataset):
        key = os.path.abspath(dataset.read(index)[1])
        group = groups.get(key)
        if group is not None:
            group.append(index)
        elif limit is None or len(groups) < limit:
            groups[key] = [index]
    return list(groups.values())


def _token_accuracy_batch(model, tokenizer, images_BCHW: torch.Tensor, texts: list[list[str]]) -> tuple:
    """``(correct, total, truncated)`` of teacher-forced next-token prediction: one row per
    (image, reference) pair, ``bos + tokens`` in, ``tokens + eos`` as labels, empty prefix."""
    limit = model.config.max_text_len - 1
    rows, image_rows, truncated = [], [], 0
    for image_index, refs in enumerate(texts):
        for text in refs:
            tokens = tokenizer.encode(text)
            truncated += len(tokens) > limit
            rows.append(tokens[:limit])
            image_rows.append(image_index)
    device = images_BCHW.device
    length = max(len(tokens) for tokens in rows) + 1
    target_ids_RT = torch.full((len(rows), length), tokenizer.pad_id, dtype=torch.long, device=device)
    labels_RT = torch.full_like(target_ids_RT, -1)
    for row, tokens in enumerate(rows):
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        target_ids_RT[row, 0] = tokenizer.bos_id
        target_ids_RT[row, 1 : len(tokens) + 1] = ids
        labels_RT[row, : len(tokens)] = ids
        labels_RT[row, len(tokens)] = tokenizer.eos_id
    mask_RT = labels_RT >= 0
    images_RCHW = images_BCHW[torch.tensor(image_rows, device=device)]
    prefix_ids_R0 = torch.empty(len(rows), 0, dtype=torch.long, device=device)
    logits_RTV = model(
        prefix_ids=prefix_ids_R0, target_ids=target_ids_RT, images=images_RCHW, target_mask=mask_RT
    )
    correct = int(((logits_RTV.argmax(dim=-1) == labels_RT) & mask_RT).sum())
    return correct, int(mask_RT.sum()), truncated


def caption_manifest(
    model,
    tokenizer,
    dataset: ManifestDataset,
    *,
    strategy: str = "greedy",
    num_beams: int = 4,
    length_penalty: float = 1.0,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    limit: int | None = None,
    use_cache: bool = True,
    progress: bool = True,
    description: str | None = None,
) -> CaptionResult:
    """Captions the images of ``dataset`` (its first ``limit`` images when given) in batches of
    ``batch_size`` with ``strategy`` (``"greedy"`` or ``"beam"`` with ``num_beams`` and
    ``length_penalty``) and measures token accuracy on their references (see the module
    docstring). ``progress``: a :class:`~moetrain.progress.ProgressBar` over the batches (logged)
    with the exact match so far. A bad image file raises ``ValueError`` naming the
    manifest line, or is skipped and counted when the dataset skips bad records."""
    if strategy not in EVAL_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, EVAL_STRATEGIES))}, got {strategy!r}")
    require_int("batch_size", batch_size, 1)
    require_int("limit", limit, 1, allow_none=True)
    result = CaptionResult(manifest_label(dataset))
    result.text_only_records = dataset.kind_count("all") - dataset.kind_count("image")
    if dataset.kind_count("image") == 0:
        raise ValueError(f"manifest {result.manifest} has no record with an image to caption")
    groups = images_with_references(dataset, limit)
    starts = range(0, len(groups), batch_size)
    bar = None
    if progress:
        label = description or f"eval {manifest_names(dataset)}"
        bar = ProgressBar(len(starts), label, log_every=max(1, len(starts) // 10))
    device = next(model.parameters()).device

    def caption(context: dict) -> list[list[int]]:
        if strategy == "greedy":
            return greedy_search(model, tokenizer, context, max_new_tokens, use_cache=use_cache)
        return beam_search(model, tokenizer, context, max_new_tokens, num_beams, length_penalty, use_cache)

    was_training = model.training
    model.eval()
    hits = 0
    try:
        for step, start in enumerate(starts, start=1):
            loaded = [
                (indices, dataset.load_image(indices[0])) for indices in groups[start : start + batch_size]
            ]
            result.skipped_images += sum(pixels is None for _, pixels in loaded)
            loaded = [(indices, pixels) for indices, pixels in loaded if pixels is not None]
            if loaded:
                done = len(result.predictions)
                _caption_batch(model, tokenizer, dataset, loaded, result, device, caption)
                new = len(result.predictions) - done
                hits += round(new * exact_match(result.predictions[done:], result.references[done:]))
            if bar is not None:
                so_far = hits / max(len(result.predictions), 1)
                bar.update(step, images=len(result.predictions), exact_match=so_far)
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    if not result.predictions:
        raise ValueError(f"manifest {result.manifest}: every image was skipped ({dataset.skip_summary()})")
    return result


def _caption_batch(model, tokenizer, dataset, loaded, result: CaptionResult, device, caption) -> None:
    """Captions the ``(record indices, uint8 image)`` pairs of ``loaded`` (``caption(context) ->
    token lists``), counts their token accuracy and appends both to ``result``."""
    images_BCHW = normalize_pixels(torch.stack([pixels for _, pixels in loaded])).to(device)
    ids = caption(build_context(model, tokenizer, images=images_BCHW))
    texts = [[dataset.records[i].text for i in indices] for indices, _ in loaded]
    with torch.no_grad():
        correct, total, truncated = _token_accuracy_batch(model, tokenizer, images_BCHW, texts)
    result.images += [os.path.abspath(dataset.records[indices[0]].image) for indices, _ in loaded]
    result.predictions += [tokenizer.decode(tokens) for tokens in ids]
    result.references += texts
    result.tokens_correct += correct
    result.tokens_total += total
    result.truncated_references += truncated


def caption_scores(results: list[CaptionResult], bleu_tokenize: str = "auto") -> dict:
    """Scores over the images of ``results`` together: ``exact_match`` and ``token_accuracy``
    (fractions), ``bleu4`` (0-100) with ``bleu_tokenize`` and ``bleu_signature``, and the counts
    ``images``, ``references``, ``tokens``, ``skipped_images``, ``text_only_records``,
    ``truncated_references``."""
    predictions = [p for r in results for p in r.predictions]
    references = [refs for r in results for refs in r.references]
    tokens = sum(r.tokens_total for r in results)
    return {
        "images": len(predictions),
        "references": sum(len(refs) for refs in references),
        "exact_match": exact_match(predictions, references),
        **bleu4(predictions, references, bleu_tokenize),
        "token_accuracy": sum(r.tokens_correct for r in results) / max(tokens, 1),
        "tokens": tokens,
        "skipped_images": sum(r.skipped_images for r in results),
        "text_only_records": sum(r.text_only_records for r in results),
        "truncated_references": sum(r.truncated_references for r in results),
    }


def evaluate_manifest(
    model, tokenizer, dataset: ManifestDataset, bleu_tokenize: str = "auto", **options
) -> dict:
    """:func:`caption_manifest` then :func:`caption_scores` for one manifest; ``options`` are
    :func:`caption_manifest`'s."""
    return caption_scores([caption_manifest(model, tokenizer, dataset, **options)], bleu_tokenize)


def evaluate_captioning(
    model,
    tokenizer,
    data_dir: str | Path,
    batch_size: int = 32,
    max_new_tokens: int = 48,
    limit: int | None = None,
    num_examples: int = 5,
    progress: bool = True,
) -> dict:
    """The synthetic dataset's report (``scripts/demo.py``): greedy captions of the held-out
    split in ``data_dir`` (its first ``limit`` images when given), scored as
    :func:`caption_scores` does (``exact_match`` is returned as ``accuracy``, with ``bleu4`` and
    ``token_accuracy``), plus ``baseline_accuracy`` (always the training split's most frequent
    caption), ``attribute_accuracy`` (per colour, shape, position), ``images`` and ``examples``
    (the first ``num_examples`` ``(prediction, references)`` pairs)."""
    from m6_moe.synthetic import attribute_accuracy, captions_by_image, most_frequent_caption_accuracy

    data_dir = Path(data_dir)
    cfg = model.config
    dataset = ManifestDataset(data_dir / "heldout.jsonl", cfg.image_size, cfg.image_channels)
    result = caption_manifest(
        model, tokenizer, dataset, max_new_tokens=max_new_tokens, batch_size=batch_size, limit=limit,
        progress=progress, description="held-out captioning",
    )  # fmt: skip
    scores = caption_scores([result])
    train_captions = [
        c for captions in captions_by_image(data_dir / "train.jsonl").values() for c in captions
    ]
    pairs = list(zip(result.predictions, result.references, strict=True))
    return {
        "accuracy": scores["exact_match"],
        "bleu4": scores["bleu4"],
        "token_accuracy": scores["token_accuracy"],
        "baseline_accuracy": most_frequent_caption_accuracy(train_captions, result.references),
        "attribute_accuracy": attribute_accuracy(result.predictions, result.references),
        "images": scores["images"],
        "examples": pairs[:num_examples],
    }
