"""The language model's data: the embedded byte corpus (``tiny_corpus.txt`` beside this module) or a
UTF-8 text file as byte values, and :class:`TextBatches`, random windows of it for next-byte
prediction whose position is saved in checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch


def load_tiny_corpus() -> torch.Tensor:
    """The embedded demo corpus as a 1-D tensor of UTF-8 byte values (``tiny_corpus.txt`` of this
    package)."""
    from importlib.resources import files

    text = files("moe_lm").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def load_text_corpus(source: str, min_bytes: int) -> torch.Tensor:
    """``"embedded"`` or a UTF-8 text file as byte values; errors name the file."""
    if not isinstance(source, str):
        raise ValueError(f"data.source of moe_lm must be 'embedded' or one text file, got {list(source)!r}")
    if source == "embedded":
        corpus = load_tiny_corpus()
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as error:
            raise ValueError(f"data.source: cannot read {source}: {error.strerror}") from None
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"data.source {source} is not UTF-8 text (byte {error.start} is not valid UTF-8): the "
                "language model trains on text files"
            ) from None
        corpus = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    if corpus.numel() < min_bytes:
        raise ValueError(f"data.source {source} holds {corpus.numel()} bytes; a sequence needs {min_bytes}")
    return corpus


def sample_batch(corpus: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    """Random windows: inputs ``[B, S]`` and next-byte targets ``[B, S]``."""
    starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=generator)
    windows = torch.stack([corpus[s : s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


class TextBatches:
    """Random windows of a byte corpus for next-token prediction; the generator is seeded per
    rank (``seed * 1000003 + rank``) and its state is the data position saved in checkpoints."""

    def __init__(self, corpus: torch.Tensor, batch: int, seq: int, seed: int, rank: int):
        self.corpus, self.batch, self.seq = corpus, batch, seq
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.batches_drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.corpus.numel() - self.seq - 1, (self.batch,), generator=self.generator)
        offsets = torch.arange(self.seq + 1)
        windows = self.corpus[starts.unsqueeze(1) + offsets]
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch * self.seq

    def probe(self, sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of ``sequences`` from a separate stream (profiling, calibration): the data
        position is not moved."""
        return TextBatches(self.corpus, sequences, self.seq, seed, 0).next()

    def reseed(self, seed: int, rank: int, step: int) -> None:
        """A new stream for ``rank`` resuming at ``step`` when no saved position exists for it
        (the run was saved with fewer ranks)."""
        self.generator.manual_seed((seed * 1_000_003 + rank) * 1_000_033 + step)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = state["batches_drawn"]
