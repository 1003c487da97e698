"""Pretraining tasks mixed in one run, batching, the engine's batches object and the loss.

Tasks (each sample draws its task with probability proportional to ``M6TaskConfig`` weights, then
a record uniformly among those the task can use):

- ``caption`` (image-to-text): image + empty prefix -> caption (records with an image);
- ``denoise`` (text-to-text, T5 span corruption, :func:`span_corruption`): prefix = text with
  spans replaced by sentinels, target = each sentinel followed by its span (every record);
- ``image_text`` (image + text-to-text): image + the first ``c`` characters of the caption -> the
  rest, ``c ~ U{1, ..., chars - 1}`` (records with an image and >= 2 characters).

Lengths: a record's text is cut to ``seq_len - 1`` tokens before the task (counted in
``truncated_samples``), so prefix <= ``seq_len`` and target (+ bos / eos) <= ``seq_len``.

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset, normalize_pixels

IGNORE_INDEX = -100
TASKS = ("caption", "denoise", "image_text")


@dataclass
class Sample:
    task: str
    prefix: list[int]
    target: list[int]  # without bos / eos
    image: torch.Tensor | None  # uint8 [C, H, W]


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


class TaskSampler:
    """Draws :class:`Sample` s from a :class:`ManifestDataset` with the task mixture of ``tasks``.

    ``seq_len``: the longest prefix, and the longest target counting bos / eos. Records that a
    task can use are fixed at construction; a task with weight > 0 and no usable record raises
    ``ValueError``. Records whose image file turns out bad at load time (skip mode: missing,
    unreadable or undecodable) are dropped from the pools."""

    def __init__(self, dataset: ManifestDataset, tokenizer, tasks: M6TaskConfig, seq_len: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2 (bos/eos + one token), got {seq_len!r}")
        self.dataset, self.tokenizer, self.tasks, self.seq_len = dataset, tokenizer, tasks, seq_len
        self.tokens = [tokenizer.encode(r.text) for r in dataset.records]
        with_image = [i for i, r in enumerate(dataset.records) if r.image is not None]
        self.pools = {
            "caption": with_image,
            "denoise": list(range(len(dataset.records))),
            "image_text": [i for i in with_image if len(dataset.records[i].text) >= 2],
        }
        weights = tasks.weights
        for task, weight in weights.items():
            if weight > 0 and not self.pools[task]:
                raise ValueError(
                    f"task {task!r} has weight {weight} but manifest {dataset.manifest} has no record it can "
                    "use (caption needs an image; image_text an image and >= 2 characters of text); set "
                    f"tasks.{task}_weight: 0"
                )
        self.task_names = [t for t in TASKS if weights[t] > 0]
        self.task_probs = torch.tensor([weights[t] for t in self.task_names], dtype=torch.float64)
        self.truncated_samples = 0

    def _tokens(self, index: int) -> list[int]:
        tokens = self.tokens[index]
        if len(tokens) > self.seq_len - 1:
            self.truncated_samples += 1
            return tokens[: self.seq_len - 1]
        return tokens

    def _draw_index(self, task: str, generator: torch.Generator) -> int:
        """A uniform draw from ``task``'s pool; for the image tasks never a record whose image is
        known bad. Drawing one prunes every such record from the image pools (O(records)), so they
        are rebuilt only when a stale entry is met, not at every newly found bad image. ``denoise``
        uses only the text and keeps every record."""
        while self.pools[task]:
            pool = self.pools[task]
            index = pool[int(torch.randint(len(pool), (), generator=generator))]
            if task == "denoise" or not self.dataset.is_bad(index):
                return index
            bad = self.dataset.undecodable
            for name in ("caption", "image_text"):
                self.pools[name] = [i for i in self.pools[name] if i not in bad]
        raise ValueError(f"task {task!r}: every image record of {self.dataset.manifest} was skipped as bad")

    def sample(self, generator: torch.Generator, task: str | None = None) -> Sample:
        """One sample of ``task`` (None: drawn from the mixture)."""
        if task is None:
            task = self.task_names[int(torch.multinomial(self.task_probs, 1, generator=generator))]
        elif task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(map(repr, TASKS))}, got {task!r}")
        while True:
            index = self._draw_index(task, generator)
            if task == "denoise":
                cfg = self.tasks
                prefix, target = span_corruption(
                    self._tokens(index), cfg.noise_density, cfg.mean_span_length,
                    self.tokenizer.sentinel_ids, generator,
                )  # fmt: skip
                return Sample(task, prefix, target, None)
            image = self.dataset.load_image(index)
            if image is None:  # skipped as bad (counted by the dataset): draw another record
                continue
            if task == "caption":
                return Sample(task, [], self._tokens(index), image)
            text = self.dataset.records[index].text
            cut = int(torch.randint(1, len(text), (), generator=generator))
            prefix, target = self.tokenizer.encode(text[:cut]), self.tokenizer.encode(text[cut:])
            budget = self.seq_len - 1
            if len(prefix) + len(target) > budget:
                self.truncated_samples += 1
                prefix = prefix[: budget - 1]
                target = target[: budget - len(prefix)]
            return Sample(task, prefix, target, image)


def collate(samples: list[Sample], tokenizer, image_shape: tuple[int, int, int]) -> tuple[dict, torch.Tensor]:
    """Pads samples into ``(inputs, labels)`` (see the module docstring for the layout)."""
    batch = len(samples)
    prefix_len = max(len(s.prefix) for s in samples)
    target_len = max(len(s.target) for s in samples) + 1
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


class M6Batches:
    """The engine's batches object: ``next() -> (inputs, labels)`` with ``batch`` samples (the
    engine may set ``batch`` per rank when it balances the global batch across ranks).

    The generator is seeded per rank (``seed * 1000003 + rank``); its state and the counters are
    the data position saved in checkpoints. ``tokens_per_batch``: real (non-padding) positions per
    batch, image patches included, averaged over the batches drawn so far (before the first: the
    most a batch can hold, ``batch * (P + 2 * seq_len)``)."""

    def __init__(self, sampler: TaskSampler, batch: int, seed: int, rank: int, num_patches: int):
        self.sampler = sampler
        self.batch = batch
        self.num_patches = num_patches
        dataset = sampler.dataset
        self.image_shape = (dataset.image_channels, dataset.image_size, dataset.image_size)
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.batches_drawn = 0
        self.positions_drawn = 0
        self.task_counts = dict.fromkeys(TASKS, 0)

    def _draw(self, count: int, generator: torch.Generator) -> tuple[list[Sample], dict, torch.Tensor]:
        samples = [self.sampler.sample(generator) for _ in range(count)]
        return (samples, *collate(samples, self.sampler.tokenizer, self.image_shape))

    def next(self) -> tuple[dict, torch.Tensor]:
        samples, inputs, labels = self._draw(self.batch, self.generator)
        for sample in samples:
            self.task_counts[sample.task] += 1
        self.batches_drawn += 1
        self.positions_drawn += int(
            inputs["prefix_mask"].sum()
            + inputs["target_mask"].sum()
            + inputs["image_mask"].sum() * self.num_patches
        )
        return inputs, labels

    def probe(self, sequences: int, seed: int) -> tuple[dict, torch.Tensor]:
        """A batch of ``sequences`` samples from a separate stream seeded with ``seed`` (profiling,
        calibration); the data position and the counters do not move."""
        truncated = self.sampler.truncated_samples
        _, inputs, labels = self._draw(sequences, torch.Generator().manual_seed(seed))
        self.sampler.truncated_samples = truncated
        return inputs, labels

    def reseed(self, seed: int, rank: int, step: int) -> None:
        """A new stream for ``rank`` resuming at ``step`` when no saved position exists for it
        (the run was saved with fewer ranks): ``(seed * 1000003 + rank) * 1000033 + step``."""
        self.generator.manual_seed((seed * 1_000_003 + rank) * 1_000_033 + step)

    @property
    def tokens_per_batch(self) -> int:
        if self.batches_drawn == 0:
            return self.batch * (self.num_patches + 2 * self.sampler.seq_len)
        return round(self.positions_drawn / self.batches_drawn)

    @property
    def skipped_records(self) -> int:
        """Bad records skipped by the dataset (construction and load time), for the logs."""
        return self.sampler.dataset.skipped_records

    def skip_summary(self, max_reasons: int = 3) -> str:
        """One line for the logs: the count of skipped bad records and the first ``max_reasons``
        reasons (:meth:`ManifestDataset.skip_summary`). The count grows during the run as images
        are first loaded, so it is worth reporting at the end as well as at the start."""
        return self.sampler.dataset.skip_summary(max_reasons)

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "batches_drawn": self.batches_drawn,
            "positions_drawn": self.positions_drawn,
            "task_counts": dict(self.task_counts),
            "truncated_samples": self.sampler.truncated_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = state["batches_drawn"]
        self.positions_drawn = state["positions_drawn"]
        self.task_counts = dict(state["task_counts"])
        self.sampler.truncated_samples = state["truncated_samples"]


def m6_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the target tokens whose label is not ``IGNORE_INDEX`` (fp32)."""
    return F.cross_entropy(
        logits_BTV.float().reshape(-1, logits_BTV.shape[-1]), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX
    )


def count_target_tokens(labels_BT: torch.Tensor) -> int:
    """The tokens :func:`m6_loss` averages over (labels other than ``IGNORE_INDEX``)."""
    return int((labels_BT != IGNORE_INDEX).sum())


m6_loss.loss_units = count_target_tokens  # the engine weights balanced ranks by target tokens
