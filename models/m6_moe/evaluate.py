"""Held-out captioning accuracy of a trained model on the synthetic dataset.

For every held-out image the model generates a caption greedily from the image and an empty
prefix; it is correct when it equals one of the image's true captions (either language) after
whitespace normalisation. The baseline always answers the training split's most frequent caption.
"""

from __future__ import annotations

from pathlib import Path

import torch

from m6_moe.data import ManifestDataset
from m6_moe.generate import build_context, greedy_search
from m6_moe.synthetic import (
    attribute_accuracy,
    caption_accuracy,
    captions_by_image,
    most_frequent_caption_accuracy,
)
from moetrain.progress import ProgressBar


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
    """Scores over the held-out split of the synthetic dataset in ``data_dir`` (its first ``limit``
    images when given): ``accuracy``, ``baseline_accuracy``, ``attribute_accuracy`` (per colour,
    shape, position), ``images`` and ``examples`` (the first ``num_examples``
    ``(prediction, references)`` pairs). ``progress``: a :class:`~moetrain.progress.ProgressBar`
    over the batches on stderr with the accuracy so far (one greedy generation of up to
    ``max_new_tokens`` full forwards per batch)."""
    data_dir = Path(data_dir)
    cfg = model.config
    heldout = captions_by_image(data_dir / "heldout.jsonl")
    train = captions_by_image(data_dir / "train.jsonl")
    dataset = ManifestDataset(data_dir / "heldout.jsonl", cfg.image_size, cfg.image_channels)
    first_index = {}
    for index, record in enumerate(dataset.records):
        first_index.setdefault(str(record.image.relative_to(data_dir)), index)
    names = list(heldout)[:limit]
    references = [heldout[name] for name in names]
    starts = range(0, len(names), batch_size)
    bar = None
    if progress:
        bar = ProgressBar(len(starts), "held-out captioning", log_every=max(1, len(starts) // 10))
    predictions = []
    for step, start in enumerate(starts, start=1):
        chunk = names[start : start + batch_size]
        images = torch.stack([dataset.load_image(first_index[name]) for name in chunk])
        context = build_context(model, tokenizer, images=images)
        predictions += [tokenizer.decode(t) for t in greedy_search(model, tokenizer, context, max_new_tokens)]
        if bar is not None:
            so_far = caption_accuracy(predictions, references[: len(predictions)])
            bar.update(step, images=len(predictions), accuracy=so_far)
    if bar is not None:
        bar.close()
    train_captions = [c for captions in train.values() for c in captions]
    return {
        "accuracy": caption_accuracy(predictions, references),
        "baseline_accuracy": most_frequent_caption_accuracy(train_captions, references),
        "attribute_accuracy": attribute_accuracy(predictions, references),
        "images": len(names),
        "examples": list(zip(predictions[:num_examples], references[:num_examples], strict=True)),
    }
