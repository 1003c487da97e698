"""Pretraining tasks mixed in one run, the sample at each position of the data stream, batching
and the loss.

Tasks:

- ``caption`` (image-to-text): image + empty prefix -> caption (records with an image);
- ``denoise`` (text-to-text, T5 span corruption, :func:`span_corruption`): prefix = text with
  spans replaced by sentinels, target = each sentinel followed by its span (every record);
- ``image_text`` (image + text-to-text): image + the first ``c`` characters of the caption -> the
  rest, ``c ~ U{1, ..., chars - 1}`` over the characters kept (records with an image and >= 2
  characters).

The data stream (:class:`TaskSampler`): epoch ``e`` visits the records a run can use once each,
in the order of a permutation keyed by ``(seed, e)`` (:class:`~m6_moe.shuffle.EpochPermutation`);
the records a run can use are all of them when ``denoise`` has weight > 0, else those with an image
(``caption`` > 0), else those with an image and >= 2 characters. The sample at position ``i`` of
epoch ``e`` draws its task among the tasks its record can serve, with probability proportional to
their weights, and everything random about it (task, span corruption, prefix cut) comes from a
generator seeded by ``(seed, e, i)``: a sample depends on its position only, not on which process
or worker makes it, so any split of the stream between ranks and workers yields the same data.

A record whose image turns out bad (``skip_bad_records``) serves ``denoise`` instead when that task
has weight > 0 (its text is still good); otherwise the position takes a replacement record drawn
uniformly by ``(seed, e, i, attempt)``. A record whose text the tokenizer cannot encode, or turns
into no tokens, is bad too: without ``skip_bad_records`` it raises a one-line ``ValueError`` naming
its manifest line; with it, it is counted (:meth:`~m6_moe.data.ManifestDataset.note_bad`) and the
position takes a replacement record. Either way every position yields exactly one sample, the
same in every process, so ranks stay in step.

Lengths: a record's text is cut to its longest leading part of at most ``seq_len - 1`` tokens that
ends at a character boundary (``tokenizer.encode_head``, which encodes only about that much) before
the task; a cut text is counted in ``truncated_samples``. So prefix <= ``seq_len`` and target (+ bos
/ eos) <= ``seq_len``, and ``image_text``'s prefix and target together are a leading part of the
caption (for the byte tokenizer, ``decode(prefix) + decode(target)`` is one, unless even the first
character is longer than ``seq_len - 1`` bytes).

A batch (legend: B batch, L longest prefix, T longest target + 1, C/H/W image)::

    inputs = {"prefix_ids": [B, L] long, "prefix_mask": [B, L] bool,
              "target_ids": [B, T] long  (bos, target tokens, then pad),
              "target_mask": [B, T] bool,
              "images": [B, C, H, W] float in [-1, 1] (zeros where a sample has none),
              "image_mask": [B] bool}
    labels = [B, T] long  (target tokens, eos, then IGNORE_INDEX)

``images`` is always present, so the image stem takes part in every forward (DDP requires every
parameter to be used on every rank).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset, normalize_pixels
from m6_moe.manifest_index import one_line
from m6_moe.shuffle import EpochPermutation, derive_seed
from moetrain.validation import require_int

IGNORE_INDEX = -100
TASKS = ("caption", "denoise", "image_text")
IMAGE_TASKS = ("caption", "image_text")
_TASK_RECORDS = {"caption": "image", "denoise": "all", "image_text": "image_text"}

# Replacement records tried for one position before giving up (skip mode, denoise weight 0):
# with a share b of bad images the chance to exhaust them is b ** 64.
MAX_REPLACEMENTS = 64


@dataclass
class Sample:
    task: str
    prefix: list[int]
    target: list[int]  # without bos / eos
    image: torch.Tensor | None  # uint8 [C, H, W]
    record: int = -1  # dataset index of the record it was made from
    truncated: bool = False  # its text was cut to fit seq_len


def _random_segments(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """``total`` items split into ``parts`` segments of length >= 1, uniformly over the ways."""
    cuts = (torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def span_corruption(
    tokens: list[int],
    noise_density: float,
    mean_span_length: float,
    sentinel_ids: tuple[int, ...],
    generator: torch.Generator,
) -> tuple[list[int], list[int]]:
    """T5 span corruption of ``n`` tokens: ``noise = clamp(round(n * density), 1, n - 1)`` tokens
    in ``spans = clamp(round(noise / mean_span_length), 1, min(noise, n - noise, sentinels))``
    spans, interleaved with as many kept segments, kept first. Returns ``(prefix, target)``::

        tokens  a b c d e f g     (noise: c d, g)
        prefix  a b <s0> e f <s1>
        target  <s0> c d <s1> g

    A single token is all noise: ``([<s0>], [<s0>, t])``."""
    n = len(tokens)
    if n == 0:
        raise ValueError("span_corruption needs at least one token")
    if n == 1:
        return [sentinel_ids[0]], [sentinel_ids[0], tokens[0]]
    num_noise = min(max(round(n * noise_density), 1), n - 1)
    num_spans = round(num_noise / mean_span_length)
    num_spans = max(1, min(num_spans, num_noise, n - num_noise, len(sentinel_ids)))
    noise_lengths = _random_segments(num_noise, num_spans, generator)
    keep_lengths = _random_segments(n - num_noise, num_spans, generator)
    prefix, target, start = [], [], 0
    for span, (keep, noise) in enumerate(zip(keep_lengths, noise_lengths, strict=True)):
        prefix += tokens[start : start + keep] + [sentinel_ids[span]]
        target += [sentinel_ids[span]] + tokens[start + keep : start + keep + noise]
        start += keep + noise
    return prefix, target


def epoch_record_kind(weights: dict[str, float]) -> str:
    """The records an epoch runs over for task ``weights``: ``"all"`` when ``denoise`` is on (every
    record can serve it), else ``"image"`` when ``caption`` is on, else ``"image_text"``."""
    if weights["denoise"] > 0:
        return "all"
    return "image" if weights["caption"] > 0 else "image_text"


class TaskSampler:
    """The sample at every position of the data stream (see the module docstring).

    ``seq_len``: the longest prefix, and the longest target counting bos / eos. ``seed``: the data
    seed (the run's). A task with weight > 0 and no usable record raises ``ValueError``.
    ``epoch_size``: the records one epoch visits."""

    def __init__(self, dataset: ManifestDataset, tokenizer, tasks: M6TaskConfig, seq_len: int, seed: int = 0):
        require_int("data.seq_len", seq_len, 3, note="(a one-token denoise target: bos, <s0> and the token)")
        self.dataset, self.tokenizer, self.tasks, self.seq_len = dataset, tokenizer, tasks, seq_len
        self.seed = seed
        self.weights = tasks.weights
        usable = {
            "caption": dataset.kind_count("image"),
            "denoise": len(dataset),
            "image_text": dataset.kind_count("image_text"),
        }
        for task, weight in self.weights.items():
            if weight > 0 and not usable[task]:
                raise ValueError(
                    f"task {task!r} has weight {weight} but manifest {dataset.manifest} has no record it can "
                    "use (caption needs an image; image_text an image and >= 2 characters of text); set "
                    f"tasks.{task}_weight: 0"
                )
        self.record_kind = epoch_record_kind(self.weights)
        self.records = dataset.kind(self.record_kind)
        self.epoch_size = len(self.records)
        self._permutation: tuple[int, EpochPermutation] | None = None

    def with_seed(self, seed: int) -> TaskSampler:
        """The same sampler for another seed (another stream over the same dataset)."""
        other = copy.copy(self)
        other.seed, other._permutation = seed, None
        return other

    def record_at(self, epoch: int, index: int) -> int:
        """The dataset index of the record at position ``index`` of epoch ``epoch``."""
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, EpochPermutation(self.epoch_size, derive_seed(self.seed, epoch)))
        return self.records[self._permutation[1](index)]

    def _head(self, record: int, text: str) -> tuple[list[int], int] | None:
        """``tokenizer.encode_head(text, seq_len - 1)``; None for a bad text (skip mode: counted)."""
        try:
            tokens, chars = self.tokenizer.encode_head(text, self.seq_len - 1)
            problem = None if tokens else "the tokenizer turns its text into no tokens"
        except ValueError as error:  # UnicodeEncodeError: a lone surrogate
            problem = f"its text cannot be tokenized ({one_line(error)})"
        if problem is None:
            return tokens, chars
        message = f"{self.dataset.where(record)}: {problem}"
        if not self.dataset.skip_bad_records:
            raise ValueError(message)
        self.dataset.note_bad(record, message)
        return None

    def _choose_task(self, text: str, has_image: bool, generator: torch.Generator) -> str:
        usable = [
            t
            for t in TASKS
            if self.weights[t] > 0 and (t == "denoise" or (has_image and (t == "caption" or len(text) >= 2)))
        ]
        probs = torch.tensor([self.weights[t] for t in usable], dtype=torch.float64)
        return usable[int(torch.multinomial(probs, 1, generator=generator))]

    def sample_at(self, epoch: int, index: int, task: str | None = None) -> Sample:
        """The sample at position ``index`` (``0 <= index < epoch_size``) of epoch ``epoch``; the
        same in every process. ``task``: force a task (tests, probes; the record must serve it)."""
        if task is not None and task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(map(repr, TASKS))}, got {task!r}")
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, index))
        record = self.record_at(epoch, index)
        for attempt in range(1, MAX_REPLACEMENTS + 1):
            text, image_path = self.dataset.read(record)
            head = self._head(record, text)
            if head is None:
                record = self._replacement(epoch, index, attempt, task)
                continue
            chosen = task or self._choose_task(text, image_path is not None, generator)
            image = None
            if chosen in IMAGE_TASKS:
                if image_path is None:
                    raise ValueError(
                        f"{self.dataset.where(record)}: task {chosen!r} needs a record with an image"
                    )
                image = self.dataset.load_image(record)  # raises unless skip_bad_records
                if image is None and task is None and self.weights["denoise"] > 0:
                    chosen = "denoise"  # the text of a record with a bad image is still good
                elif image is None:
                    record = self._replacement(epoch, index, attempt, task)
                    continue
            return self._make(chosen, record, text, head, image, generator)
        raise ValueError(
            f"sample {index} of epoch {epoch}: {MAX_REPLACEMENTS} records drawn in a row had bad images "
            f"or texts ({self.dataset.skipped_records} bad records so far in {self.dataset.manifest})"
        )

    def _replacement(self, epoch: int, index: int, attempt: int, task: str | None) -> int:
        pool = self.records if task is None else self.dataset.kind(_TASK_RECORDS[task])
        return pool[derive_seed(self.seed, epoch, index, attempt) % len(pool)]

    def _make(
        self,
        task: str,
        record: int,
        text: str,
        head: tuple[list[int], int],
        image,
        generator: torch.Generator,
    ) -> Sample:
        tokens, chars = head
        truncated = chars < len(text)
        if task == "denoise":
            cfg = self.tasks
            prefix, target = span_corruption(
                tokens, cfg.noise_density, cfg.mean_span_length, self.tokenizer.sentinel_ids, generator
            )
            return Sample(task, prefix, target, None, record, truncated)
        if task == "caption":
            return Sample(task, [], tokens, image, record, truncated)
        if len(text) < 2:
            raise ValueError(f"{self.dataset.where(record)}: task 'image_text' needs >= 2 characters of text")
        if truncated:
            text = text[:chars]
            if chars < 2:  # one character (or part of one) fits: all of it is the target
                return Sample(task, [], tokens, image, record, truncated)
        cut = int(torch.randint(1, len(text), (), generator=generator))
        prefix, target = self.tokenizer.encode(text[:cut]), self.tokenizer.encode(text[cut:])
        budget = self.seq_len - 1
        if len(prefix) + len(target) > budget:  # a tokenizer that splits the two parts into more tokens
            truncated = True
            prefix = prefix[: budget - 1]
            target = target[: budget - len(prefix)]
        return Sample(task, prefix, target, image, record, truncated)


def collate(
    samples: list[Sample], tokenizer, image_shape: tuple[int, int, int], length: int | None = None
) -> tuple[dict, torch.Tensor]:
    """Pads samples into ``(inputs, labels)`` (see the module docstring for the layout); with
    ``length`` (the sampler's ``seq_len``) ``L = T = length`` whatever the samples, so every batch
    has one shape (pipeline stages exchange fixed-shape tensors). Extra padding changes no loss
    or gradient: it is never attended, routed nor counted."""
    batch = len(samples)
    prefix_len = max(len(s.prefix) for s in samples)
    target_len = max(len(s.target) for s in samples) + 1
    if length is not None:
        if prefix_len > length or target_len > length:
            raise ValueError(
                f"length = {length} is shorter than a sample ({prefix_len} prefix, {target_len} target)"
            )
        prefix_len = target_len = length
    prefix_ids = torch.full((batch, prefix_len), tokenizer.pad_id, dtype=torch.long)
    prefix_mask = torch.zeros(batch, prefix_len, dtype=torch.bool)
    target_ids = torch.full((batch, target_len), tokenizer.pad_id, dtype=torch.long)
    target_mask = torch.zeros(batch, target_len, dtype=torch.bool)
    labels = torch.full((batch, target_len), IGNORE_INDEX, dtype=torch.long)
    images = torch.zeros(batch, *image_shape)
    image_mask = torch.zeros(batch, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n_prefix, n_target = len(sample.prefix), len(sample.target) + 1
        prefix_ids[row, :n_prefix] = torch.tensor(sample.prefix, dtype=torch.long)
        prefix_mask[row, :n_prefix] = True
        target_ids[row, :n_target] = torch.tensor([tokenizer.bos_id, *sample.target], dtype=torch.long)
        target_mask[row, :n_target] = True
        labels[row, :n_target] = torch.tensor([*sample.target, tokenizer.eos_id], dtype=torch.long)
        if sample.image is not None:
            images[row] = normalize_pixels(sample.image)
            image_mask[row] = True
    inputs = {
        "prefix_ids": prefix_ids,
        "prefix_mask": prefix_mask,
        "target_ids": target_ids,
        "target_mask": target_mask,
        "images": images,
        "image_mask": image_mask,
    }
    return inputs, labels


def m6_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the target tokens whose label is not ``IGNORE_INDEX`` (fp32)."""
    return F.cross_entropy(
        logits_BTV.float().reshape(-1, logits_BTV.shape[-1]), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX
    )


def count_target_tokens(labels_BT: torch.Tensor) -> int:
    """The tokens :func:`m6_loss` averages over (labels other than ``IGNORE_INDEX``)."""
    return int((labels_BT != IGNORE_INDEX).sum())


m6_loss.loss_units = count_target_tokens  # the engine weights balanced ranks by target tokens
